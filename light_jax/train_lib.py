"""Training and evaluation of an image classifier over the (node, local) device mesh.

Read top to bottom: the train state, the train step, the eval step, then ``train_and_evaluate`` (the
loop). One step, on every device at once, inside ``jax.jit`` + ``jax.shard_map``:

  1. normalise the device's shard of the uint8 batch (on the device, not the host);
  2. forward and backward on that shard alone -> the device's *local* gradient;
  3. the gradient reducer chosen by ``comm.strategy`` turns local gradients into the mean gradient
     of the global batch (dense psum, hierarchical, and later compressed strategies);
  4. the optimizer applies it, identically on every device, so parameters stay replicated;
  5. BatchNorm running statistics (computed per device) are averaged over the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from light_jax import checkpoint as checkpoint_lib
from light_jax import data as data_lib
from light_jax import metrics as metrics_lib
from light_jax import optim
from light_jax.data import autotune
from light_jax.models import create_model
from light_jax.parallel import collectives, compression, cost_model
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel.mesh import AXES, BATCH_SPEC, LOCAL, NODE

PyTree = Any


@flax.struct.dataclass
class TrainState:
  """Everything that changes from step to step.

  All fields are replicated over the mesh except ``comm_state`` (per-device state of the gradient
  reducer, e.g. error-feedback residuals), whose leaves have leading dims (nodes, local).
  ``nonfinite_steps`` counts the steps whose update was skipped for a non-finite loss or gradient.
  ``loss_sum`` / ``loss_count`` (per device, (nodes, local)) accumulate the training loss of the current
  epoch, so the epoch's mean loss survives a resume from a mid-epoch checkpoint.
  """

  step: jax.Array
  params: PyTree
  batch_stats: PyTree
  opt_state: PyTree
  comm_state: PyTree
  nonfinite_steps: jax.Array
  loss_sum: jax.Array
  loss_count: jax.Array


# Partition specs of TrainState, as a pytree prefix usable by shard_map and NamedSharding.
STATE_SPECS = TrainState(step=P(), params=P(), batch_stats=P(), opt_state=P(), comm_state=P(NODE, LOCAL),
                         nonfinite_steps=P(), loss_sum=P(NODE, LOCAL), loss_count=P(NODE, LOCAL))


def create_train_state(model: nn.Module, tx: optax.GradientTransformation,
                       reducer: collectives.GradientReducer, image_shape: tuple[int, ...],
                       mesh: jax.sharding.Mesh, seed: int) -> TrainState:
  """Initialises parameters and optimizer state directly on the mesh (replicated)."""

  def init():
    variables = model.init(jax.random.key(seed), jnp.zeros((1, *image_shape), jnp.float32), train=False)
    params = variables["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, batch_stats=variables.get("batch_stats", {}),
                      opt_state=tx.init(params), comm_state=reducer.init_state(params),
                      nonfinite_steps=jnp.zeros((), jnp.int32), loss_sum=jnp.zeros(mesh.devices.shape),
                      loss_count=jnp.zeros(mesh.devices.shape, jnp.int32))

  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), STATE_SPECS,
                           is_leaf=lambda x: isinstance(x, P))
  return jax.jit(init, out_shardings=shardings)()


def normalize(images: jax.Array, mean: tuple[float, ...], std: tuple[float, ...]) -> jax.Array:
  """uint8 (B, H, W, C) -> float32 with per-channel zero mean and unit variance."""
  return (images.astype(jnp.float32) - jnp.asarray(mean)) / jnp.asarray(std)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation,
                    reducer: collectives.GradientReducer, mesh: jax.sharding.Mesh,
                    info: data_lib.DatasetInfo, label_smoothing: float, inject_nan_at_step: int = -1,
                    epoch_first_steps: tuple[int, ...] = ()) -> Callable:
  """Returns ``step(state, images, labels) -> (state, per_device_loss)``, jitted, donating ``state``.

  ``images`` (uint8) and ``labels`` are global arrays sharded over (node, local) on their first dim.
  ``per_device_loss`` has shape (num_devices,): averaging it on the host when logging costs no
  collective in the step.

  A non-finite loss or reduced gradient is caught on the device, without a host sync: the update is
  skipped (state unchanged but for ``step`` and ``nonfinite_steps``). ``inject_nan_at_step`` >= 0
  poisons that step's loss (a fault drill for tests and ``train.inject_nan_at_step``).
  ``epoch_first_steps`` (``EpochPlan.first_steps``) resets the epoch loss accumulators at each epoch's
  first step.
  """

  def device_step(state: TrainState, images, labels):
    x = normalize(images, info.mean, info.std)

    def loss_fn(params):
      logits, updates = model.apply({"params": params, "batch_stats": state.batch_stats}, x, train=True,
                                    mutable=["batch_stats"])
      loss = optim.cross_entropy(logits, labels, info.num_classes, label_smoothing)
      if inject_nan_at_step >= 0:
        loss = loss * jnp.where(state.step == inject_nan_at_step, jnp.nan, 1.0)
      return loss, updates.get("batch_stats", {})

    # check_vma=False below: grad of replicated params is the *local* gradient, not JAX's implicit
    # psum of it, so the reducer is the only reduction (no silent double sum; tested).
    (loss, batch_stats), local_grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads, comm_state = reducer.reduce(local_grads, state.comm_state)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    # The reduced gradient is identical on every device, so every device takes the same decision.
    finite = jnp.logical_and(lax.pmin(jnp.isfinite(loss).astype(jnp.int32), AXES) > 0,
                             jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])))
    updated = (optax.apply_updates(state.params, updates), lax.pmean(batch_stats, AXES), opt_state, comm_state)
    kept = (state.params, state.batch_stats, state.opt_state, state.comm_state)
    params, batch_stats, opt_state, comm_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, kept)
    new_epoch = jnp.isin(state.step, jnp.asarray(epoch_first_steps, jnp.int32)) if epoch_first_steps else False
    loss_ok = jnp.isfinite(loss)
    new_state = state.replace(
        step=state.step + 1, params=params, batch_stats=batch_stats, opt_state=opt_state, comm_state=comm_state,
        nonfinite_steps=state.nonfinite_steps + (1 - finite.astype(jnp.int32)),
        loss_sum=jnp.where(new_epoch, 0.0, state.loss_sum) + jnp.where(loss_ok, loss, 0.0),
        loss_count=jnp.where(new_epoch, 0, state.loss_count) + loss_ok.astype(jnp.int32))
    return new_state, loss[None]

  sharded = jax.shard_map(device_step, mesh=mesh, in_specs=(STATE_SPECS, BATCH_SPEC, BATCH_SPEC),
                          out_specs=(STATE_SPECS, BATCH_SPEC), check_vma=False)
  return jax.jit(sharded, donate_argnums=0)


def make_eval_step(model: nn.Module, mesh: jax.sharding.Mesh, info: data_lib.DatasetInfo) -> Callable:
  """Returns ``eval_step(state, images, labels, mask) -> {top1, top5, loss, count}`` summed over the batch.

  Padding rows (mask 0) count for nothing, so every example of the split counts exactly once.
  """

  def device_eval(state: TrainState, images, labels, mask):
    logits = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                         normalize(images, info.mean, info.std), train=False)
    top5 = lax.top_k(logits, min(5, info.num_classes))[1]
    hits = top5 == labels[:, None]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    sums = {"top1": hits[:, 0], "top5": hits.any(axis=1), "loss": loss, "count": jnp.ones_like(loss)}
    return {k: lax.psum(jnp.sum(v * mask), AXES) for k, v in sums.items()}

  sharded = jax.shard_map(device_eval, mesh=mesh, in_specs=(STATE_SPECS, BATCH_SPEC, BATCH_SPEC, BATCH_SPEC),
                          out_specs=P(), check_vma=False)
  return jax.jit(sharded)


def evaluate(eval_step: Callable, state: TrainState, batches: data_lib.EvalBatches,
             sharding: NamedSharding, read_threads: int = 1, workers: int = 0, host_prefetch: int = 4) -> dict[str, float]:
  """Top-1, top-5 and mean loss over the whole split."""
  totals = None
  host_batches = batches.iterator(read_threads, buffer=host_prefetch, workers=workers)
  for batch in data_lib.DevicePrefetcher(host_batches, sharding):
    sums = eval_step(state, batch["images"], batch["labels"], batch["mask"])
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  count = float(totals["count"])
  return {"eval_top1": float(totals["top1"]) / count, "eval_top5": float(totals["top5"]) / count,
          "eval_loss": float(totals["loss"]) / count, "eval_examples": int(count)}


class NonFiniteError(RuntimeError):
  """Training stopped on a non-finite loss or gradient (policy ``stop``) after saving a checkpoint."""


class PreemptionGuard:
  """SIGTERM / SIGINT: finish the current step, save, exit 0. A second signal exits at once.

  In a multi-process run the processes agree (an all-gather of the flag) every ``every`` steps, so all
  of them stop after the same step; a lone process stops after the step in flight.
  """

  def __init__(self):
    self.signal = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self.signal is not None:
      os._exit(128 + signum)   # second signal: no save, no cleanup
    self.signal = signum
    logging.warning("received %s: finishing the current step, saving a checkpoint, then exiting "
                    "(send it again to exit at once)", signal.Signals(signum).name)

  def requested(self, step: int, every: int) -> bool:
    if jax.process_count() == 1:
      return self.signal is not None
    if step % every:
      return False
    flags = multihost_utils.process_allgather(np.array(self.signal is not None))
    return bool(np.any(flags))

  def uninstall(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def epoch_mean_loss(state: TrainState) -> float:
  """Mean training loss of the current epoch's steps so far, over all devices (a collective: all call it)."""
  total, count = (np.sum(multihost_utils.process_allgather(x, tiled=True)) for x in (state.loss_sum, state.loss_count))
  return float(total / count) if count else float("nan")


def global_mean(per_device_values) -> float:
  """Mean of per-device arrays that may live on other processes' devices too (a collective: all call it).

  Non-finite values (the losses of skipped steps) are left out.
  """
  values = np.asarray(multihost_utils.process_allgather(per_device_values, tiled=True))
  return float(np.mean(values[np.isfinite(values)])) if np.isfinite(values).any() else float("nan")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains ``config`` on the current devices, evaluating each epoch; returns the summary."""
  wall_start = time.time()
  is_main = jax.process_index() == 0

  # --- Mesh --------------------------------------------------------------------------------------
  mesh = mesh_lib.make_mesh(config.mesh.nodes, config.mesh.local)
  nodes, local = mesh.devices.shape
  logging.info("%s", mesh_lib.describe(mesh))

  # --- Input -------------------------------------------------------------------------------------
  train_source, eval_source, info = data_lib.load_dataset(config.data)
  jpeg_source = isinstance(train_source, data_lib.ImageSource)
  train_batches = data_lib.TrainBatches(
      train_source, config.global_batch_size, config.num_epochs, config.seed,
      process_index=jax.process_index(), process_count=jax.process_count(),
      crop_padding=config.data.crop_padding, random_flip=config.data.random_flip,
      resolution_schedule=data_lib.parse_resolution_schedule(config.data.resolution_schedule, info.image_shape[0])
      if jpeg_source else ())
  eval_batches = data_lib.EvalBatches(eval_source, config.data.eval_batch_size, jax.process_index(),
                                      jax.process_count(), info.image_shape[0] if jpeg_source else None)
  plan = train_batches.plan   # step -> epoch, image size, batch size
  total_steps = plan.num_steps if not config.max_steps else min(config.max_steps, plan.num_steps)
  logging.info("data %s: %d train / %d eval examples, %s steps per epoch, %d steps in all",
               config.data.dataset, len(train_source), len(eval_source),
               plan.steps_per_epoch[0] if plan.uniform else "/".join(map(str, sorted(set(plan.steps_per_epoch)))),
               total_steps)

  # --- Model, optimizer, gradient reducer ----------------------------------------------------------
  model = create_model(config.model.name, info.num_classes, config.model.dtype, config.model.width)
  schedule = optim.learning_rate_schedule(config, plan)
  tx = optim.build_optimizer(config, schedule)
  comm = config.comm
  profile = fusion_lib.profile_parameters(model, info.image_shape)   # backward order, FLOPs per tensor
  reducer = collectives.make_gradient_reducer(
      comm.strategy, nodes, local, "fixed" if comm.fusion == "adaptive" else comm.fusion, comm.bucket_bytes,
      density=comm.density, selector=comm.topk_selector, error_feedback=comm.error_feedback,
      min_compress_elements=comm.min_compress_elements, wire_dtype=comm.dtype, order=profile.order)

  def planned(reducer, batch_shape):
    """``reducer`` with MG-WFBP buckets for this batch shape: backward time per tensor scales with the
    examples per device and the pixels per example (the profile is at the eval image size)."""
    pixels = math.prod(batch_shape[1:3]) / math.prod(info.image_shape[:2])
    reducer = cost_model.plan_adaptive_fusion(reducer, profile, cost_model.load(comm.cost_model),
                                              comm.device_tflops * 1e12, batch_shape[0] / mesh.size * pixels)
    logging.info("adaptive fusion (MG-WFBP, %s) for batch %s: %d buckets for %d tensors", comm.cost_model,
                 "x".join(map(str, batch_shape)), len(reducer.groups), len(profile.order))
    return reducer

  def batch_shape_at(step: int) -> tuple[int, ...]:
    size = plan.image_size_at(step)
    return (plan.batch_size_at(step), *((size, size, info.image_shape[2]) if size else info.image_shape))

  # Buckets follow the batch shape (planned per phase when the step compiles), except for compressed
  # strategies: they keep one residual per bucket in the train state, so theirs are planned once.
  adaptive_per_phase = comm.fusion == "adaptive" and comm.strategy not in collectives.COMPRESSED_STRATEGIES
  if comm.fusion == "adaptive" and not adaptive_per_phase:
    reducer = planned(reducer, batch_shape_at(0))
  state = create_train_state(model, tx, reducer, info.image_shape, mesh, config.seed)
  num_params = sum(p.size for p in jax.tree.leaves(state.params))
  logging.info("model %s: %s parameters; optimizer %s, peak lr %s; comm %s, fusion %s",
               config.model.name, f"{num_params:,}", config.optimizer.name,
               " / ".join(f"{optim.peak_learning_rate(config, b):.4g} (batch {b})"
                          for b in dict.fromkeys(plan.batch_sizes)),
               comm.strategy, comm.fusion)

  # --- Checkpoint: resume from the newest good one in the workdir ------------------------------------
  checkpointer = checkpoint_lib.Checkpointer(workdir, config.checkpoint.every_steps, config.checkpoint.keep)
  meta = {"config": json.loads(config.to_json_best_effort()), "mesh": [nodes, local]}
  try:
    restored = checkpointer.restore_latest(checkpoint_lib.abstract(state), meta["config"])
  except checkpoint_lib.CheckpointError:
    checkpointer.close()
    raise
  start_step = 0
  if restored is not None:
    start_step, state, _ = restored
    logging.info("resumed from the checkpoint at step %d (epoch %.2f)", start_step, plan.epochs_done(start_step))

  # --- Compile ahead of time, so that images/s measures steps and not compilation -------------------
  # k of top-k and the batch shape of progressive resizing are static shapes: a density warm-up or a
  # resolution schedule compiles the step once per (density, batch shape) phase.
  sharding = mesh_lib.batch_sharding(mesh)
  density_warmup_steps = plan.step_at(comm.density_warmup_epochs)
  compiled_steps = {}

  def train_step_for(step: int):
    """(compiled train step, its CommBytes) for the top-k density and batch shape of ``step``."""
    density = compression.density_at(step, comm.density, density_warmup_steps)
    batch_shape = batch_shape_at(step)
    if (density, batch_shape) not in compiled_steps:
      phase_reducer = dataclasses.replace(reducer, density=density)
      if adaptive_per_phase:
        phase_reducer = planned(phase_reducer, batch_shape)
      abstract_args = (checkpoint_lib.abstract(state),
                       jax.ShapeDtypeStruct(batch_shape, jnp.uint8, sharding=sharding),
                       jax.ShapeDtypeStruct(batch_shape[:1], jnp.int32, sharding=sharding))
      start = time.time()
      compiled = make_train_step(model, tx, phase_reducer, mesh, info, config.optimizer.label_smoothing,
                                 config.train.inject_nan_at_step, tuple(plan.first_steps)).lower(*abstract_args).compile()
      comm_bytes = phase_reducer.bytes_per_step(abstract_args[0].params)
      logging.info("train step compiled in %.1f s (batch %s%s): %s intra-node and %s inter-node bytes per device "
                   "per step", time.time() - start, "x".join(map(str, batch_shape)),
                   f", top-k density {density:.4g}" if comm.strategy in collectives.COMPRESSED_STRATEGIES else "",
                   f"{comm_bytes.intra_node:,}", f"{comm_bytes.inter_node:,}")
      compiled_steps[density, batch_shape] = compiled, comm_bytes
    return compiled_steps[density, batch_shape]

  train_step_for(start_step)
  eval_step = make_eval_step(model, mesh, info)

  # --- Loop ----------------------------------------------------------------------------------------
  # -1: measured on this machine, in bounded time, with the batches the run will read; the batches
  # buffered ahead may take a quarter of the free memory at the largest batch shape.
  read_threads = config.data.read_threads
  largest_batch_bytes = max(math.prod(batch_shape_at(s)) for s in plan.first_steps[:-1]) // jax.process_count()
  workers, host_prefetch = autotune.best_input_settings(
      lambda w, depth: train_batches.iterator(start_step, read_threads=read_threads, buffer=depth, workers=w),
      config.data.num_workers, config.data.host_prefetch, read_threads, batch_bytes=largest_batch_bytes,
      memory_budget=autotune.free_memory_bytes() // 4)
  if workers and config.data.cache == "memory":
    logging.warning("data.cache=memory with %d grain worker process(es): the workers read the cache file "
                    "through the OS page cache; set data.num_workers=0 to read from this process's memory", workers)
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main, resume_step=start_step if restored else None)
  bar = metrics_lib.progress_bar(total_steps, enabled=is_main, initial=start_step)
  host_batches = train_batches.iterator(start_step, read_threads=read_threads, buffer=host_prefetch, workers=workers)
  prefetcher = data_lib.DevicePrefetcher(host_batches, sharding, size=config.data.prefetch)
  preemption = PreemptionGuard()
  images_since_record = 0
  wait_at_record = 0.0
  nonfinite_seen = 0
  checkpoint_seconds = 0.0    # time the loop was blocked starting asynchronous saves
  loop_start = time.perf_counter()
  stop_reason = None
  step = start_step
  record = writer.records[-1] if writer.records else {}   # a finished run resumed: nothing left to do
  segment_start = time.perf_counter()
  try:
    while step < total_steps:
      batch = next(prefetcher)
      train_step, comm_bytes = train_step_for(step)
      state, loss = train_step(state, batch["images"], batch["labels"])
      step += 1
      images_since_record += plan.batch_size_at(step - 1)
      bar.update(1)
      if step % config.log_every_steps == 0:
        # Reading step t's loss waits for step t only; the steps queued behind it keep running.
        bar.set_postfix(loss=f"{global_mean(loss):.4f}", lr=f"{float(schedule(step)):.3g}",
                        img_s=f"{images_since_record / (time.perf_counter() - segment_start):.0f}")
      end_of_epoch = plan.ends_epoch(step) or step == total_steps
      if step % config.log_every_steps == 0 or end_of_epoch:
        nonfinite = int(state.nonfinite_steps.addressable_data(0))
        if nonfinite > nonfinite_seen:
          logging.warning("%d step(s) with a non-finite loss or gradient so far (update skipped); policy: %s",
                          nonfinite, config.train.on_nonfinite)
          nonfinite_seen = nonfinite
          if config.train.on_nonfinite == "stop":
            stop_reason = "nonfinite"
      if preemption.requested(step, config.log_every_steps):
        stop_reason = "preempted"
      if end_of_epoch:
        train_loss = epoch_mean_loss(state)
        train_seconds = time.perf_counter() - segment_start   # eval excluded
        eval_metrics = evaluate(eval_step, state, eval_batches, sharding, read_threads, workers, host_prefetch)
        record = {
            "step": step,
            "epoch": round(plan.epochs_done(step), 4),
            "train_loss": train_loss,
            **eval_metrics,
            "images_per_sec": images_since_record / train_seconds,
            "input_wait_fraction": (prefetcher.wait_seconds - wait_at_record) / train_seconds,
            "learning_rate": float(schedule(step)),
            "inter_node_bytes_per_step": comm_bytes.inter_node,
            "intra_node_bytes_per_step": comm_bytes.intra_node,
            "nonfinite_steps": nonfinite_seen,
            "final": step == total_steps,
        }
        writer.write(record)
        bar.write(f"epoch {record['epoch']:.2f} step {step}: train loss {train_loss:.4f}, test top-1 "
                  f"{100 * record['eval_top1']:.2f}% top-5 {100 * record['eval_top5']:.2f}%, "
                  f"{record['images_per_sec']:.0f} images/s, input wait {100 * record['input_wait_fraction']:.1f}%")
        images_since_record = 0
        wait_at_record = prefetcher.wait_seconds
        segment_start = time.perf_counter()
      # After this step's record: a checkpoint at step s implies metrics.jsonl holds every record <= s.
      save_start = time.perf_counter()
      if checkpointer.maybe_save(step, state, meta):
        checkpoint_seconds += time.perf_counter() - save_start
      if stop_reason:
        break
    checkpointer.maybe_save(step, state, meta, force=True)
    loop_seconds = time.perf_counter() - loop_start
  finally:
    prefetcher.close()
    bar.close()
    preemption.uninstall()
    checkpointer.close()   # waits for saves in flight

  if stop_reason == "preempted":
    logging.warning("stopped by a signal after step %d; checkpoint saved, rerun the same command to resume", step)
    return {"stopped": "preempted", "steps": step}
  if stop_reason == "nonfinite":
    raise NonFiniteError(f"non-finite loss or gradient at or before step {step} (train.on_nonfinite='stop'); "
                         f"the bad update was skipped and a checkpoint saved at step {step}. Lower the learning "
                         f"rate or set --config.train.on_nonfinite=skip, then rerun to resume.")

  summary = {
      "final_eval_top1": record.get("eval_top1"),
      "final_eval_top5": record.get("eval_top5"),
      "final_train_loss": record.get("train_loss"),
      "wall_seconds": time.time() - wall_start,
      "steps": step,
      "epochs": plan.epochs_done(step),
      "num_params": num_params,
      "mesh": {"nodes": nodes, "local": local, "processes": jax.process_count(),
               "platform": mesh.devices.flat[0].platform},
      "images_per_sec_mean": (float(np.mean([r["images_per_sec"] for r in writer.records]))
                              if writer.records else None),
      "nonfinite_steps": nonfinite_seen,
      "resumed_from_step": start_step,
      "checkpoint_blocking_seconds": checkpoint_seconds,
      "checkpoint_overhead_fraction": checkpoint_seconds / loop_seconds,
      "inter_node_bytes_per_step": record.get("inter_node_bytes_per_step"),
      "intra_node_bytes_per_step": record.get("intra_node_bytes_per_step"),
      "config": json.loads(config.to_json_best_effort()),
  }
  writer.write_summary(summary)
  writer.close()
  logging.info("done: %d steps in %.1f s, final test top-1 %.2f%%, top-5 %.2f%%", step,
               summary["wall_seconds"], 100 * summary["final_eval_top1"], 100 * summary["final_eval_top5"])
  return summary
