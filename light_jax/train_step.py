"""One training step over the (node, local) device mesh, as a jitted function (the evaluation step:
``evaluation.py``).

One step, on every device at once, inside ``jax.jit`` + ``jax.shard_map``:

  1. normalise the device's shard of the uint8 batch (on the device, not the host);
  2. forward and backward on that shard alone -> the device's *local* gradient;
     (with ``micro_batches`` > 1, in that many sequential slices whose gradients are averaged: gradient
     accumulation, for a batch larger than the device holds, with one reduction per step);
  3. optionally, a per-device transformation of the local gradient before any communication (``local_tx``:
     LARS's trust ratio with ``comm.local_trust_ratio``, or SGD's weight decay before a compressed reduction),
     and the error-feedback residuals brought to this step's learning rate (``residual_rescale``);
  4. the gradient reducer of ``comm.strategy`` (``parallel/reducer.py``) turns local gradients into the
     mean gradient of the global batch (dense psum, hierarchical, or a compressed strategy);
  5. the optimizer applies it, identically on every device, so parameters stay replicated (with
     ``optimizer.sharded_update`` each device updates its shard and the updates are gathered;
     with DiLoCo each machine steps on its own copy, and every H steps they agree again);
  6. BatchNorm running statistics stay per device, each device's running average of its own batches'
     statistics: no collective per step. Evaluation averages them over the mesh (``evaluation.mesh_batch_stats``), which
     gives exactly the running average of the devices' averaged statistics, the running average being linear;
  7. the new state is kept only if no device saw a non-finite loss, gradient or reducer state (a minimum over
     the mesh, so every device decides alike); otherwise the step is skipped and the old state kept. DiLoCo's
     outer step comes after that decision, on what was kept: a skipped sync step still syncs the machines, so
     that evaluations and checkpoints see one model.

With float16 compute the loss is scaled before the backward pass and the gradients unscaled after it
(dynamic loss scaling, ``jmp``); a step whose gradient overflows is skipped like any non-finite step
and lowers the scale.

The loop that drives these steps is ``train_lib.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from light_jax import data as data_lib
from light_jax import optim
from light_jax.parallel.mesh import AXES, BATCH_SPEC, LOCAL, NODE, per_device, this_device
from light_jax.parallel.reducer import Reducer

PyTree = Any


@flax.struct.dataclass
class TrainState:
  """Everything that changes from step to step.

  All fields are replicated over the mesh except ``batch_stats`` (each device's BatchNorm running statistics)
  and ``comm_state`` (per-device state of the gradient reducer, e.g. error-feedback residuals), whose leaves
  have leading dims (nodes, local), and the per-device ``loss_sum`` and ``loss_count``.
  ``nonfinite_steps`` counts the steps whose update was skipped for a non-finite loss or gradient.
  ``loss_sum`` / ``loss_count`` (per device, (nodes, local)) accumulate the training loss of the current
  epoch, so the epoch's mean loss survives a resume from a mid-epoch checkpoint.
  ``loss_scale`` is ``{}`` without loss scaling, else jmp's dynamic loss scale ``{"scale", "counter"}``.
  """

  step: jax.Array
  params: PyTree
  batch_stats: PyTree
  opt_state: PyTree
  comm_state: PyTree
  nonfinite_steps: jax.Array
  loss_sum: jax.Array
  loss_count: jax.Array
  loss_scale: dict[str, jax.Array]


# The train state's layout, which each checkpoint records (``restore_target`` reads older ones):
# 1: one replicated copy of the BatchNorm statistics; 2: the statistics per device.
STATE_LAYOUT = 2

# Partition specs of TrainState, as a pytree prefix usable by shard_map and NamedSharding.
STATE_SPECS = TrainState(
  step=P(),
  params=P(),
  batch_stats=P(NODE, LOCAL),
  opt_state=P(),
  comm_state=P(NODE, LOCAL),
  nonfinite_steps=P(),
  loss_sum=P(NODE, LOCAL),
  loss_count=P(NODE, LOCAL),
  loss_scale=P(),
)


def create_train_state(
  model: nn.Module,
  tx: optax.GradientTransformation,
  reducer: Reducer,
  image_shape: tuple[int, ...],
  mesh: jax.sharding.Mesh,
  seed: int,
  initial_loss_scale: float = 0.0,
) -> TrainState:
  """Initialises the state directly on the mesh: parameters and optimizer state replicated, the BatchNorm
  statistics and the reducer's state per device.

  ``initial_loss_scale`` > 0 turns dynamic loss scaling on, starting from that scale.
  """

  def init():
    variables = model.init(jax.random.key(seed), jnp.zeros((1, *image_shape), jnp.float32), train=False)
    params = variables["params"]
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      batch_stats=jax.tree.map(
        lambda x: jnp.broadcast_to(x, (*mesh.devices.shape, *x.shape)), variables.get("batch_stats", {})
      ),
      # A reducer that updates the parameters itself keeps its optimizer state per device, in comm_state
      # (DiLoCo's opt_state is its outer optimizer's; the sharded update's is empty).
      opt_state=reducer.init_optimizer_state(params) if reducer.updates_parameters else tx.init(params),
      comm_state=reducer.init_state(params),
      nonfinite_steps=jnp.zeros((), jnp.int32),
      loss_sum=jnp.zeros(mesh.devices.shape),
      loss_count=jnp.zeros(mesh.devices.shape, jnp.int32),
      loss_scale={"scale": jnp.float32(initial_loss_scale), "counter": jnp.zeros((), jnp.int32)}
      if initial_loss_scale
      else {},
    )

  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), STATE_SPECS, is_leaf=lambda x: isinstance(x, P))
  return jax.jit(init, out_shardings=shardings)()


def restore_target(abstract_state: TrainState, layout: int) -> tuple[TrainState, Callable[[TrainState], TrainState]]:
  """What a checkpoint of ``layout`` restores as (shapes, dtypes and shardings), and how that becomes a state of
  ``abstract_state``'s layout: a run resumes from a checkpoint that an earlier light_jax wrote. ValueError for a
  later light_jax's layout (a downgrade), whose arrays may have the shapes of this one's and mean otherwise."""
  if layout > STATE_LAYOUT:
    raise ValueError(f"written by a newer light_jax (train state layout {layout}; this one reads 1 to {STATE_LAYOUT})")
  if layout == STATE_LAYOUT:
    return abstract_state, lambda state: state
  per_device = abstract_state.batch_stats  # layout 1 kept one replicated copy: each device starts from it
  mesh = jax.tree.leaves(per_device)[0].sharding.mesh if jax.tree.leaves(per_device) else None
  one_copy = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype, sharding=NamedSharding(mesh, P())), per_device
  )
  spread = jax.jit(
    lambda stats: jax.tree.map(lambda x, target: jnp.broadcast_to(x, target.shape), stats, per_device),
    out_shardings=jax.tree.map(lambda x: x.sharding, per_device),
  )

  def upgrade(state: TrainState) -> TrainState:
    return state.replace(batch_stats=spread(state.batch_stats))

  return abstract_state.replace(batch_stats=one_copy), upgrade


def normalize(images: jax.Array, mean: tuple[float, ...], std: tuple[float, ...]) -> jax.Array:
  """uint8 (B, H, W, C) -> float32 with per-channel zero mean and unit variance."""
  return (images.astype(jnp.float32) - jnp.asarray(mean)) / jnp.asarray(std)


def make_train_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  reducer: Reducer,
  mesh: jax.sharding.Mesh,
  info: data_lib.DatasetInfo,
  label_smoothing: float,
  inject_nan_at_step: int = -1,
  record_boundaries: tuple[int, ...] = (),
  micro_batches: int = 1,
  loss_scale_period: int = 2000,
  unroll_micro_batches: bool | None = None,
  local_tx: optax.GradientTransformation | None = None,
  residual_rescale: Callable[[jax.Array], jax.Array] | None = None,
) -> Callable:
  """Returns ``step(state, images, labels) -> (state, per_device_loss)``, jitted, donating ``state``.

  ``images`` (uint8) and ``labels`` are global arrays sharded over (node, local) on their first dim.
  ``per_device_loss`` has shape (num_devices,): averaging it on the host when logging costs no
  collective in the step.

  A non-finite loss, gradient (a device's own or the reduced one) or reducer state is caught on the device,
  without a host sync: the update is skipped (parameters, BatchNorm statistics, optimizer and reducer state are
  kept, DiLoCo's outer step still taken; ``step``, ``nonfinite_steps``, the loss scale and the epoch's loss
  accumulators still move on).
  ``inject_nan_at_step`` >= 0 poisons that step's loss (a fault drill for tests and ``train.inject_nan_at_step``).
  ``record_boundaries`` (``CompiledSteps.record_boundaries``: each epoch's first step and the run's end, the
  step count one past its last step, which ``state.step`` never reaches here) resets the epoch loss accumulators
  at each epoch's first step; DiLoCo's machines also sync at each epoch's end and the run's. ``micro_batches``:
  slices of the device's batch run one after the other, their gradients averaged before the one reduction
  (gradient accumulation; ``unroll_micro_batches``: None = unrolled on the CPU only, see
  ``accumulate_gradients``). ``loss_scale_period``: finite steps after
  which dynamic loss scaling doubles the scale (with ``state.loss_scale``). ``local_tx``: a stateless
  transformation of each device's gradient before the reduction (``optim.local_transform``).
  ``residual_rescale``: ``step -> factor`` for the reducer's error-feedback residuals before the step's
  reduction (``schedules.residual_rescale`` with ``comm.residual_units="update"``).
  """

  def device_step(state: TrainState, images, labels):
    scaling = (
      jmp.DynamicLossScale(state.loss_scale["scale"], state.loss_scale["counter"], loss_scale_period)
      if state.loss_scale
      else jmp.NoOpLossScale()
    )

    def loss_fn(params, batch_stats, images, labels):
      logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats},
        normalize(images, info.mean, info.std),
        train=True,
        mutable=["batch_stats"],
      )
      loss = optim.cross_entropy(logits, labels, info.num_classes, label_smoothing)
      if inject_nan_at_step >= 0:
        loss = loss * jnp.where(state.step == inject_nan_at_step, jnp.nan, 1.0)
      return scaling.scale(loss), (loss, updates.get("batch_stats", {}))

    grad_fn = jax.grad(loss_fn, has_aux=True)
    # A reducer that updates the parameters says where the forward pass runs (DiLoCo: each machine's own copy).
    forward_params = (
      reducer.machine_params(state.params, state.comm_state) if reducer.updates_parameters else state.params
    )
    # check_vma=False below: grad of replicated params is the *local* gradient, not JAX's implicit
    # psum of it, so the reducer is the only reduction (no silent double sum; tested).
    own_stats = this_device(state.batch_stats)  # this device's running statistics
    if micro_batches == 1:
      local_grads, (loss, new_stats) = grad_fn(forward_params, own_stats, images, labels)
    else:
      local_grads, loss, new_stats = accumulate_gradients(
        grad_fn, forward_params, own_stats, images, labels, micro_batches, unroll_micro_batches
      )
    # Unscaled before the reduction: error-feedback residuals outlive a change of scale.
    local_grads = scaling.unscale(local_grads)
    if local_tx is not None:  # optim.local_transform: LARS's trust ratio or SGD's decay per device
      local_grads, _ = local_tx.update(local_grads, local_tx.init(forward_params), forward_params)
    comm_state = state.comm_state
    if residual_rescale is not None:  # residuals in units of this step's learning rate (comm.residual_units)
      # The optimizer's step count, which the schedule follows: skipped steps do not advance it.
      comm_state = reducer.rescale_residuals(comm_state, residual_rescale(state.step - state.nonfinite_steps))
    grads, comm_state = reducer.reduce(local_grads, comm_state)
    if reducer.updates_parameters:  # DiLoCo's inner step (its outer one: after_step); the sharded update (shards)
      new_params, opt_state, comm_state = reducer.apply(
        grads, state.params, state.opt_state, comm_state, state.step, record_boundaries
      )
    else:
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      new_params = optax.apply_updates(state.params, updates)
    # One decision for every device (with DiLoCo the machines' gradients differ): skip the update if any
    # device saw a non-finite loss, local gradient, reduced gradient or new reducer state. The local gradient
    # and the state too, because top-k may leave a NaN unsent (the reduced gradient is then finite but the NaN
    # would stay in the residual) and a residual may overflow as it accumulates.
    all_ok = jnp.logical_and(jnp.isfinite(loss), jmp.all_finite((local_grads, grads, comm_state)))
    finite = lax.pmin(all_ok.astype(jnp.int32), AXES) > 0
    loss_scale = {}
    if state.loss_scale:  # lower the scale after an overflow, raise it after `loss_scale_period` good steps
      adjusted = scaling.adjust(finite)
      loss_scale = {"scale": adjusted.loss_scale, "counter": adjusted.counter}
    updated = (new_params, per_device(new_stats), opt_state, comm_state)
    kept = (state.params, state.batch_stats, state.opt_state, state.comm_state)
    # From here: the new values where the step was finite, else the state's own.
    params, batch_stats, opt_state, comm_state = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old), updated, kept
    )
    if reducer.updates_parameters:  # DiLoCo's outer step on a sync step, on what was kept: a skipped one syncs too
      params, opt_state, comm_state = reducer.after_step(params, opt_state, comm_state, state.step, record_boundaries)
    new_epoch = jnp.isin(state.step, jnp.asarray(record_boundaries, jnp.int32)) if record_boundaries else False
    loss_ok = jnp.isfinite(loss)
    new_state = state.replace(
      step=state.step + 1,
      params=params,
      batch_stats=batch_stats,
      opt_state=opt_state,
      comm_state=comm_state,
      nonfinite_steps=state.nonfinite_steps + (1 - finite.astype(jnp.int32)),
      loss_sum=jnp.where(new_epoch, 0.0, state.loss_sum) + jnp.where(loss_ok, loss, 0.0),
      loss_count=jnp.where(new_epoch, 0, state.loss_count) + loss_ok.astype(jnp.int32),
      loss_scale=loss_scale,
    )
    return new_state, loss[None]

  sharded = jax.shard_map(
    device_step,
    mesh=mesh,
    in_specs=(STATE_SPECS, BATCH_SPEC, BATCH_SPEC),
    out_specs=(STATE_SPECS, BATCH_SPEC),
    check_vma=False,
  )
  return jax.jit(sharded, donate_argnums=0)


def accumulate_gradients(
  grad_fn: Callable, params, batch_stats, images, labels, micro_batches: int, unroll: bool | None = None
):
  """Runs ``grad_fn`` on ``micro_batches`` slices of the device's batch in turn (``lax.scan``, so one
  slice's activations are alive at a time); returns (mean gradient, mean loss, BatchNorm statistics
  after the last slice). Each slice normalises with its own statistics, as a smaller batch would.

  ``unroll`` None: unrolled on the CPU, where XLA ran the rolled loop of convolutions many times slower
  than the same slices unrolled (``benchmarks/train_step.py --micro_batches``, docs/measurements.md);
  accelerators keep the rolled loop, which bounds the memory to one slice's activations.
  """
  slices = jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), (images, labels))

  def one(carry, batch):
    grad_sum, loss_sum, stats = carry
    grads, (loss, stats) = grad_fn(params, stats, *batch)
    return (jax.tree.map(jnp.add, grad_sum, grads), loss_sum + loss, stats), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  if unroll is None:
    unroll = jax.devices()[0].platform == "cpu"
  (grad_sum, loss_sum, stats), _ = lax.scan(one, (zeros, jnp.zeros(()), batch_stats), slices, unroll=unroll)
  return jax.tree.map(lambda g: g / micro_batches, grad_sum), loss_sum / micro_batches, stats
