"""The train step compiled ahead of time, once per phase of the run.

Two things a step's shapes depend on change during a run: k of top-k (the density warm-up of the
compressed strategies) and the batch shape (progressive resizing, with a batch size per phase). Each
(density, batch shape) pair is a phase; ``CompiledSteps.compile_phases`` compiles every phase's step before
the run's clock starts and ``for_step`` returns it, so images/s and train_seconds measure steps, not
compilation.

The gradient reducer is built here too: with ``comm.fusion="adaptive"`` its MG-WFBP buckets depend on
the batch shape (backward time scales with the examples per device and the pixels per example), so
they are planned per phase, except for compressed strategies and ``auto`` (which may compress), whose
per-bucket residuals in the train state fix the buckets once: those of the phase with the least compute per step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from light_jax import checkpoint as checkpoint_lib
from light_jax import compilation_cache, optim, schedules
from light_jax import train_step as step_lib
from light_jax.data import DatasetInfo
from light_jax.parallel import cost_model
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel.reducer import AUTO, Reducer, reducer_from_config
from light_jax.parallel.sharded_update import sharded_update
from light_jax.parallel.strategies import CommBytes


class CompiledSteps:
  """``for_step(step, state)`` -> (compiled train step, its CommBytes) for the phase of ``step``."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    model: nn.Module,
    optimizer: optim.Optimizer,
    mesh: jax.sharding.Mesh,
    info: DatasetInfo,
    plan: schedules.EpochPlan,
  ):
    """``optimizer``: ``optim.from_config``'s; the sharded update (``optimizer.sharded_update``) builds its
    optimizer on shards from its schedule, momentum and decay."""
    self.config, self.model, self.tx, self.mesh, self.info, self.plan = config, model, optimizer.tx, mesh, info, plan
    comm = config.comm
    nodes, local = mesh.devices.shape
    self.profile = fusion_lib.profile_parameters(model, info.image_shape)  # backward order, FLOPs per tensor
    opt = config.optimizer
    # The config's momentum, which the reducer uses only with momentum correction (the optimizer then has none).
    reducer = reducer_from_config(
      comm, nodes, local, self.profile.order, momentum=opt.momentum, optimizer=optimizer.tx, nesterov=opt.nesterov
    )  # optimizer: DiLoCo's inner one
    # The cluster's costs, read once: links for adaptive fusion and auto, and auto's top-k selection rate.
    self.cost = cost_model.load(comm.cost_model) if cost_model.needs_cost(comm) else None
    if comm.strategy == AUTO and self.cost is not None and not self.cost.has_topk_rate:
      logging.warning(
        "comm.cost_model=%s holds no top-k selection rate (%s), so comm.strategy=auto plans on link time alone, "
        "without the time of its top-k selections (gtopk makes log2(P) + 1 per step); rerun "
        "benchmarks/calibrate_links.py on this cluster to write a file that has one",
        comm.cost_model,
        cost_model.TOPK_RATE,
      )
    if nodes == 1 and comm.strategy == "hitopk":  # valid, and useful to test with; but no gain, only loss
      logging.warning(
        "comm.strategy=hitopk on one node (mesh %d x %d): its top-k only thins what crosses machines, and nothing "
        "does here; it loses what it does not send for no saving. Use hierarchical, or mesh.nodes >= 2.",
        nodes,
        local,
      )
    # A dense strategy's adaptive buckets are planned again for each phase (reducer_at); the others' once.
    self.replans_buckets_per_phase = cost_model.replans_buckets_per_phase(comm)
    if not self.replans_buckets_per_phase:  # planned where the step has the least compute to hide it behind
      reducer = self._planned(reducer, self.batch_shape_at(plan.leanest_step(info.image_shape)))
    if config.optimizer.sharded_update:  # the optimizer moves into the reducer, on each device's shards
      reducer = sharded_update(
        reducer, self.profile.params, opt, optimizer.schedule, optimizer.momentum, optimizer.decay
      )
    # Its init_state is the train state's comm_state; each phase's step uses reducer_at(step), which may
    # re-plan the buckets (adaptive fusion of a dense strategy) but keeps this comm_state's shapes.
    self.reducer = reducer
    self.residual_rescale = None
    if comm.residual_units == "update":
      self.residual_rescale = schedules.residual_rescale(optimizer.schedule)
    # Only the top-k strategies have a density (config.validate refuses a density schedule for the others).
    self.density_warmup_steps, self.final_density = schedules.density_steps(comm, plan)
    # Where the epoch's loss accumulators restart and DiLoCo's machines sync: each epoch's first step, and the
    # run's end, which a max_steps may put inside an epoch: its evaluation must see one model, not stale shared
    # parameters.
    total_steps = schedules.total_steps(config.max_steps, plan)
    self.record_boundaries = tuple(sorted({*plan.first_steps, total_steps}))
    if hasattr(self.reducer, "for_run"):  # DiLoCo: its bytes count the syncs those boundaries add
      self.reducer = self.reducer.for_run(self.record_boundaries, total_steps)
    self._compiled: dict[tuple, tuple[Callable, CommBytes]] = {}

  def batch_shape_at(self, step: int) -> tuple[int, ...]:
    return self.plan.batch_shape_at(step, self.info.image_shape)

  def density_at(self, step: int) -> float:
    comm = self.config.comm
    return schedules.density_at(step, comm.density, self.density_warmup_steps, final=self.final_density)

  def reducer_at(self, step: int) -> Reducer:
    reducer = self.reducer.at_density(self.density_at(step))
    return self._planned(reducer, self.batch_shape_at(step)) if self.replans_buckets_per_phase else reducer

  def compile_phases(
    self, first_step: int, end_step: int, state: step_lib.TrainState, after_each: Callable[[], None]
  ) -> None:
    """Compiles the step of every phase that steps ``first_step`` .. ``end_step`` - 1 reach, calling ``after_each``
    after each compile (the trainer's check for a stop signal that a library swallowed)."""
    for step in range(first_step, end_step):
      if self._phase(step) not in self._compiled:
        self.for_step(step, state)
        after_each()

  def for_step(self, step: int, state: step_lib.TrainState) -> tuple[Callable, CommBytes]:
    key = self._phase(step)
    if key not in self._compiled:
      self._compiled[key] = self._compile(step, state)
    return self._compiled[key]

  def _phase(self, step: int) -> tuple:
    """What a step's compiled function depends on: the top-k density and the batch shape."""
    return (self.density_at(step), self.batch_shape_at(step))

  def _compile(self, step: int, state: step_lib.TrainState) -> tuple[Callable, CommBytes]:
    batch_shape = self.batch_shape_at(step)
    reducer = self.reducer_at(step)
    abstract_state = checkpoint_lib.abstract(state)
    batch_sharding = mesh_lib.batch_sharding(self.mesh)
    images = jax.ShapeDtypeStruct(batch_shape, jnp.uint8, sharding=batch_sharding)
    labels = jax.ShapeDtypeStruct(batch_shape[:1], jnp.int32, sharding=batch_sharding)
    start = time.time()
    train = step_lib.make_train_step(
      self.model,
      self.tx,
      reducer,
      self.mesh,
      self.info,
      label_smoothing=self.config.optimizer.label_smoothing,
      inject_nan_at_step=self.config.train.inject_nan_at_step,
      record_boundaries=self.record_boundaries,
      micro_batches=self.config.micro_batches,
      loss_scale_period=self.config.model.loss_scale_period,
      local_tx=optim.local_transform(self.config),
      residual_rescale=self.residual_rescale,
    )
    hits = compilation_cache.hits()
    compiled = train.lower(abstract_state, images, labels).compile()
    comm_bytes = reducer.bytes_per_step(abstract_state.params)
    logging.info(
      "train step compiled in %.1f s (batch %s%s): %s intra-node and %s inter-node bytes per device per step%s",
      time.time() - start,
      "x".join(map(str, batch_shape)),
      f", {reducer.compression}" if reducer.compression else "",
      f"{comm_bytes.intra_node:,}",
      f"{comm_bytes.inter_node:,}",
      "; read from the compilation cache" if compilation_cache.hits() > hits else "",
    )
    return compiled, comm_bytes

  def comm_bytes_at(self, step: int, params) -> CommBytes:
    """Bytes per device of ``step``'s reduction, without compiling."""
    return self.reducer_at(step).bytes_per_step(params)

  def mean_comm_bytes(self, steps: int, params) -> CommBytes:
    """Bytes per device per step over steps 0 .. ``steps`` - 1, each phase (density, batch shape) counted once:
    a density warm-up sends more in its first epochs than the last step does."""
    first_step_and_count: dict[tuple, list[int]] = {}
    for step in range(steps):
      key = (self.density_at(step), self.batch_shape_at(step))
      first_step_and_count.setdefault(key, [step, 0])[1] += 1
    totals = [0, 0]
    for first, count in first_step_and_count.values():
      phase = self.comm_bytes_at(first, params)
      totals[0] += count * phase.intra_node
      totals[1] += count * phase.inter_node
    return (
      CommBytes(intra_node=round(totals[0] / steps), inter_node=round(totals[1] / steps)) if steps else CommBytes(0, 0)
    )

  def _planned(self, reducer: Reducer, batch_shape: tuple[int, ...]) -> Reducer:
    """``reducer`` planned for this batch shape (``cost_model.plan_reducer``: adaptive fusion, auto, the
    square-root k share, as configured; the profile is at the eval image size). Auto charges the top-k
    selections at the cost's rate (a preset's assumption or a calibration's measurement), or plans on link time
    alone where the calibration file has none."""
    comm, info = self.config.comm, self.info
    pixels = math.prod(batch_shape[1:3]) / math.prod(info.image_shape[:2])
    reducer, reasons = cost_model.plan_reducer(
      reducer,
      comm,
      self.profile,
      self.cost,
      comm.device_tflops * 1e12,
      batch_shape[0] / self.mesh.size * pixels,
      overlap=self.mesh.devices.flat[0].platform != "cpu",  # XLA on CPU runs collectives in line
    )
    if comm.fusion == "adaptive":
      logging.info(
        "adaptive fusion (MG-WFBP, %s) for batch %s: %d buckets for %d tensors",
        comm.cost_model,
        "x".join(map(str, batch_shape)),
        len(reducer.groups),
        len(self.profile.order),
      )
    if reasons:
      rate = self.cost.topk_elements_per_sec
      planned_with = f"top-k at {rate:.3g} elements/s" if self.cost.has_topk_rate else "link time alone, no top-k rate"
      logging.info(
        "comm.strategy=auto (%s, %s), per bucket:\n  %s", comm.cost_model, planned_with, "\n  ".join(reasons)
      )
    return reducer
