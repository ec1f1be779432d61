"""Periodic actions of the training loop, registered with a period (as in levanter's trainer hooks).

A hook is a function of ``StepInfo`` run after a step when it is due: every ``every`` steps, or when
``when(step)`` holds (epoch ends, which are not periodic when the batch size changes between phases).
It may return a reason to stop (``PREEMPTED``, ``NONFINITE``, or its own); the loop stops after running
every hook due at that step, and the driver then saves a checkpoint at that step.

In a multi-process run some hooks make collectives (``ProgressBar``'s loss, ``EpochEvaluation``, the
preemption check, ``CheckpointSaver``: orbax's saves pass barriers of every process): every process runs the
same hooks at the same steps, so a hook must never decide from something one process alone sees whether to
make a collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from light_jax import checkpoint as checkpoint_lib
from light_jax import data as data_lib
from light_jax import evaluation, schedules
from light_jax import metrics as metrics_lib
from light_jax import train_step as step_lib
from light_jax.parallel.strategies import CommBytes
from light_jax.preemption import PreemptionGuard


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """What the hooks see after a step."""

  step: int  # steps done, so the first step gives 1
  state: step_lib.TrainState  # after the step
  loss: jax.Array  # per-device training loss of the step, (num_devices,)
  batch_size: int  # global batch size of the step
  comm_bytes: CommBytes  # bytes per device of the step's gradient reduction


Hook = Callable[[StepInfo], "str | None"]
PREEMPTED = "preempted"  # a SIGTERM / SIGINT reached some process
NONFINITE = "nonfinite"  # a non-finite loss or gradient with train.on_nonfinite="stop"


@dataclasses.dataclass(frozen=True)
class _Registered:
  fn: Hook
  every: int
  when: Callable[[int], bool] | None

  def due(self, step: int) -> bool:
    return (self.every > 0 and step % self.every == 0) or (self.when is not None and self.when(step))


class Hooks:
  """Hooks in registration order; ``run`` calls those due and returns the first stop reason given, so the order
  ranks the reasons too: the trainer adds its non-finite check before its preemption check, so that a run with
  both in one check window stops as non-finite (exit code 3), not as preempted (0)."""

  def __init__(self):
    self._hooks: list[_Registered] = []

  def add(self, fn: Hook, every: int = 0, when: Callable[[int], bool] | None = None) -> None:
    """Runs ``fn`` after every ``every``-th step (0: never by period) and after steps where ``when`` holds."""
    self._hooks.append(_Registered(fn, every, when))

  def run(self, info: StepInfo) -> str | None:
    stop = None
    for hook in self._hooks:
      if hook.due(info.step):
        reason = hook.fn(info)  # every due hook runs, a stop reason given or not
        stop = stop or reason
    return stop


# --- The trainer's hooks ----------------------------------------------------------------------------


def skipped_steps(state: step_lib.TrainState) -> int:
  """Steps skipped as non-finite so far (the train state's count, replicated: any device's copy)."""
  return int(state.nonfinite_steps.addressable_data(0))


def last_update(step: int, skipped: int) -> int:
  """The optimizer's count at the last update (0-based) after ``step`` steps of which ``skipped`` were skipped:
  the learning rate it used is ``schedule`` of it. A skipped (non-finite) step keeps the optimizer state, so it
  does not advance the count."""
  return max(step - 1 - skipped, 0)


class ProgressBar:
  """Every step: advance the bar; every ``log_every`` steps: show loss, learning rate and images/s, the images over
  the training seconds of ``clock`` (``TrainClock``: evaluations left out, which dropped the rate tenfold after
  each epoch's).

  Reading step t's loss waits for step t, and the loop dispatches step t + 1 only after the hooks: the devices
  wait for that dispatch once every ``log_every`` steps.
  """

  def __init__(self, bar, schedule: Callable[[int], Any], log_every: int, clock: TrainClock):
    self.bar, self.schedule, self.log_every, self.clock = bar, schedule, log_every, clock
    self._images, self._since = 0, clock.seconds()

  def __call__(self, info: StepInfo) -> None:
    self.bar.update(1)
    self._images += info.batch_size
    if info.step % self.log_every == 0:
      loss = evaluation.global_mean(info.loss)  # waits for this step: the clock below then counts it
      now = self.clock.seconds()
      self.bar.set_postfix(
        loss=f"{loss:.4f}",
        lr=f"{float(self.schedule(last_update(info.step, skipped_steps(info.state)))):.3g}",
        img_s=f"{self._images / max(now - self._since, 1e-9):.0f}",
      )
      self._images, self._since = 0, now


class NonFiniteCheck:
  """Warns when steps with a non-finite loss or gradient were skipped; policy "stop" stops the run.

  ``seen``: the count already reported (a resumed run starts from its checkpoint's, so an old bad step
  does not stop it again).
  """

  def __init__(self, policy: str, seen: int = 0):
    self.policy = policy
    self.seen = seen
    self.tripped = False  # it gave NONFINITE: another hook's stop reason at that step may have outranked it

  def __call__(self, info: StepInfo) -> str | None:
    return self.check(info.state)

  def check(self, state: step_lib.TrainState) -> str | None:
    count = skipped_steps(state)
    if count <= self.seen:
      return None
    self.seen = count
    logging.warning(
      "%d step(s) with a non-finite loss or gradient so far (update skipped); policy: %s", count, self.policy
    )
    self.tripped = self.tripped or self.policy == "stop"
    return NONFINITE if self.policy == "stop" else None


class PreemptionCheck:
  """Stops the run when any process received SIGTERM / SIGINT (a collective with several processes)."""

  def __init__(self, guard: PreemptionGuard):
    self.guard = guard

  def __call__(self, info: StepInfo) -> str | None:
    return PREEMPTED if self.guard.requested() else None


class TrainClock:
  """The run's training seconds, evaluations left out: the clock of time-to-accuracy (``train_seconds``).

  A resumed run starts it at ``seconds_before``, the seconds its checkpoint saved, so the steps a killed
  process ran after that checkpoint are not counted, and the resumed process's are. It runs from the loop's
  start (after compilation), and ``EpochEvaluation`` pauses it while it evaluates.
  """

  def __init__(self, seconds_before: float = 0.0):
    self._counted, self._since = seconds_before, time.perf_counter()

  def seconds(self) -> float:
    return self._counted + (time.perf_counter() - self._since if self._since is not None else 0.0)

  def pause(self) -> None:
    self._counted, self._since = self.seconds(), None

  def resume(self) -> None:
    self._since = time.perf_counter()


class CheckpointSaver:
  """Starts an asynchronous save; counts the seconds the loop was blocked doing so. The meta saved has the
  clock's ``train_seconds`` too, so that a resumed run's clock goes on from there."""

  def __init__(self, checkpointer: checkpoint_lib.Checkpointer, meta: dict[str, Any], clock: TrainClock):
    self.checkpointer, self.meta, self.clock = checkpointer, meta, clock
    self.blocking_seconds = 0.0

  def __call__(self, info: StepInfo) -> None:
    start = time.perf_counter()
    if self.checkpointer.save(info.step, info.state, {**self.meta, "train_seconds": self.clock.seconds()}):
      self.blocking_seconds += time.perf_counter() - start


class EvaluationFailed(Exception):
  """An epoch end's evaluation failed, in every process alike: its input (a damaged chunk of the evaluation split,
  which the processes agree on: ``data.InputFailed``), or in a one-process run anything; ``error`` is why.
  ``training``: the record's training half, which the run saves with its steps so that the resumed run evaluates
  the same state and writes the whole record (``EpochEvaluation.finish_unevaluated``)."""

  def __init__(self, training: dict[str, Any], error: Exception):
    super().__init__(f"the evaluation at step {training['step']} failed: {error}")
    self.training, self.error = training, error


class EpochEvaluation:
  """At each epoch end (and the last step): evaluate, write one record to metrics.jsonl, print a line.

  Images/s and the input-wait fraction cover the training steps since the previous record; ``train_seconds``
  is ``clock``'s, which this hook pauses while it evaluates. A checkpoint saved at step s comes after this
  hook, so metrics.jsonl then holds every record up to s, or the checkpoint holds the record's training half
  (an evaluation that failed: ``EvaluationFailed``).
  """

  def __init__(
    self,
    evaluate: Callable[[Any], dict[str, float]],
    writer: metrics_lib.MetricsWriter,
    plan: schedules.EpochPlan,
    schedule: Callable[[int], Any],
    prefetcher,
    bar,
    start_step: int,
    total_steps: int,
    clock: TrainClock,
  ):
    self.evaluate, self.writer, self.plan, self.schedule = evaluate, writer, plan, schedule
    self.prefetcher, self.bar, self.total_steps, self.clock = prefetcher, bar, total_steps, clock
    self.last_record: dict[str, Any] | None = None
    self._mark(start_step)

  def __call__(self, info: StepInfo) -> None:
    train_loss = evaluation.epoch_mean_loss(info.state)  # waits for the step: the clock below then counts it
    self.clock.pause()
    train_seconds = self.clock.seconds() - self._start_seconds  # since the last record
    skipped = skipped_steps(info.state)
    training = {
      "step": info.step,
      "train_loss": train_loss,
      "images_per_sec": self.plan.images(self._start_step, info.step) / train_seconds,
      "input_wait_fraction": (self.prefetcher.wait_seconds - self._start_wait) / train_seconds,
      "learning_rate": float(self.schedule(last_update(info.step, skipped))),
      "inter_node_bytes_per_step": info.comm_bytes.inter_node,
      "intra_node_bytes_per_step": info.comm_bytes.intra_node,
      "nonfinite_steps": skipped,
      "train_seconds": self.clock.seconds(),
    }
    if info.state.loss_scale:  # dynamic loss scaling (float16): the scale the next step starts from
      training["loss_scale"] = float(info.state.loss_scale["scale"].addressable_data(0))
    # The steps are whole: the processes save them, and the record's training half (train_lib.input_failed).
    try:
      evaluated = self.evaluate(info.state)
    except data_lib.InputFailed as e:  # raised by every process alike
      raise EvaluationFailed(training, e.error) from e.error
    except Exception as e:
      if jax.process_count() > 1:  # this process's alone: the others wait in the evaluation's collectives
        raise
      raise EvaluationFailed(training, e) from e
    self._write(training, evaluated)
    self._mark(info.step)
    self.clock.resume()

  def _write(self, training: dict[str, Any], evaluated: dict[str, float]) -> None:
    record = epoch_record(self.plan, training, evaluated, final=training["step"] == self.total_steps)
    self.writer.write(record)
    if self.writer.enabled:  # process 0 only (tqdm's write prints even for a disabled bar)
      self.bar.write(
        f"epoch {record['epoch']:.2f} step {record['step']}: train loss {record['train_loss']:.4f}, test top-1 "
        f"{100 * record['eval_top1']:.2f}% top-5 {100 * record['eval_top5']:.2f}%, "
        f"{record['images_per_sec']:.0f} images/s, input wait {100 * record['input_wait_fraction']:.1f}%"
      )
    self.last_record = record

  def finish_unevaluated(self, state: step_lib.TrainState, training: dict[str, Any]) -> None:
    """The record a resumed run's checkpoint kept without its evaluation (``EvaluationFailed``): evaluated and
    written now, off the clock (in place of one a rerun wrote before). While it still fails, raises the
    evaluation's error (the checkpoint holds the record still)."""
    self.clock.pause()
    self._write(training, evaluation.with_own_errors(self.evaluate)(state))
    self._mark(training["step"])
    self.clock.resume()

  def _mark(self, step: int) -> None:
    """Where the next record's images/s and input wait start counting: after ``step``, at this clock."""
    self._start_step, self._start_seconds, self._start_wait = step, self.clock.seconds(), self.prefetcher.wait_seconds


class HangDrill:
  """Fault drill (``train.inject_hang_at_step``): after step ``step`` process 0 sleeps, alive, as if stuck in a
  collective; the others then block in theirs. train.py's ``--step_timeout`` must end every process."""

  def __init__(self, step: int):
    self.step = step

  def __call__(self, info: StepInfo) -> None:
    if info.step == self.step and jax.process_index() == 0:
      logging.warning("fault drill: process 0 hangs after step %d (train.inject_hang_at_step)", info.step)
      while True:
        time.sleep(3600)


class ProfileTrace:
  """A jax.profiler trace of the steps after step ``first`` up to step ``last``, written to ``logdir``."""

  def __init__(self, first: int, last: int, logdir: str):
    self.first, self.last, self.logdir = first, last, logdir
    self.tracing = False

  def __call__(self, info: StepInfo) -> None:
    if info.step == self.first:
      jax.block_until_ready(info.loss)  # the trace starts with the next step
      jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
      self.tracing = True
    elif info.step == self.last and self.tracing:
      jax.block_until_ready(info.loss)
      self._stop(f"profile of steps {self.first + 1}-{self.last}")

  def close(self) -> None:
    """Writes a trace the run ended inside of (it stopped or failed before step ``last``)."""
    if self.tracing:
      self._stop(f"profile from step {self.first + 1}, cut short by the end of the run,")

  def _stop(self, what: str) -> None:
    jax.profiler.stop_trace()
    self.tracing = False
    logging.info("%s written to %s", what, self.logdir)


class StepTimer:
  """Waits for each step, then appends its wall seconds and the bytes this machine's network interfaces
  sent during it (loopback excluded; Linux sysfs counters) to a JSON-lines file.

  The trainer runs it before its own hooks (after train.py's watchdog, which only notes the time) and ``restart``
  after them, so that a step's seconds leave out the previous step's evaluation or checkpoint save: they count its
  input, its dispatch and its computation."""

  def __init__(self, path: str, resume_step: int = 0):
    self.path = path
    if os.path.exists(path) and not resume_step:  # a run started over: the previous run's timings kept aside
      metrics_lib.keep_aside(path)
    elif os.path.exists(path):  # a resumed run's steps after its checkpoint ran again: their first timing goes
      metrics_lib.keep_records(path, resume_step)
    self.restart()

  def __call__(self, info: StepInfo) -> None:
    jax.block_until_ready(info.loss)
    now, sent = time.perf_counter(), sent_bytes()
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": info.step, "seconds": now - self._last_time, "sent_bytes": sent - self._last_sent}))
      f.write("\n")
    self.restart(info)

  def restart(self, info: StepInfo | None = None) -> None:
    self._last_time, self._last_sent = time.perf_counter(), sent_bytes()


def sent_bytes() -> int:
  """Bytes sent by this network namespace's interfaces but loopback, so far (0 where sysfs has none)."""
  total = 0
  root = "/sys/class/net"
  for name in os.listdir(root) if os.path.isdir(root) else ():
    if name != "lo":
      try:
        with open(os.path.join(root, name, "statistics", "tx_bytes")) as f:
          total += int(f.read())
      except OSError:
        pass
  return total


# The record's keys that come from training, after the evaluation's, in metrics.jsonl's order.
TRAINING_KEYS = (
  "images_per_sec",
  "input_wait_fraction",
  "learning_rate",
  "inter_node_bytes_per_step",
  "intra_node_bytes_per_step",
  "nonfinite_steps",
)


def epoch_record(
  plan: schedules.EpochPlan, training: dict[str, Any], eval_metrics: dict[str, float], final: bool
) -> dict[str, Any]:
  """One line of metrics.jsonl (its keys are an interface, listed in README.md): ``training``, the record's
  training half (``EpochEvaluation``), and the evaluation's metrics."""
  step = training["step"]
  record = {"step": step, "epoch": round(plan.epochs_done(step), 4), "train_loss": training["train_loss"]}
  record |= eval_metrics | {key: training[key] for key in TRAINING_KEYS}
  record |= {"final": final, "train_seconds": training["train_seconds"]}
  if "loss_scale" in training:
    record["loss_scale"] = training["loss_scale"]
  return record
