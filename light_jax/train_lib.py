"""Training and evaluation of an image classifier over the (node, local) device mesh: the driver.

``train_and_evaluate`` wires the parts and runs the loop; read it top to bottom: mesh -> input ->
model, optimizer and the compiled steps -> train state, resumed from the newest checkpoint -> input
tuning -> the loop and its hooks (progress, non-finite check, preemption, evaluation, checkpoint) ->
summary. What one step computes is ``train_step.py``; its compilation per phase ``compiled_steps.py``;
the periodic actions ``hooks.py``; the evaluation ``evaluation.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any

import jax
import ml_collections

from light_jax import checkpoint as checkpoint_lib
from light_jax import data as data_lib
from light_jax import evaluation, optim, same_settings, schedules
from light_jax import metrics as metrics_lib
from light_jax import train_step as step_lib
from light_jax.compiled_steps import CompiledSteps
from light_jax.config import INITIAL_LOSS_SCALE, loss_scaling, parse_profile_steps
from light_jax.data import autotune
from light_jax.hooks import (
  NONFINITE,
  PREEMPTED,
  CheckpointSaver,
  EpochEvaluation,
  EvaluationFailed,
  HangDrill,
  Hook,
  Hooks,
  NonFiniteCheck,
  PreemptionCheck,
  ProfileTrace,
  ProgressBar,
  StepInfo,
  StepTimer,
  TrainClock,
  skipped_steps,
)
from light_jax.models import create_model
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import powersgd
from light_jax.preemption import PreemptionGuard


class NonFiniteError(RuntimeError):
  """Training stopped on a non-finite loss or gradient (policy ``stop``) after saving a checkpoint."""


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  extra_hooks: Sequence[tuple[Hook, int]] = (),
  preemption: PreemptionGuard | None = None,
) -> dict[str, Any]:
  """Trains ``config`` on the current devices, evaluating each epoch; returns summary.json's dict.

  A run a hook stopped (a signal before its last step, or one of ``extra_hooks``' own reasons at any step) returns
  only ``{"stopped", "steps"}``; a non-finite step under ``train.on_nonfinite="stop"`` raises ``NonFiniteError``.
  Both saved a checkpoint to resume from. So does a run whose training input fails between steps (a damaged record;
  with several processes, in any of them: they agree on each batch), and any run whose evaluation input fails at an
  epoch end (one process: whatever fails in the evaluation): it saves the steps done, then raises the error
  (``input_failed``; in the other processes, a ``liveness.PeerLost`` naming the process); the resumed run evaluates
  that epoch end first.

  ``extra_hooks``: (hook, every) pairs run after each due step, before the trainer's own hooks.
  ``preemption``: a guard installed before (train.py's, from the processes' join on), used and uninstalled here
  instead of a new one.
  """
  wall_start = time.time()
  # A signal in set-up stops it at once; armed at the first step, the guard saves and stops.
  with preemption or PreemptionGuard() as preemption:
    mesh = mesh_lib.make_mesh(config.mesh.nodes, config.mesh.local)
    logging.info("%s", mesh_lib.describe(mesh))
    train_batches, eval_batches, info = make_input(config)
    # Each machine reads its own copy (data.data_dir): copies that differ would take other steps and evaluations.
    same_settings.check_data(data_facts(train_batches, eval_batches, info), config.data.data_dir)
    plan = train_batches.plan  # step -> epoch, image size, batch size
    total_steps = schedules.total_steps(config.max_steps, plan)

    model = create_model(config.model.name, info.num_classes, config.model.dtype, config.model.width)
    schedule = schedules.learning_rate_schedule(config.optimizer, plan)
    # The momentum lives in the optimizer, or in the gradient reducer with DGC's momentum correction.
    optimizer = optim.from_config(config, schedule, schedules.momentum_schedule(config.optimizer, plan))
    compiled = CompiledSteps(config, model, optimizer, mesh, info, plan)
    loss_scale = INITIAL_LOSS_SCALE if loss_scaling(config) else 0.0
    state = step_lib.create_train_state(
      model, optimizer.tx, compiled.reducer, info.image_shape, mesh, config.seed, loss_scale
    )
    _log_setup(config, plan, state, compiled.reducer, total_steps, len(train_batches.source), eval_batches)

    # Whatever ends the run (an error too), what is opened from here on is closed again, in reverse order: the
    # checkpointer last, waiting for its saves in flight.
    with contextlib.ExitStack() as opened:
      checkpointer = opened.enter_context(closing(checkpoint_lib.Checkpointer(workdir, config.checkpoint.keep)))
      meta = {
        "config": json.loads(config.to_json_best_effort()),
        "mesh": list(mesh.devices.shape),
        "state_layout": step_lib.STATE_LAYOUT,
        # The reducer's per-device state follows its buckets, which auto and adaptive fusion plan from comm.cost_model.
        "comm_state_shapes": checkpoint_lib.shapes(state.comm_state),
      }
      start_step, state, seconds_before, unevaluated = restore(checkpointer, state, meta, plan)
      preemption.check_set_up()  # before compiling (minutes on a GPU): a signal during the restore may be swallowed
      finished = start_step >= total_steps  # a finished run resumed: no step to compile or input to tune
      if not finished:  # compiled now: neither the training clock nor --step_timeout counts compilation
        compiled.compile_phases(start_step, total_steps, state, after_each=preemption.check_set_up)

      input_settings = tune_input(config, train_batches, start_step, info.image_shape, measure=not finished)
      sharding = mesh_lib.batch_sharding(mesh)  # batches split over every device of the mesh
      eval_step = evaluation.make_eval_step(model, mesh, info)
      evaluate = functools.partial(
        evaluation.evaluate, eval_step, batches=eval_batches, sharding=sharding, **input_settings
      )
      host_batches = train_batches.iterator(start_step, **input_settings)
      prefetcher = opened.enter_context(
        closing(data_lib.DevicePrefetcher(host_batches, sharding, size=config.data.prefetch, agreed=True))
      )
      is_main = jax.process_index() == 0
      writer = opened.enter_context(
        closing(
          metrics_lib.MetricsWriter(
            workdir, enabled=is_main, resume_step=start_step or None, goes_on=start_step < total_steps
          )
        )
      )
      bar = opened.enter_context(closing(metrics_lib.progress_bar(total_steps, enabled=is_main, initial=start_step)))

      def ends_record(step: int) -> bool:  # an epoch's last step, or the run's
        return plan.ends_epoch(step) or step == total_steps

      # The hooks run in this order after a step, and the order is part of what they promise: the first stop
      # reason given wins, so the non-finite check comes before the preemption check (exit 3, not 0); the
      # evaluation before the saver, so that metrics.jsonl covers every checkpoint; the preemption check after
      # the evaluation, so a signal during it stops at this step; the step timer before the others, restarted
      # after them. The extra hooks (train.py's watchdog) come first and may outrank the rest: the non-finite
      # check is made once more after the loop (below).
      hooks = Hooks()
      for hook, every in extra_hooks:
        hooks.add(hook, every=every)
      timer = None
      if config.train.time_steps and is_main:  # before the trainer's hooks, restarted after them: a step's own time
        timer = StepTimer(os.path.join(workdir, "step_times.jsonl"), start_step)
        hooks.add(timer, every=1)
      # The logs' learning rate: one compiled program, not one dispatch (and one compile) per jnp op.
      host_schedule = jax.jit(schedule)
      clock = TrainClock(seconds_before)  # training seconds, evaluations left out
      hooks.add(ProgressBar(bar, host_schedule, config.log_every_steps, clock), every=1)
      nonfinite = NonFiniteCheck(config.train.on_nonfinite, seen=skipped_steps(state))

      # Also wherever a checkpoint may be saved: a resumed run counts the checkpoint's skipped steps as seen, so one
      # not reported by then would never be. So at each checkpoint step, and at a stop for a signal (one process:
      # at any step, from the local flag; several: at the log steps, where the check runs anyway, since asking
      # the others is a collective).
      def nonfinite_check_due(step: int) -> bool:
        every = config.checkpoint.every_steps
        signalled = jax.process_count() == 1 and preemption.signal is not None
        return ends_record(step) or signalled or (every > 0 and step % every == 0)

      hooks.add(nonfinite, every=config.log_every_steps, when=nonfinite_check_due)
      evaluations = EpochEvaluation(
        evaluate, writer, plan, host_schedule, prefetcher, bar, start_step, total_steps, clock
      )
      hooks.add(evaluations, when=ends_record)
      if unevaluated is not None:  # the checkpoint's step has a record whose evaluation failed: done first
        evaluations.finish_unevaluated(state, unevaluated)
      # After the evaluation, which may take long: a signal during it stops the run at this step, not the next.
      # With several processes the check is a collective, so not every step.
      hooks.add(PreemptionCheck(preemption), every=1 if jax.process_count() == 1 else config.log_every_steps)
      saver = CheckpointSaver(checkpointer, meta, clock)
      hooks.add(saver, every=config.checkpoint.every_steps)
      if config.train.inject_hang_at_step >= 0:
        hooks.add(HangDrill(config.train.inject_hang_at_step), every=1)
      if config.train.profile_steps:
        first, last = parse_profile_steps(config.train.profile_steps)
        if not start_step <= first < total_steps:  # the trace starts once step ``first`` is done here
          logging.warning(
            "train.profile_steps=%s writes no trace: this run takes steps %d to %d",
            config.train.profile_steps,
            start_step + 1,
            total_steps,
          )
        trace = opened.enter_context(closing(ProfileTrace(first, last, os.path.join(workdir, "profile"))))
        hooks.add(trace, every=1)
      if timer is not None:
        hooks.add(timer.restart, every=1)

      preemption.arm()
      logging.info(
        "training from step %d to step %d (a signal from now on saves after the current step)", start_step, total_steps
      )
      loop = train_loop(state, start_step, total_steps, prefetcher, compiled, hooks)
      if loop.stop and loop.stop != NONFINITE and (nonfinite.check(loop.state) == NONFINITE or nonfinite.tripped):
        # Another stop (a signal after the non-finite check's turn at this step, or an extra hook's reason, which
        # outranks it): skipped steps are reported, and stop the run, before the save below counts them as seen.
        loop = dataclasses.replace(loop, stop=NONFINITE)
      final_meta = {**meta, "train_seconds": clock.seconds()}
      if loop.input_error is not None:
        input_failed(checkpointer, loop, start_step, nonfinite, final_meta)
      # Save the final state; a no-op when CheckpointSaver has just saved this step.
      checkpointer.save(loop.step, loop.state, final_meta)
    if loop.stop == PREEMPTED and loop.step >= total_steps:  # the signal came with the last step: the run is done
      logging.info("a signal arrived at the last step; the run is complete, so it finishes and reports")
    elif loop.stop:
      return stopped(loop)

    # A finished run resumed ran no step: evaluate what it restored (every process alike) to report again.
    final = evaluations.last_record or final_metrics(evaluate, loop, compiled)
    buckets = compiled.reducer_at(loop.step - 1).bucket_plan(loop.state.params)
    mean_bytes = compiled.mean_comm_bytes(loop.step, loop.state.params)  # the run's, density warm-up included
    summary = run_summary(
      config, final, writer.records, plan, mesh, loop, start_step, nonfinite.seen, saver.blocking_seconds, wall_start
    ) | {
      "comm_buckets": buckets,
      "inter_node_bytes_per_step_mean": mean_bytes.inter_node,
      "intra_node_bytes_per_step_mean": mean_bytes.intra_node,
    }
    writer.write_summary(summary)
    return summary


@dataclasses.dataclass(frozen=True)
class LoopResult:
  state: step_lib.TrainState
  step: int  # steps done
  stop: str | None  # why a hook stopped the loop early (hooks.PREEMPTED, hooks.NONFINITE, ...); None: it did not
  seconds: float
  input_error: Exception | None = None  # the next batch, or an evaluation, failed (the state is whole)
  unevaluated: dict[str, Any] | None = None  # the evaluation failed: its record's training half, saved with the steps


def train_loop(
  state: step_lib.TrainState,
  start_step: int,
  total_steps: int,
  batches: Iterator[dict],
  compiled: CompiledSteps,
  hooks: Hooks,
) -> LoopResult:
  """Runs steps ``start_step`` .. ``total_steps`` - 1, each followed by the hooks due, until one says stop, or the
  next batch cannot be read (``data.InputFailed`` where several processes agreed on it; in one process, any error)
  or an evaluation fails (``EvaluationFailed``): returned in ``input_error``. Another error of the input in a run of
  several processes (the key-value store lost) is raised."""
  start = time.perf_counter()
  step, stop = start_step, None
  while step < total_steps and not stop:
    try:
      batch = next(batches)
    except data_lib.InputFailed as e:  # every process's batches end at this step: they save the steps together
      return LoopResult(state, step, None, time.perf_counter() - start, input_error=e.error)
    except Exception as e:  # a damaged record, say: the steps done are whole, and one process can save them alone
      if jax.process_count() > 1:  # unagreed: the others wait in the next step's collectives, a save would hang
        raise
      return LoopResult(state, step, None, time.perf_counter() - start, input_error=e)
    step_fn, comm_bytes = compiled.for_step(step, state)
    state, loss = step_fn(state, batch["images"], batch["labels"])
    step += 1
    try:
      stop = hooks.run(StepInfo(step, state, loss, batch["labels"].shape[0], comm_bytes))
    except EvaluationFailed as e:  # the step and the hooks before the evaluation are done
      seconds = time.perf_counter() - start
      return LoopResult(state, step, None, seconds, input_error=e.error, unevaluated=e.training)
  return LoopResult(state, step, stop, time.perf_counter() - start)


def input_failed(
  checkpointer: checkpoint_lib.Checkpointer,
  loop: LoopResult,
  start_step: int,
  nonfinite: NonFiniteCheck,
  meta: dict[str, Any],
) -> None:
  """The training input failed after ``loop.step`` steps (in every process alike), or the evaluation at that step:
  saves them (every hook of the last one ran, or those before its evaluation, whose record's training half is saved
  too, for the resumed run to evaluate) unless this process ran none, then raises. ``NonFiniteError`` when a skipped
  step is not reported yet (a checkpoint never holds one unreported), else the input's error; a DataError also says
  whether the steps are saved. A save that fails too is logged, and the input's error raised."""
  error = loop.input_error
  if loop.step == start_step:  # nothing new to keep: a resumed run whose input still fails
    raise error
  failed = f"the evaluation at step {loop.step}" if loop.unevaluated else f"the training input after step {loop.step}"
  # tripped: the check reported a skipped step at this very step, but the evaluation after it failed before the
  # loop could stop on it.
  unreported = nonfinite.check(loop.state) == NONFINITE or nonfinite.tripped
  if loop.unevaluated:
    meta = {**meta, "unevaluated": loop.unevaluated}
  try:
    checkpointer.save(loop.step, loop.state, meta)
    checkpointer.wait_until_saved()
    saved = f"the run's {loop.step} steps are saved: once mended, rerun the same command to resume"
  except Exception as e:  # a full disk, say: the input's error is the one to report
    logging.error("saving a checkpoint at step %d after %s failed did not work either: %s", loop.step, failed, e)
    saved, unreported = f"no checkpoint could be saved at step {loop.step}: see the log above", False
  if unreported:  # the rerun its error suggests would stop at the same input: said too
    logging.error("%s failed: %s", failed, error)
    raise nonfinite_error(loop.step, f" {failed.capitalize()} also failed ({error}): mend it first.")
  if isinstance(error, data_lib.DataError):
    raise data_lib.DataError(f"{error} ({saved})") from None
  logging.error("%s failed; %s", failed, saved)
  raise error


def stopped(loop: LoopResult) -> dict[str, Any]:
  """A run a hook stopped: raises ``NonFiniteError`` for a non-finite step, else a short summary (the
  caller tells the user to rerun the same command to resume)."""
  if loop.stop == NONFINITE:
    raise nonfinite_error(loop.step)
  cause = "a signal" if loop.stop == PREEMPTED else f"a hook ({loop.stop})"
  logging.warning("stopped by %s after step %d; checkpoint saved, rerun the same command to resume", cause, loop.step)
  return {"stopped": loop.stop, "steps": loop.step}


def nonfinite_error(step: int, also: str = "") -> NonFiniteError:
  """The error of a run stopped on a non-finite step at or before ``step``, where a checkpoint was saved."""
  return NonFiniteError(
    f"non-finite loss or gradient at or before step {step} (train.on_nonfinite='stop'); the bad update "
    f"was skipped and a checkpoint saved at step {step}. Rerun with --config.train.on_nonfinite=skip to go "
    f"on from there, or start again in a new --workdir with a lower --config.optimizer.base_lr.{also}"
  )


def final_metrics(evaluate, loop: LoopResult, compiled: CompiledSteps) -> dict[str, Any]:
  """The last record's metrics for a run that ran no step: evaluation, epoch loss and bytes from the state."""
  comm_bytes = compiled.comm_bytes_at(loop.step - 1, loop.state.params)
  return {
    **evaluation.with_own_errors(evaluate)(loop.state),
    "train_loss": evaluation.epoch_mean_loss(loop.state),
    "inter_node_bytes_per_step": comm_bytes.inter_node,
    "intra_node_bytes_per_step": comm_bytes.intra_node,
  }


def make_input(
  config: ml_collections.ConfigDict,
) -> tuple[data_lib.TrainBatches, data_lib.EvalBatches, data_lib.DatasetInfo]:
  """This process's training and evaluation batches, and the dataset's facts."""
  train_source, eval_source, info = data_lib.load_dataset(config.data)
  jpeg = isinstance(train_source, data_lib.ImageSource)  # JPEGs are decoded at each phase's size, arrays resized
  side = min(info.image_shape[:2])
  if config.data.crop_padding >= side:  # crops mostly of padding (a billion: a traceback once training had begun)
    raise data_lib.DataError(
      f"invalid config: data.crop_padding={config.data.crop_padding} must be below the images' {side} px (a random "
      f"crop of an image padded by that much is mostly padding); use at most {side - 1}."
    )
  phases = schedules.parse_resolution_schedule(config.data.resolution_schedule, info.image_shape[0] if jpeg else None)
  train_batches = data_lib.TrainBatches(
    train_source,
    config.global_batch_size,
    config.num_epochs,
    config.seed,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    crop_padding=config.data.crop_padding,
    random_flip=config.data.random_flip,
    resolution_schedule=phases,
  )
  eval_batches = data_lib.EvalBatches(
    eval_source,
    config.data.eval_batch_size,
    jax.process_index(),
    jax.process_count(),
    info.image_shape[0] if jpeg else None,
  )
  return train_batches, eval_batches, info


def data_facts(
  train_batches: data_lib.TrainBatches, eval_batches: data_lib.EvalBatches, info: data_lib.DatasetInfo
) -> dict[str, Any]:
  """What every process must have loaded alike (``same_settings.check_data``)."""
  return {
    "train examples": len(train_batches.source),
    "eval examples": len(eval_batches.source),
    "classes": info.num_classes,
    "image shape": list(info.image_shape),
  }


def restore(
  checkpointer: checkpoint_lib.Checkpointer,
  state: step_lib.TrainState,
  meta: dict[str, Any],
  plan: schedules.EpochPlan,
) -> tuple[int, step_lib.TrainState, float, dict[str, Any] | None]:
  """(step, state, training seconds before it, unevaluated) of the newest checkpoint that restores, or (0,
  ``state``, 0, None) when there is none (checkpoints written before the seconds were saved: 0). ``unevaluated``:
  the training half of the step's record when its evaluation failed (``EvaluationFailed``), else None. ``meta``:
  this run's config and mesh, which the checkpoint's must match (``Checkpointer.restore_latest``)."""
  restored = checkpointer.restore_latest(
    checkpoint_lib.abstract(state), meta["config"], meta["mesh"], step_lib.restore_target, meta["comm_state_shapes"]
  )
  if restored is None:
    return 0, state, 0.0, None
  step, state, saved_meta = restored
  logging.info("resumed from the checkpoint at step %d (epoch %.2f)", step, plan.epochs_done(step))
  return step, state, float(saved_meta.get("train_seconds", 0.0)), saved_meta.get("unevaluated")


def tune_input(
  config: ml_collections.ConfigDict,
  train_batches: data_lib.TrainBatches,
  start_step: int,
  image_shape: tuple[int, int, int],
  measure: bool = True,
) -> dict[str, int]:
  """Grain's settings for the run, ``{read_threads, workers, buffer}``: the config's worker count and prefetch
  depth, or for -1 measured on this machine in bounded time with the batches the run will read; the
  batches buffered ahead may take a quarter of the free memory at the largest batch shape. Without
  ``measure`` (no step left to run), -1 means no worker process and a depth of one batch per thread."""
  read_threads = config.data.read_threads
  if not measure:
    workers, depth = max(config.data.num_workers, 0), config.data.host_prefetch
    return {"read_threads": read_threads, "workers": workers, "buffer": depth if depth > 0 else read_threads}
  plan = train_batches.plan
  largest = max(math.prod(plan.batch_shape_at(s, image_shape)) for s in plan.first_steps[:-1])
  workers, depth = autotune.best_input_settings(
    lambda w, d: train_batches.iterator(start_step, read_threads=read_threads, buffer=d, workers=w),
    config.data.num_workers,
    config.data.host_prefetch,
    read_threads,
    batch_bytes=largest // jax.process_count(),
    memory_budget=autotune.free_memory_bytes() // 4,
  )
  if workers and config.data.cache == "memory":
    logging.warning(
      "data.cache=memory with %d grain worker process(es): the workers read the cache file "
      "through the OS page cache; set data.num_workers=0 to read from this process's memory",
      workers,
    )
  return {"read_threads": read_threads, "workers": workers, "buffer": depth}


def optimizer_state_bytes_per_device(state: step_lib.TrainState, devices: int) -> int:
  """The optimizer state one device holds: the replicated ``opt_state`` whole, plus its share of a per-device
  ``comm_state["optimizer"]`` (the sharded update's, DiLoCo's inner optimizer's)."""
  replicated = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
  per_device = sum(x.nbytes for x in jax.tree.leaves(state.comm_state.get("optimizer", {}))) // devices
  return int(replicated + per_device)


def run_summary(
  config: ml_collections.ConfigDict,
  final: dict[str, Any],
  records: list[dict[str, Any]],
  plan: schedules.EpochPlan,
  mesh: jax.sharding.Mesh,
  loop: LoopResult,
  start_step: int,
  nonfinite_steps: int,
  checkpoint_seconds: float,
  wall_start: float,
) -> dict[str, Any]:
  """summary.json: the final metrics, the run's facts and the resolved config; logs a one-line report."""
  nodes, local = mesh.devices.shape
  summary = {
    "final_eval_top1": final["eval_top1"],
    "final_eval_top5": final["eval_top5"],
    "final_train_loss": final["train_loss"],
    "wall_seconds": time.time() - wall_start,
    "steps": loop.step,
    "epochs": plan.epochs_done(loop.step),
    "num_params": sum(p.size for p in jax.tree.leaves(loop.state.params)),
    "mesh": {
      "nodes": nodes,
      "local": local,
      "processes": jax.process_count(),
      "platform": mesh.devices.flat[0].platform,
    },
    "images_per_sec_mean": images_per_sec_mean(records, plan),
    "nonfinite_steps": nonfinite_steps,
    "resumed_from_step": start_step,
    "checkpoint_blocking_seconds": checkpoint_seconds,
    "checkpoint_overhead_fraction": checkpoint_seconds / loop.seconds if loop.seconds else 0.0,
    "inter_node_bytes_per_step": final["inter_node_bytes_per_step"],
    "intra_node_bytes_per_step": final["intra_node_bytes_per_step"],
    "optimizer_state_bytes_per_device": optimizer_state_bytes_per_device(loop.state, mesh.size),
    "config": json.loads(config.to_json_best_effort()),
  }
  logging.info(
    "done: %d steps in %.1f s, final test top-1 %.2f%%, top-5 %.2f%%",
    loop.step,
    summary["wall_seconds"],
    100 * summary["final_eval_top1"],
    100 * summary["final_eval_top5"],
  )
  return summary


def images_per_sec_mean(records: list[dict[str, Any]], plan: schedules.EpochPlan) -> float | None:
  """The run's images over its training seconds. The last record's ``train_seconds`` is the whole run's training
  time (a resumed run's clock goes on from its checkpoint's), so resumes leave this an uninterrupted run's figure:
  not so the records' own rates, the first after a resume covering only that process's steps."""
  if not records or not records[-1].get("train_seconds"):
    return None
  return plan.images(0, records[-1]["step"]) / records[-1]["train_seconds"]


def _log_setup(
  config: ml_collections.ConfigDict,
  plan: schedules.EpochPlan,
  state: step_lib.TrainState,
  reducer,
  total_steps: int,
  num_train: int,
  eval_batches: data_lib.EvalBatches,
) -> None:
  steps_per_epoch = plan.steps_per_epoch[0] if plan.uniform else "/".join(map(str, sorted(set(plan.steps_per_epoch))))
  num_eval = len(eval_batches.source)
  logging.info(
    "data %s: %d train / %d eval examples, %s steps per epoch, %d steps in all",
    config.data.dataset,
    num_train,
    num_eval,
    steps_per_epoch,
    total_steps,
  )
  if advice := eval_batches.padding_advice(jax.device_count()):
    logging.warning("%s", advice)
  # Both fine in a short trial of a long recipe, but not what the config says: said once, not refused.
  if config.optimizer.warmup_epochs > plan.num_epochs:
    logging.warning(
      "optimizer.warmup_epochs=%g is longer than the run (num_epochs=%d): the warm-up is cut to the run, reaching "
      "the peak learning rate at its last step, with no decay",
      config.optimizer.warmup_epochs,
      plan.num_epochs,
    )
  if isinstance(reducer, powersgd.PowerSGDReducer) and not any(
    reducer.is_compressed(x.shape) for x in jax.tree.leaves(state.params)
  ):  # a rank at least every matrix's (the bytes said so; nothing else did)
    logging.warning(
      "comm.rank=%d is at least the full rank of every matrix (those below comm.min_compress_elements=%d are sent "
      "whole anyway): PowerSGD compresses none, and every gradient is sent dense",
      config.comm.rank,
      config.comm.min_compress_elements,
    )
  if config.comm.density_warmup_epochs > plan.num_epochs:  # only top-k strategies and auto take one
    logging.warning(
      "comm.density_warmup_epochs=%g is longer than the run (num_epochs=%d): the run ends inside the density "
      "warm-up and never sends at comm.density=%g",
      config.comm.density_warmup_epochs,
      plan.num_epochs,
      config.comm.density,
    )
  if dropped := [p.first_epoch for p in plan.phases if p.first_epoch >= plan.num_epochs]:
    logging.warning(
      "data.resolution_schedule: the phase(s) from epoch %s start after the run's last epoch (num_epochs=%d) "
      "and are left out",
      ", ".join(map(str, dropped)),
      plan.num_epochs,
    )
  peaks = " / ".join(
    f"{schedules.peak_learning_rate(config.optimizer, b):.4g} (batch {b})" for b in dict.fromkeys(plan.batch_sizes)
  )
  logging.info(
    "model %s: %s parameters; optimizer %s, peak lr %s; comm %s, fusion %s",
    config.model.name,
    f"{sum(p.size for p in jax.tree.leaves(state.params)):,}",
    config.optimizer.name,
    peaks,
    config.comm.strategy,
    config.comm.fusion,
  )
