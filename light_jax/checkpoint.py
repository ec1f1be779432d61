"""Checkpoints with orbax: save the train state asynchronously, resume from the newest good one.

What a checkpoint holds: the whole ``TrainState`` (step, params, optimizer state, the BatchNorm statistics,
error-feedback residuals and the epoch's running loss sum and count per device, the non-finite step counter, the
loss scale) and a JSON ``meta`` item with the resolved config, the mesh, the state's layout
(``train_step.STATE_LAYOUT``), the reducer's state shapes, the training seconds so far and, where the evaluation at
that step failed, its record's training half (``unevaluated``). The data pipeline needs no
state of its own: the global batch of step s is a pure function of (seed, s) (data/pipeline.py), so resuming at
step s *is* restoring the iterator. There is no other randomness in a step.

Saving is asynchronous: ``save`` returns once orbax has copied the arrays off the devices, and the
files are written in the background; the train step may then donate (overwrite) the device buffers
(tested). Every process calls ``save`` and ``restore`` (orbax coordinates them with the JAX
distributed runtime). A save that did not finish (killed process) leaves no ``commit_success`` marker and
orbax ignores it; a finished checkpoint whose files are damaged fails to restore, and ``restore_latest``
falls back to the previous one and says so. The damaged one stays on disk until the resumed run saves at
its step again, which replaces it, or until ``checkpoint.keep`` removes it as the oldest saved. A save whose
writes fail (a full disk) raises ``CheckpointError`` at the next save or at ``close``, in one line; the unfinished
save's folder is removed at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import logging
import os
import re
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from light_jax import liveness, preemption, stderr_redirect
from light_jax.config import SAFE_TO_CHANGE, base_config, flat_fields


@functools.cache  # once per process: the registry keeps it
def _save_each_shard_whole() -> None:
  """Makes orbax write each distinct shard of an array whole, once, from the device that holds its replica 0:
  orbax's default where JAX_PLATFORMS names a GPU. Otherwise orbax splits each replicated array across its
  replicas ("replica-parallel" saving), and on CPU that compiled a slicing program per array shape at the first
  save: seconds of a stalled train loop for a 2 MiB state on 8 CPU devices (docs/measurements.md, "The first
  checkpoint"). The handler is otherwise orbax's default, its array metadata store included. It is registered
  in orbax's own registry, for every orbax save in the process (a handler registered for jax.Array before is
  replaced): orbax's public register_type_handler would log a warning about the override at every start."""
  type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
    jax.Array,
    ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
    override=True,
    ignore_warnings=True,
  )


class CheckpointError(RuntimeError):
  """No checkpoint can be used; the message says why and what to do."""


_WORKDIR_LOCKS: dict[str, Any] = {}  # the open lock file of each workdir this process holds, for its lifetime


def lock_workdir(workdir: str) -> None:
  """Takes ``workdir`` for this process (process 0 of a run) until it ends, or raises CheckpointError naming the
  run that holds it. A second run in the same workdir (a job restarted while the old process lingers) deleted the
  first one's save in flight, and each broke the other. A POSIX lock (lockf): the kernel drops it when the process
  ends, however, and the processes it forks do not inherit it; but closing any descriptor of the file drops it, so
  nothing else opens it. A file system without locks is not checked."""
  import fcntl

  if os.path.abspath(workdir) in _WORKDIR_LOCKS:  # held already: a second open and close would drop the lock
    return
  path = os.path.join(workdir, ".lock")
  try:
    lock_file = open(path, "a+")
  except OSError as e:
    # One that is there (a folder, another user's file) can go; a workdir that takes no new file (/proc) cannot
    # hold a run.
    what = "remove it, or give another --workdir" if os.path.lexists(path) else "give another --workdir"
    raise CheckpointError(f"--workdir={workdir}: cannot open {path} ({e.strerror}); {what}") from None
  try:
    fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    lock_file.seek(0)
    holder = lock_file.read().strip() or "another process"
    lock_file.close()
    if e.errno not in (errno.EACCES, errno.EAGAIN):  # no locks here (ENOLCK): nothing to check with
      logging.warning("cannot lock %s (%s): a second run in this workdir would not be refused", path, e.strerror)
      return
    raise CheckpointError(
      f"--workdir={workdir} is in use by another run ({holder}): two runs in one workdir delete each other's "
      "checkpoints. Wait for it to end or stop it, or give another --workdir."
    ) from None
  try:
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock_file.flush()
  except OSError as e:  # a full disk, say: the run could not save there either
    with contextlib.suppress(OSError):  # its close flushes the line again
      lock_file.close()
    raise CheckpointError(
      f"--workdir={workdir}: cannot write {path} ({e.strerror}); free space there, or give another --workdir"
    ) from None
  _WORKDIR_LOCKS[os.path.abspath(workdir)] = lock_file


def workdir_holder(workdir: str) -> str | None:
  """Who holds ``workdir`` (``lock_workdir``'s line: "process N on HOST, since ..."), or None. For a tool about to
  empty or replace a workdir, which would break the run going on there. It takes a shared lock for an instant: a
  run starting in that instant is refused as if the workdir were in use."""
  import fcntl

  if not os.path.isdir(workdir):
    return None
  if any(os.path.samefile(held, workdir) for held in _WORKDIR_LOCKS if os.path.exists(held)):
    return f"this process ({os.getpid()})"  # probed, its lock would go (closing any descriptor of the file drops it)
  try:
    lock_file = open(os.path.join(workdir, ".lock"))  # read-only is enough for a shared lock: others' files too
  except OSError:  # no lock file (no run yet, or one from before locks), or none this process may open
    return None
  with lock_file:
    try:
      fcntl.lockf(lock_file, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EACCES, errno.EAGAIN):  # no locks on this file system: nothing to tell
        return None
      return lock_file.read().strip() or "another process"
    fcntl.lockf(lock_file, fcntl.LOCK_UN)
  return None


def check_shared_directory(directory: str, wait_seconds: float = 10.0) -> None:
  """In a multi-process run, before any checkpoint: every process sees the file process 0 writes in
  ``directory``. Orbax's checkpoints need that: process 0 makes a save's folders and commits it once every
  process has written its part there. In a folder of each machine's own, no save is ever committed (process 1
  times out waiting for folders it cannot see, after minutes). A collective: every process calls it, and every
  one raises CheckpointError alike."""
  import numpy as np
  from jax.experimental import multihost_utils

  token = int(multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(4), np.uint32)[0]))
  path = os.path.join(directory, f".shared_by_every_process_{token:08x}")
  if jax.process_index() == 0:
    with open(path, "w") as f:
      f.write("written by process 0 to check that every process sees this directory; removed at once\n")
  try:  # removed also where a collective below fails (a peer gone) or a signal stops set-up
    multihost_utils.sync_global_devices("light_jax shared directory: written")
    deadline = time.monotonic() + wait_seconds  # a shared file system may show a new file late
    while not (seen := os.path.exists(path)) and time.monotonic() < deadline:
      time.sleep(0.5)
    seen_by = multihost_utils.process_allgather(np.array(seen))
  finally:
    if jax.process_index() == 0:
      with contextlib.suppress(OSError):
        os.remove(path)
  blind = [int(i) for i in np.flatnonzero(~np.asarray(seen_by, bool))]
  if blind:
    raise CheckpointError(
      f"--workdir={directory} is not one directory for every process: process(es) {blind} do not see the file "
      "process 0 wrote there. Checkpoints need a directory that every process shares: give every machine the "
      "same path on a shared file system (NFS, a cluster file system)."
    )


class Checkpointer:
  """Saves when told (the trainer's hooks decide when), keeps the newest ``keep``."""

  def __init__(self, workdir: str, keep: int):
    _save_each_shard_whole()
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.keep = keep
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=True,
        # An unfinished save's folder (a killed process, a full disk) is never used again: removed at the next
        # start, else each kill and each failed save leaves a checkpoint's worth of disk behind.
        cleanup_tmp_directories=True,
      ),
    )
    self.damaged_steps: set[int] = set()  # found by restore_latest; a save at one of them replaces it
    self._errors: dict[int, str] = {}  # why each of them failed to restore
    self._in_flight: int | None = None  # the step of the save writing in the background
    self._failed = False  # a save failed: reported once, and close() waits for nothing more
    _watch_failed_saves()

  def save(self, step: int, state, meta: dict[str, Any]) -> bool:
    """Starts an asynchronous save of ``state`` at ``step``; False if that step is saved already (and
    restores: a damaged one is replaced, else a resumed run would fall back past it on every restart)."""
    if step in self.damaged_steps:
      self.damaged_steps.discard(step)
      # Unless checkpoint.keep has removed it since: orbax drops the oldest saved first, not the lowest step.
      if step in self.manager.all_steps():
        logging.warning("replacing the damaged checkpoint at step %d in %s", step, self.directory)
        self.manager.delete(step)
    self._wait_for_save_in_flight()  # its error (a full disk, say) surfaces here, as a CheckpointError
    if step in self.manager.all_steps():
      return False
    try:
      self.manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
      )
    except Exception as e:  # the part of a save done before it returns: the folders, the copy off the devices
      raise self._save_failed(step, e) from None
    self._in_flight = step
    return True

  def wait_until_saved(self) -> None:
    """Waits for the save in flight; its failure raises CheckpointError (or PeerLost)."""
    self._wait_for_save_in_flight()

  def _wait_for_save_in_flight(self) -> None:
    try:
      # Polled, not orbax's wait alone: in a multi-process run, a process whose writes failed has orbax's save
      # thread wait at a barrier that the others, whose writes went through, never reach (10 minutes, then an
      # error), and orbax keeps the error until that wait ends. Noted as it is logged, it is raised at once: that
      # ends this process, and the others stop on the reason it publishes (liveness.PeerWatchdog).
      step_directory = os.path.join(self.directory, str(self._in_flight))  # orbax's folder of a step: its number
      while self.manager.is_saving_in_progress():
        if step_directory in _SAVE_FAILURES:
          raise _SAVE_FAILURES.pop(step_directory)
        time.sleep(0.05)
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._save_failed(self._in_flight, e) from None
    self._in_flight = None

  def _save_failed(self, step: int | None, error: Exception) -> CheckpointError | liveness.PeerLost:
    """The one-line error for a save that failed: what the file system said, and how to go on without losing
    more than the steps since the newest finished checkpoint; or PeerLost, where a collective of the save failed
    because another process died (its orbax barriers and gathers: not the file system's fault)."""
    self._failed = True
    reason = _file_system_reason(error)
    if liveness.lost_a_peer(error):
      return liveness.PeerLost(f"saving the checkpoint at step {step}: a collective failed ({reason[:300]})")
    try:  # a damaged step is not one to resume from: a rerun falls back past it again
      saved = [s for s in self.manager.all_steps() if s != step and s not in self.damaged_steps]
    except Exception:  # the file system may fail this too
      saved = []
    resume = (
      f"the newest finished checkpoint, step {max(saved)}, is intact: rerun the same command to resume from it"
      if saved
      else "no checkpoint has been saved yet: a rerun starts from step 0"
    )
    fix = (
      f"free space there (checkpoint.keep={self.keep} checkpoints are kept), or move --workdir to a larger disk"
      if "No space left on device" in reason or "Disk quota exceeded" in reason
      else "fix what the file system says"
    )
    return CheckpointError(
      f"saving the checkpoint at step {step} in {self.directory} failed: {reason}. Training stopped: {fix}; {resume} "
      "(the unfinished save's folder is removed then)."
    )

  def restore_latest(
    self,
    abstract_state,
    config: dict[str, Any],
    mesh_shape: list[int] | None = None,
    restore_target: Callable[[Any, int], tuple[Any, Callable[[Any], Any]]] | None = None,
    comm_state_shapes: dict[str, list[int]] | None = None,
  ) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the newest checkpoint that restores; None when there is none.

    ``abstract_state`` gives shapes, dtypes and shardings (jax.ShapeDtypeStruct leaves). The saved config
    is compared with ``config`` first: a breaking change raises CheckpointError, a safe one is logged. So is
    the saved mesh with ``mesh_shape`` ([nodes, local]): the per-device state (residuals, loss sums) has the
    mesh's shape, so a checkpoint from another mesh cannot restore, though nothing in it is damaged.
    ``restore_target(abstract_state, layout)``: for the state layout a checkpoint's meta records
    (``state_layout``, 1 where it records none), what to restore and how to make ``abstract_state``'s layout
    from it (``train_step.restore_target``). ``comm_state_shapes`` (``shapes`` of the reducer's state): compared
    with the saved ones, which follow the reducer's buckets: with ``comm.strategy=auto`` or ``comm.fusion=adaptive``
    a changed calibration file can plan others, and that checkpoint is not damaged either.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      meta = self._read(step, "meta", ocp.args.JsonRestore())
      if meta is None:
        continue
      breaking, safe = config_changes(meta["config"], config)
      if breaking:
        raise CheckpointError(
          f"the checkpoint at step {step} in {self.directory} was written with a config that differs where "
          f"it matters: {'; '.join(breaking)}. Use a new --workdir, or restore those values."
        )
      saved_mesh = meta.get("mesh")
      if mesh_shape is not None and saved_mesh is not None and list(saved_mesh) != list(mesh_shape):
        raise CheckpointError(
          f"the checkpoint at step {step} in {self.directory} was written on a mesh of nodes x local = "
          f"{' x '.join(map(str, saved_mesh))}; this run's mesh is {' x '.join(map(str, mesh_shape))}. Its per-device "
          f"state has the old mesh's shape: run with --config.mesh.nodes={saved_mesh[0]} "
          f"--config.mesh.local={saved_mesh[1]} on as many devices, or use a new --workdir."
        )
      saved_shapes = meta.get("comm_state_shapes")
      if comm_state_shapes is not None and saved_shapes is not None and saved_shapes != comm_state_shapes:
        differ = sorted(
          k for k in saved_shapes.keys() | comm_state_shapes.keys() if saved_shapes.get(k) != comm_state_shapes.get(k)
        )
        raise CheckpointError(
          f"the checkpoint at step {step} in {self.directory} was written with other communication buckets: the "
          f"reducer's state differs in {', '.join(differ[:4])}{' ...' if differ[4:] else ''} (saved "
          f"{saved_shapes.get(differ[0])}, now {comm_state_shapes.get(differ[0])}). comm.strategy=auto and "
          "comm.fusion=adaptive plan the buckets from comm.cost_model: a calibration file that changed since, or "
          "another platform, plans others. Restore that file, or use a new --workdir."
        )
      for change in safe:
        logging.warning("config changed since the checkpoint (accepted): %s", change)
      try:
        target, convert = (
          restore_target(abstract_state, meta.get("state_layout", 1)) if restore_target else (abstract_state, None)
        )
      except ValueError as e:  # a layout this code cannot read
        raise CheckpointError(
          f"the checkpoint at step {step} in {self.directory} was {e}: resume with the version that wrote it, or "
          "use a new --workdir."
        ) from None
      state = self._read(step, "state", ocp.args.StandardRestore(target))
      if state is None:
        continue
      return step, convert(state) if convert else state, meta
    if steps:
      raise CheckpointError(
        f"none of the checkpoints in {self.directory} (steps {steps}) can be restored: damaged, or written by a "
        f"version of light_jax whose train state differs (the newest: {self._errors[steps[0]]}); move the "
        f"directory away to start over, or resume with the version that wrote them."
      )
    return None

  def _read(self, step: int, item: str, args: ocp.args.CheckpointArgs) -> Any:
    """The checkpoint at ``step``'s ``item`` ("state", "meta"), or None where reading it failed, here or in another
    process: each process reads its own devices' shards, so one may find damage the others do not, and every
    process must fall back alike (one that resumed from another step than the others aborted in the first
    collective)."""
    error = None
    try:
      with _quiet_if_it_fails():
        result = self.manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]
    except Exception as e:  # a damaged checkpoint: any error orbax or the file system raises, but these two
      _raise_an_interruption(e)
      _raise_a_lost_peer(e)
      result, error = None, e
    try:
      if error is not None:
        self._pass_the_restores_barrier()
      failed = self._processes_that_failed(step, error is None)
    except Exception as e:  # a peer lost in these collectives
      _raise_a_lost_peer(e)
      raise
    if not failed:
      return result
    self.damaged_steps.add(step)  # on every process: a save at that step replaces it, a collective
    if error is not None:
      # orbax's read errors go on with a whole TensorStore spec ("See full TensorStore details: ..."): cut there.
      reason = str(error).split(" See full TensorStore details")[0].splitlines()[0][:200] if str(error) else ""
      self._errors[step] = f"{type(error).__name__}: {reason}"
    else:
      self._errors[step] = f"it failed on process {', '.join(map(str, failed))}: see its log"
    logging.warning(
      "checkpoint at step %d in %s cannot be restored (%s); falling back to the previous one",
      step,
      self.directory,
      self._errors[step],
    )
    return None

  def _pass_the_restores_barrier(self) -> None:
    """A multi-process restore ends in orbax's barrier (``Checkpointer.restore``), which a process whose read
    failed never reached; the others wait in it. This process passes it now, so that the next collective of each
    is the same one (orbax 0.12's; tests/test_multiprocess.py damages one process's shards to check it)."""
    if jax.process_count() == 1:
      return
    from orbax.checkpoint._src.multihost import multihost

    checkpointer = self.manager._checkpointer
    key = multihost.unique_barrier_key("Checkpointer:restore", prefix=checkpointer._barrier_sync_key_prefix)
    multihost.sync_global_processes(key, processes=checkpointer._active_processes)

  def _processes_that_failed(self, step: int, ok: bool) -> list[int]:
    """The indices of the processes whose read of the checkpoint at ``step`` failed (``ok`` False): a collective,
    which every process calls alike. Processes that list other checkpoints (a file system whose machines' views
    differ) are refused: each would resume from another step."""
    steps, flags = liveness.from_every_process([step, ok]).T
    if (steps != step).any():
      raise CheckpointError(
        f"the processes read different checkpoints in {self.directory} ("
        + ", ".join(f"process {i}: step {s}" for i, s in enumerate(steps))
        + "): every machine must see the same --workdir, on a file system they share and that shows each the same"
        " files; rerun once it does."
      )
    return [index for index, flag in enumerate(flags) if not flag]

  def close(self) -> None:
    """Waits for the save in flight (its failure raises CheckpointError) and stops orbax's threads. After a failed
    save, which was reported already, it leaves them: in a multi-process run they wait at a barrier for minutes."""
    # orbax removes the unfinished saves' folders in a thread it waits for at the first save only: a run that ends
    # before one (a stop in set-up, a refused config) exited under it, and its error came after the run's last line.
    try:
      self.manager._maybe_await_cleanup_tmp_directory()  # orbax 0.12's (tests/test_checkpoint.py pins it)
    except Exception as e:  # not the run's own error, which may be on its way out through this close
      logging.warning("orbax's removal of unfinished saves' folders in %s failed: %s", self.directory, e)
    if self._failed:
      return
    self._wait_for_save_in_flight()
    self.manager.close()


def _raise_an_interruption(error: Exception) -> None:
  """Raises the interruption (a Ctrl-C, a stop signal in set-up: preemption.StoppedInSetup) that ``error`` wraps:
  orbax wraps what stops a read in an Exception of its own, which read as a damaged checkpoint (a good one was then
  passed over, or the run told to move its checkpoints away)."""
  for cause in preemption.error_chain(error):
    if not isinstance(cause, Exception):
      raise cause


def _raise_a_lost_peer(error: Exception) -> None:
  """Raises PeerLost where a multi-process restore's collective failed because another process died: every good
  checkpoint read as damaged, and the run was told to move them away (exit 2), not that a peer was gone (4)."""
  if liveness.lost_a_peer(error):
    raise liveness.PeerLost(f"restoring a checkpoint: a collective failed ({liveness.first_line(error)})") from None


def _file_system_reason(error: Exception) -> str:
  """What a failed write says, in one line: an OSError's own words, or a TensorStore error's last clause
  ("... Failed to write 762149 bytes to file 7: No space left on device [os_error_code='28'] [tensorstore_spec=
  ...]" -> "No space left on device")."""
  if isinstance(error, OSError) and error.strerror:
    return f"{error.strerror} ({error.filename})" if error.filename else error.strerror
  text = str(error).split(" [tensorstore_spec=")[0].split(" See full TensorStore details")[0]
  text = text.splitlines()[0] if text else type(error).__name__
  text = re.sub(r" \[os_error_code='?\d+'?\]", "", text)
  return text.rsplit(": ", 1)[-1] if "os_error_code" in str(error) else text[:300]


# Lines of a log record (absl or Python logging): kept from a failed restore's output, the rest is dropped.
_LOG_RECORD = re.compile(r"^[IWEF]\d{4} |^(INFO|WARNING|ERROR|CRITICAL):")


@contextlib.contextmanager
def _quiet_if_it_fails(settle_seconds: float = 0.5):
  """Keeps a failed restore's noise off stderr: orbax stops at the first bad array while TensorStore reads of the
  others are in flight, and their callbacks then print tracebacks ("Event loop is closed", coroutines never
  awaited) from other threads, hundreds of lines that bury the one-line report. After a failure, stderr (the
  file descriptor: those come from C++ threads too) goes to a temporary file for ``settle_seconds`` while the
  reads finish; then only log records pass on, with a count of what was left out. While the restore runs,
  stderr stays as it is: a restore that hangs (a peer gone) must still be able to say so. The error raised is
  always the restore's own (Ctrl-C included: it is not captured)."""
  _ignore_abandoned_reads()  # before the restore: a failing one's reads complain before orbax raises
  try:
    yield
  except Exception:
    _settle_quietly(settle_seconds)
    raise


# The coroutine of one array's read in orbax, which a failed restore abandons.
_ORBAX_READ = "_read_array_index_and_device_put"


def _ignore_abandoned_reads() -> None:
  """From the first restore on, for the rest of the process: a failed restore's abandoned reads, finalized at the
  interpreter's exit complain then, as coroutines ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put>") or as asyncio tasks and futures ("exception was never retrieved"), with a
  traceback and a TensorStore spec each: thousands of lines after the run's last line, its one-line error
  buried. Those are dropped (nothing else raises them: a restore that fails raises its own error, which is
  reported); any other unraisable exception or asyncio record passes as before. (TensorStore's threads also print
  "Event loop is closed" tracebacks straight to stderr while a failing restore runs: ``_settle_quietly`` takes
  those that come after it.)"""
  if getattr(sys.unraisablehook, "drops_abandoned_reads", False):
    return  # the filters below are on already
  stderr_redirect.drop_unraisables(
    lambda unraisable: getattr(unraisable.object, "__qualname__", None) == _ORBAX_READ, marker="drops_abandoned_reads"
  )

  # The reads' tasks and TensorStore's futures under them: asyncio logs "Task (or Future) exception was never
  # retrieved" for each, the exception a read error ("Error reading ...", "error while reading ...").
  def keep(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return "exception was never retrieved" not in message or ("reading" not in message and _ORBAX_READ not in message)

  logging.getLogger("asyncio").addFilter(keep)
  # And the reads that never started: "coroutine '_read_array_index_and_device_put' was never awaited".
  warnings.filterwarnings("ignore", message=f"coroutine '{_ORBAX_READ}' was never awaited", category=RuntimeWarning)


# The error of each background save whose writes failed in this process, by its step's folder, as orbax's save thread
# logs it.
_SAVE_FAILURES: dict[str, BaseException] = {}


@functools.cache  # once per process
def _watch_failed_saves() -> None:
  """Notes each background save that fails (``_SAVE_FAILURES``), from the error record orbax's save thread logs as
  it fails: orbax itself gives the error only when its threads are done waiting for the other processes.

  And keeps the failure's noise down. A save that fails (a full disk) is reported by ``Checkpointer`` in one line.
  Orbax and asyncio also report it, from their threads, once per array: a traceback with a whole TensorStore spec
  each, a thousand lines for a small model, burying that line. What is left of them: orbax's error records, each
  cut to its first line. Dropped: asyncio's "exception was never retrieved" for the writes, TensorStore's
  callbacks for the writes still in flight when the save's event loop closed, and the writes' coroutines
  abandoned at exit."""

  def note_and_shorten_orbax_errors(record: logging.LogRecord) -> bool:
    if "/orbax/" in record.pathname and record.levelno >= logging.ERROR and record.exc_info:
      # "Failed to run N Handler Commit operations ... directory: DIR". Not a timeout at the barrier where the
      # processes meet after writing: that is another process's failure, which it reports itself.
      failed = re.search(r"directory: (\S+)$", record.getMessage())
      if record.pathname.endswith("async_checkpointer.py") and failed and "barrier" not in str(record.exc_info[1]):
        _SAVE_FAILURES[os.path.normpath(failed.group(1))] = record.exc_info[1]
      record.msg, record.args = record.getMessage().split(" [tensorstore_spec=")[0].splitlines()[0], ()
      record.exc_info = record.exc_text = None
    return True

  logging.getLogger("absl").addFilter(note_and_shorten_orbax_errors)  # orbax logs through absl's logger

  def keep(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return "exception was never retrieved" not in message or "writing" not in message

  logging.getLogger("asyncio").addFilter(keep)
  stderr_redirect.drop_unraisables(
    lambda unraisable: (
      getattr(unraisable.object, "__qualname__", "").endswith(_ORBAX_WRITE) or _late_callback(unraisable)
    )
  )


# The coroutine of one array's write in orbax, which a failed save abandons.
_ORBAX_WRITE = "async_serialize_from_host.<locals>.write_fragment"


def _late_callback(unraisable) -> bool:
  """TensorStore's callback for a write that ended after the save's event loop closed on the first failed one
  ("RuntimeError: Event loop is closed" in ``call_soon_threadsafe``, reported with no object)."""
  tb = unraisable.exc_traceback
  while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_name != "call_soon_threadsafe":
    tb = tb.tb_next
  return (
    unraisable.object is None
    and isinstance(unraisable.exc_value, RuntimeError)
    and str(unraisable.exc_value) == "Event loop is closed"
    and tb is not None
    and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
  )


def _settle_quietly(seconds: float) -> None:
  """``seconds`` with stderr's file descriptor in a temporary file, then its log records written on. Best effort:
  where no file can be made, the noise shows."""
  try:
    captured = tempfile.TemporaryFile()
  except OSError:
    return
  with captured:
    try:
      with stderr_redirect.redirected_to(captured):
        time.sleep(seconds)
        gc.collect()  # finalize the abandoned coroutines now, while their complaints are still captured
    finally:  # also on a Ctrl-C in the wait: what was captured is not lost
      captured.seek(0)
      lines = captured.read().decode(errors="replace").splitlines(keepends=True)
      kept = [line for line in lines if _LOG_RECORD.match(line)]
      if len(kept) < len(lines):
        kept.append(
          f"(the failed restore printed {len(lines) - len(kept)} lines of orbax/TensorStore output, left out)\n"
        )
      sys.stderr.write("".join(kept))
      sys.stderr.flush()


def config_changes(
  saved: dict[str, Any], current: dict[str, Any], safe_fields: tuple[str, ...] | frozenset[str] = SAFE_TO_CHANGE
) -> tuple[list[str], list[str]]:
  """(breaking, safe) differences between a checkpoint's config and the current one, as "field: a -> b";
  ``safe_fields``: the fields (or groups of fields) that may differ.

  A field the checkpoint does not have (added to light_jax since it was written) is safe at its default in
  ``base_config()``: a new field's default is the behaviour before it existed.
  """
  old, new, defaults = flat_fields(saved), flat_fields(current), flat_fields(base_config().to_dict())
  breaking, safe = [], []
  for key in sorted(old.keys() | new.keys()):
    if old.get(key) != new.get(key):
      change = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
      added_since = key not in old and key in defaults
      added_at_default = added_since and new.get(key) == defaults[key]
      if added_at_default:
        change = f"{key}: not in the checkpoint's config (added since), at its default {new.get(key)!r}"
      elif added_since:
        change = (
          f"{key}: not in the checkpoint's config (added since, so the run used its default "
          f"{defaults[key]!r}) -> {new.get(key)!r}"
        )
      is_safe = added_at_default or any(key == s or key.startswith(s + ".") for s in safe_fields)
      (safe if is_safe else breaking).append(change)
  return breaking, safe


def shapes(tree) -> dict[str, list[int]]:
  """The shape of each leaf of ``tree`` by its path, as JSON keeps it (a checkpoint's meta)."""
  return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def abstract(tree):
  """Shapes, dtypes and shardings of a pytree of arrays (the restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
