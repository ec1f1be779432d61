"""A train step on 8 devices equals the same step on one device with the whole batch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from light_jax import evaluation, optim
from light_jax import train_step as step_lib
from light_jax.models import create_model
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from tests.helpers import TinyCNN, info_for, init_variables, random_source

GLOBAL_BATCH = 32


def _config(optimizer: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    {
      "global_batch_size": GLOBAL_BATCH,
      "optimizer": {
        "name": optimizer,
        "base_lr": 0.8,
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 1e-3,
        "warmup_epochs": 0.0,
        "decay": "cosine",
        "end_lr_factor": 0.0,
        "lars_eta": 0.001,
        "lars_trust": "optax",
        "fused_norms": False,
        "label_smoothing": 0.1,
      },
    }
  )


def _run_sharded(model, tx, info, batches, shape, strategy, micro_batches=1):
  mesh = mesh_lib.make_mesh(*shape)
  reducer = reducer_lib.make_gradient_reducer(strategy, *shape)
  state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
  step = step_lib.make_train_step(model, tx, reducer, mesh, info, label_smoothing=0.1, micro_batches=micro_batches)
  sharding = mesh_lib.batch_sharding(mesh)
  for images, labels in batches:
    state, loss = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
    assert loss.shape == (8,)
  return jax.device_get(state)


def _run_reference(model, tx, info, batches, num_shards):
  """One device, whole batch; BatchNorm statistics per shard of `GLOBAL_BATCH / num_shards` rows, as on devices."""
  variables = init_variables(model, info.image_shape)
  params, batch_stats = variables["params"], variables.get("batch_stats", {})
  opt_state = tx.init(params)

  def loss_fn(params, batch_stats, images, labels):
    x = step_lib.normalize(images, info.mean, info.std)

    def shard_loss(xs, ys):  # vmapped over the shards: one copy of the model in the program, not num_shards
      logits, upd = model.apply({"params": params, "batch_stats": batch_stats}, xs, train=True, mutable=["batch_stats"])
      return optim.cross_entropy(logits, ys, info.num_classes, 0.1), upd.get("batch_stats", {})

    losses, stats = jax.vmap(shard_loss)(
      x.reshape(num_shards, -1, *x.shape[1:]), labels.reshape(num_shards, -1, *labels.shape[1:])
    )
    return jnp.mean(losses), jax.tree.map(lambda s: jnp.mean(s, axis=0), stats)

  @jax.jit
  def step(params, batch_stats, opt_state, images, labels):
    grads, batch_stats = jax.grad(loss_fn, has_aux=True)(params, batch_stats, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), batch_stats, opt_state

  for images, labels in batches:
    params, batch_stats, opt_state = step(params, batch_stats, opt_state, images, labels)
  return params, batch_stats


def _batches(n_steps, shape=(12, 12, 1)):
  source = random_source(GLOBAL_BATCH * n_steps, shape)
  return [
    (source.images[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH], source.labels[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH])
    for i in range(n_steps)
  ], info_for(source)


def _max_diff(a, b):
  return max(
    float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


@pytest.mark.parametrize(
  "strategy,shape,optimizer",
  [
    ("hierarchical", (2, 4), "sgd"),
    ("hierarchical", (4, 2), "lars"),
    ("dense", (1, 8), "lamb"),
  ],
  ids=str,
)
def test_step_without_batchnorm_matches_one_device(strategy, shape, optimizer):
  batches, info = _batches(3)
  tx = optim.build_optimizer(
    _config(optimizer).optimizer, optax.constant_schedule({"sgd": 0.1, "lars": 1.0, "lamb": 0.01}[optimizer])
  )
  ours = _run_sharded(TinyCNN(), tx, info, batches, shape, strategy)
  ref_params, _ = _run_reference(TinyCNN(), tx, info, batches, num_shards=1)
  init = init_variables(TinyCNN(), info.image_shape)["params"]
  assert _max_diff(ref_params, init) > 1e-3  # the step really moved the parameters
  assert _max_diff(ours.params, ref_params) < 1e-5
  assert int(ours.step) == 3


def test_resnet_step_with_per_device_batchnorm_matches_one_device():
  batches, info = _batches(2, shape=(16, 16, 1))
  model = create_model("resnet8_small", num_classes=10, width=4)
  tx = optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))
  ours = _run_sharded(model, tx, info, batches, (2, 4), "hierarchical")
  ref_params, ref_stats = _run_reference(model, tx, info, batches, num_shards=8)
  assert _max_diff(ours.params, ref_params) < 1e-5
  # Each device keeps the running statistics of its own batches; their mean is those of the mean statistics.
  own = jax.tree.leaves(ours.batch_stats)
  assert all(x.shape[:2] == (2, 4) for x in own) and max(float(np.ptp(x, axis=(0, 1)).max()) for x in own) > 1e-3
  assert _max_diff(evaluation.mesh_batch_stats(ours.batch_stats), ref_stats) < 1e-5
  # Per-device statistics differ from whole-batch (synchronised) ones: the comparison is meaningful.
  _, sync_stats = _run_reference(model, tx, info, batches, num_shards=1)
  assert _max_diff(evaluation.mesh_batch_stats(ours.batch_stats), sync_stats) > 1e-4


@pytest.mark.parametrize("decay_in_velocity", [True, False], ids=["decay_in_velocity", "decay_after"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy_ball", "nesterov"])
def test_momentum_correction_is_momentum_sgd_with_weight_decay_on_the_buckets_it_does_not_compress(
  nesterov, decay_in_velocity
):
  """DGC's momentum correction moves SGD's momentum into the reducer (optax's is off). A bucket too small
  to compress keeps a velocity there too, and the weight decay runs before the reduction so that it enters
  the velocity (optim.decay_before_reduction), or after it with a momentum of its own
  (comm.decay_in_velocity=False): either way, with every bucket dense the steps are momentum SGD's."""
  batches, info = _batches(3)
  config = _config("sgd")
  config.optimizer.update(nesterov=nesterov, sharded_update=False)
  config.comm = {"momentum_correction": True, "local_trust_ratio": False, "decay_in_velocity": decay_in_velocity}
  schedule, shape, mesh = optax.constant_schedule(0.1), (2, 4), mesh_lib.make_mesh(2, 4)
  ref_params, _ = _run_reference(TinyCNN(), optim.build_optimizer(config.optimizer, schedule), info, batches, 1)
  assert optim.decay_before_reduction(config) == decay_in_velocity
  decay, decay_momentum = not decay_in_velocity, optim.decay_momentum(config)
  assert decay_momentum == (0.0 if decay_in_velocity else 0.9)
  tx = optim.build_optimizer(config.optimizer, schedule, momentum=0.0, decay=decay, decay_momentum=decay_momentum)

  def train(momentum, tx=tx):
    # min_compress_elements above every tensor: hitopk sends each bucket through its dense fallback.
    reducer = reducer_lib.make_gradient_reducer(
      "hitopk", *shape, min_compress_elements=10**9, momentum_correction=momentum, nesterov=nesterov
    )
    state = step_lib.create_train_state(TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0)
    local_tx = optim.local_transform(config)
    step = step_lib.make_train_step(TinyCNN(), tx, reducer, mesh, info, label_smoothing=0.1, local_tx=local_tx)
    sharding = mesh_lib.batch_sharding(mesh)
    for images, labels in batches:
      state, _ = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
    return jax.device_get(state)

  ours = train(momentum=0.9)
  assert all(v.shape[:2] == shape for v in ours.comm_state.values()) and ours.comm_state  # the velocities
  assert _max_diff(ours.params, ref_params) < 1e-5
  assert _max_diff(train(momentum=0.0).params, ref_params) > 1e-3  # without the velocity: another run
  if not decay_in_velocity:  # the decay after the reduction without its momentum: another run
    undamped = optim.build_optimizer(config.optimizer, schedule, momentum=0.0, decay=True)
    assert _max_diff(train(momentum=0.9, tx=undamped).params, ref_params) > 1e-4


def test_the_residual_scale_reaches_the_residuals_each_step():
  """The train step rescales the residuals before each reduction (comm.residual_units="update"): scaled
  by 0 every step, error feedback forgets everything, which is a run without error feedback."""
  batches, info = _batches(3)
  tx = optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))
  mesh = mesh_lib.make_mesh(2, 4)

  def train(error_feedback, residual_rescale=None, nan_at=-1):
    reducer = reducer_lib.make_gradient_reducer(
      "hitopk", 2, 4, density=0.1, min_compress_elements=16, error_feedback=error_feedback
    )
    state = step_lib.create_train_state(TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0)
    step = step_lib.make_train_step(
      TinyCNN(), tx, reducer, mesh, info, 0.1, inject_nan_at_step=nan_at, residual_rescale=residual_rescale
    )
    sharding = mesh_lib.batch_sharding(mesh)
    for images, labels in batches:
      state, _ = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
    return jax.device_get(state).params

  without = train(error_feedback=False)
  assert _max_diff(train(True, residual_rescale=lambda step: jnp.float32(0.0)), without) < 1e-6
  plain = train(True)
  assert _max_diff(plain, without) > 1e-4  # the residuals matter in these 3 steps

  def forget_at(when):
    return lambda step: jnp.where(step == when, 0.0, 1.0).astype(jnp.float32)

  # Before each step's reduction, with that step's number: at step 0 the residuals are still zero (the same
  # run); at steps 1 and 2 what is forgotten is what that step would have sent (another run each).
  assert _max_diff(train(True, residual_rescale=forget_at(0)), plain) < 1e-6
  assert _max_diff(train(True, residual_rescale=forget_at(1)), plain) > 1e-5
  assert _max_diff(train(True, residual_rescale=forget_at(2)), plain) > 1e-5
  # The factor follows the optimizer's count, which a skipped step does not advance (the schedule's): with step 1
  # skipped, step 2 is the optimizer's step 1, so forgetting at 1 takes effect there.
  skipped = train(True, nan_at=1)
  assert _max_diff(train(True, residual_rescale=forget_at(1), nan_at=1), skipped) > 1e-5
  assert _max_diff(train(True, residual_rescale=forget_at(2), nan_at=1), skipped) < 1e-6


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_gradient_accumulation_matches_one_device_with_the_whole_batch(shape):
  # 4 examples per device in 2 micro-batches of 2: without BatchNorm, the mean of the slices' mean
  # gradients is the whole batch's, reduced once.
  batches, info = _batches(3)
  tx = optim.build_optimizer(_config("lars").optimizer, optax.constant_schedule(1.0))
  ours = _run_sharded(TinyCNN(), tx, info, batches, shape, "hierarchical", micro_batches=2)
  ref_params, _ = _run_reference(TinyCNN(), tx, info, batches, num_shards=1)
  assert _max_diff(ours.params, ref_params) < 1e-5


def test_gradient_accumulation_normalises_each_micro_batch_on_its_own():
  batches, info = _batches(2, shape=(16, 16, 1))
  model = create_model("resnet8_small", num_classes=10, width=4)
  tx = optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))
  ours = _run_sharded(model, tx, info, batches, (2, 4), "hierarchical", micro_batches=2)
  ref_params, _ = _run_reference(model, tx, info, batches, num_shards=16)  # BatchNorm over 2 rows at a time
  assert _max_diff(ours.params, ref_params) < 1e-5
  per_device, _ = _run_reference(model, tx, info, batches, num_shards=8)
  assert _max_diff(ours.params, per_device) > 1e-4  # the slices really normalise apart


def test_train_state_is_donated():
  batches, info = _batches(1)
  tx = optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))
  mesh = mesh_lib.make_mesh(2, 4)
  reducer = reducer_lib.make_gradient_reducer("dense", 2, 4)
  state = step_lib.create_train_state(TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0)
  step = step_lib.make_train_step(TinyCNN(), tx, reducer, mesh, info, 0.1)
  sharding = mesh_lib.batch_sharding(mesh)
  images, labels = batches[0]
  step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))


def test_dynamic_loss_scaling_skips_an_overflow_halves_the_scale_then_grows_it():
  batches, info = _batches(4)
  tx = optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))
  mesh = mesh_lib.make_mesh(2, 4)
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 2, 4)
  state = step_lib.create_train_state(
    TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0, initial_loss_scale=2.0**15
  )
  step = step_lib.make_train_step(TinyCNN(), tx, reducer, mesh, info, 0.1, inject_nan_at_step=1, loss_scale_period=2)
  sharding = mesh_lib.batch_sharding(mesh)
  scales = []
  for images, labels in batches:
    before = jax.device_get(state.params)
    state, _ = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
    scales.append((float(state.loss_scale["scale"]), int(state.loss_scale["counter"])))
    if len(scales) == 2:  # the poisoned step changed nothing
      assert _max_diff(jax.device_get(state.params), before) == 0.0
  # Step 0 fine (1 of 2 towards growth), step 1 overflows (halved, counter reset), steps 2-3: 2 good steps.
  assert scales == [(2.0**15, 1), (2.0**14, 0), (2.0**14, 1), (2.0**15, 0)]
  assert int(state.nonfinite_steps) == 1
  # Scaling is exact in powers of two: the good steps equal an unscaled run's (steps 0, 2, 3; 1 skipped).
  plain = _run_sharded(TinyCNN(), tx, info, [batches[0], batches[2], batches[3]], (2, 4), "hierarchical")
  assert _max_diff(jax.device_get(state.params), plain.params) < 1e-6


class _NaNGradientOnUniformImages(nn.Module):
  """TinyCNN plus 4,096 parameters (the one bucket large enough to compress), every other one of which has a NaN
  gradient on a device whose images are all one value (sqrt at 0, times 0), while the loss stays finite: a
  gradient a float16 backward pass can produce. Elsewhere their gradient is finite and not zero."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    extra = self.param("extra", nn.initializers.ones, (4096,))
    varied = (jnp.max(x) > jnp.min(x)).astype(x.dtype)
    weights = jnp.linspace(0.5, 1.5, extra.size)  # distinct gradients, so top-k's choice is unambiguous
    nan_where_uniform = 0.0 * jnp.sum(jnp.sqrt(extra[1::2] * varied))
    logits = TinyCNN()(x, train)
    # On one class's logit only: added to every logit it would leave the softmax, and its gradient, unchanged.
    return logits.at[:, 0].add(1e-2 * jnp.mean(weights * extra)) + nan_where_uniform


def _top_k_steps(initial_loss_scale=None, **step_kwargs):
  """A hitopk (mstopk, 1%) train state of _NaNGradientOnUniformImages on 2 x 4 devices, and a step on host
  arrays that returns the state on the host."""
  model = _NaNGradientOnUniformImages()
  tx = optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))
  mesh = mesh_lib.make_mesh(2, 4)
  reducer = reducer_lib.make_gradient_reducer("hitopk", 2, 4, density=0.01, selector="mstopk")
  info = _batches(1)[1]
  state = step_lib.create_train_state(
    model, tx, reducer, info.image_shape, mesh, seed=0, initial_loss_scale=initial_loss_scale
  )
  step = step_lib.make_train_step(model, tx, reducer, mesh, info, 0.1, **step_kwargs)
  sharding = mesh_lib.batch_sharding(mesh)

  def run(state, images, labels):
    state, loss = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
    return jax.device_get(state), loss

  return state, run


def _poisoned(images):
  """The last device's images all one value: a NaN gradient on that device only, the loss finite."""
  images = images.copy()
  images[-GLOBAL_BATCH // 8 :] = 7
  return images


def _nonzero(tree):
  return any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(tree))


def test_a_nan_in_one_devices_gradient_skips_the_step_even_where_top_k_does_not_send_it():
  """mstopk's threshold search on a NaN fails: it sends entry 0 k times (here a finite 0), so the reduced
  gradient is finite, but the NaNs would stay in the residual and stall every later step's selection. The
  step checks each device's own gradient too, so it is skipped and the residuals stay as they were."""
  batches, _ = _batches(2)
  state, run = _top_k_steps()
  state, _ = run(state, *batches[0])
  assert int(state.nonfinite_steps) == 0 and _nonzero(state.comm_state)  # residuals to keep
  before = state
  state, loss = run(state, _poisoned(batches[1][0]), batches[1][1])
  assert np.all(np.isfinite(loss)) and int(state.nonfinite_steps) == 1
  assert _max_diff(state.comm_state, before.comm_state) == 0.0
  assert _max_diff(state.params, before.params) == 0.0


def test_an_overflow_on_one_device_under_top_k_halves_the_loss_scale_and_leaves_the_residuals():
  """float16's overflow seen by one device only, under hitopk with dynamic loss scaling: the step is skipped,
  the scale halves, each device's residual stays as it was (an inf kept there would be sent for good), and the
  next good step trains and counts towards the scale's growth."""
  batches, _ = _batches(3)
  state, run = _top_k_steps(initial_loss_scale=2.0**15, loss_scale_period=4)

  def scale(state):
    return float(state.loss_scale["scale"]), int(state.loss_scale["counter"])

  state, _ = run(state, *batches[0])
  assert scale(state) == (2.0**15, 1) and _nonzero(state.comm_state)
  before = state
  state, loss = run(state, _poisoned(batches[1][0]), batches[1][1])
  assert np.all(np.isfinite(loss)) and int(state.nonfinite_steps) == 1
  assert scale(state) == (2.0**14, 0)
  assert _max_diff(state.params, before.params) == 0.0
  assert _max_diff(state.comm_state, before.comm_state) == 0.0

  after_skip = state
  state, _ = run(state, *batches[2])
  assert int(state.nonfinite_steps) == 1 and scale(state) == (2.0**14, 1)
  assert _max_diff(state.params, after_skip.params) > 0.0
  assert _max_diff(state.comm_state, after_skip.comm_state) > 0.0  # the unsent entries went into the residuals
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state.comm_state))


def test_eval_step_sums_top1_top5_and_loss_of_the_unmasked_rows_as_numpy_does():
  """A batch whose last rows are padding (mask 0), split over 2 x 4 devices: the sums equal numpy's over the real
  rows of one whole-batch forward pass."""
  batches, info = _batches(1)
  images, labels = batches[0]
  mesh = mesh_lib.make_mesh(2, 4)
  tx = optax.sgd(0.1)
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 2, 4)
  state = step_lib.create_train_state(TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0)
  mask = (np.arange(len(labels)) < len(labels) - 5).astype(np.float32)  # the last 5 rows: padding
  sharding = mesh_lib.batch_sharding(mesh)
  put = lambda x: jax.device_put(x, sharding)  # noqa: E731
  sums = evaluation.make_eval_step(TinyCNN(), mesh, info)(
    state.params, evaluation.mesh_batch_stats(state.batch_stats), put(images), put(labels), put(mask)
  )

  params = jax.device_get(state.params)
  logits = np.asarray(TinyCNN().apply({"params": params}, step_lib.normalize(images, info.mean, info.std)))
  real = mask > 0
  ranked = np.argsort(-logits, axis=1)
  log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  expected = {
    "top1": np.sum((ranked[:, 0] == labels)[real]),
    "top5": np.sum((ranked[:, :5] == labels[:, None]).any(axis=1)[real]),
    "loss": -np.sum(log_probs[np.arange(len(labels)), labels][real]),
    "count": real.sum(),
  }
  for key, value in expected.items():
    assert float(sums[key]) == pytest.approx(float(value), rel=1e-5), key
  assert 0 < expected["top1"] < expected["top5"] < expected["count"]  # the check sees hits and misses of both
