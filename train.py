"""Train an image classifier on a (node, local) device mesh.

  python train.py --config configs/fashion_mnist.py --workdir runs/fmnist
  python train.py --config configs/fashion_mnist.py:lars --workdir runs/lars --config.num_epochs=3

Multi-process (one process per machine): pass --coordinator, --num_processes and --process_id, or
launch under a cluster manager that jax.distributed detects by itself (SLURM, Open MPI, ...).
"""

import errno
import logging as pylogging
import os
import sys
import traceback

from absl import app, flags, logging

# These import nothing of JAX: devices are set up in main.
from light_jax import cli, coordinator
from light_jax import config as config_lib
from light_jax.exit_codes import ExitCode, flush_output, signals_exit_at_once

_CONFIG = cli.define_config_file("config", "Config file, optionally with :VARIANT.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, plots and checkpoints.")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0, for multi-process runs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
_PEER_TIMEOUT = flags.DEFINE_float(
  "peer_timeout",
  60.0,
  "Multi-process: seconds without a sign of life from another process before every "
  "process stops with an error (JAX's own heartbeat timeout is set to four times this, as a backstop).",
)
_STEP_TIMEOUT = flags.DEFINE_float(
  "step_timeout",
  600.0,
  "Multi-process: seconds without a finished training step, every process alive, before every process stops "
  "with an error (a stuck collective); counted from the first step. 0: never.",
)
_COMPILATION_CACHE_DIR = flags.DEFINE_string(
  "compilation_cache_dir",
  None,
  "Where compiled programs are kept between runs, so that a resumed or repeated run skips compiling (JAX's "
  "persistent compilation cache). Default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/light_jax/compilation_cache/"
  "HOST. An empty value turns it off.",
)
_INIT_TIMEOUT = flags.DEFINE_integer(
  "init_timeout", 300, "Multi-process: seconds to wait for every process to join at start-up."
)
flags.mark_flags_as_required(["config", "workdir"])
flags.register_validator(
  "peer_timeout",
  lambda v: cli.MIN_PEER_TIMEOUT <= v <= cli.MAX_SECONDS,
  message=f"--peer_timeout must be from {cli.MIN_PEER_TIMEOUT:g} to {cli.MAX_SECONDS:.0f} seconds (below, a process "
  "busy compiling or loading can miss its heartbeats and be stopped for dead)",
)
flags.register_validator(
  "step_timeout",
  lambda v: 0 <= v <= cli.MAX_SECONDS,
  message=f"--step_timeout must be from 0 (never) to {cli.MAX_SECONDS:.0f} seconds",
)
flags.register_validator(
  "init_timeout",
  lambda v: 0 < v <= cli.MAX_SECONDS,
  message=f"--init_timeout must be from 1 to {cli.MAX_SECONDS:.0f} seconds",
)
flags.register_validator(
  "coordinator",
  lambda v: v is None or _is_host_port(v),
  message="--coordinator must be host:port, the port from 1 to 65535 (an IPv6 host in brackets: [::1]:1234)",
)


def _is_host_port(address: str) -> bool:
  try:
    coordinator.parse(address)
  except coordinator.CoordinatorError:
    return False
  return True


@flags.multi_flags_validator(
  ["coordinator", "num_processes", "process_id"],
  message="--coordinator, --num_processes and --process_id go together: give all three, with 0 <= process_id < "
  "num_processes, for a multi-process run started by hand, or none (one process, or a cluster manager that "
  "jax.distributed detects, such as SLURM or Open MPI)",
)
def _multi_process_flags(values) -> bool:
  given = [values[name] is not None for name in ("coordinator", "num_processes", "process_id")]
  if not any(given):
    return True
  return all(given) and 0 <= values["process_id"] < values["num_processes"]


# Environment variables by which cluster managers that jax.distributed can auto-detect announce a job.
_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")


def _cluster_detected() -> bool:
  return any(os.environ.get(v) for v in _CLUSTER_ENV)


def _cluster_variables_set() -> str:
  return ", ".join(v for v in _CLUSTER_ENV if os.environ.get(v)) or "none"


def _num_processes() -> int | None:
  """The run's process count: --num_processes, or the one a cluster manager announces (1 where it announces
  none, as salloc without srun); None where a coordinator's address alone (JAX_COORDINATOR_ADDRESS) announces the
  run, whose count JAX learns at the join."""
  if _COORDINATOR.value is not None:
    return _NUM_PROCESSES.value  # given with it (the flags' validator)
  if not _cluster_detected():
    return 1
  announced = os.environ.get("SLURM_NTASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE")
  if announced:
    return int(announced)
  return None if os.environ.get("JAX_COORDINATOR_ADDRESS") else 1


def _start_jax(config):
  """Sets up devices; must run before anything touches a JAX backend (never at import time)."""
  from light_jax import xla_flags

  xla_flags.apply()  # on GPUs: overlap the gradient collectives with the backward pass; on CPU: patience
  import jax

  from light_jax import compilation_cache, liveness

  compilation_cache.enable(_COMPILATION_CACHE_DIR.value)  # a resumed run reads its compiled programs

  explicit = _COORDINATOR.value is not None
  detected = _cluster_detected()
  num_processes = _num_processes() or 1  # for the CPU devices' split
  if not isinstance(config.mesh.cpu_devices, int) or config.mesh.cpu_devices < 0:
    cli.fail(f"invalid config: mesh.cpu_devices={config.mesh.cpu_devices!r} must be >= 0 (0: the platform's own).")
  if config.mesh.cpu_devices // num_processes > cli.MAX_DEVICES:  # 1,024 in one process: its steps' collectives stalled
    cli.fail(
      f"invalid config: mesh.cpu_devices={config.mesh.cpu_devices} simulates {config.mesh.cpu_devices // num_processes}"
      f" CPU devices in each of {num_processes} process(es); at most {cli.MAX_DEVICES} in one process (more stalled "
      "in the steps' collectives): use fewer, or more processes."
    )
  if config.mesh.cpu_devices:
    # Simulated CPU devices (tests, laptops): the total is split over the processes. No effect on GPUs.
    jax.config.update("jax_num_cpu_devices", max(config.mesh.cpu_devices // num_processes, 1))
  timeouts = dict(
    initialization_timeout=_INIT_TIMEOUT.value,
    heartbeat_timeout_seconds=liveness.heartbeat_timeout(_PEER_TIMEOUT.value),
  )
  if explicit:  # before joining: the address resolves, process 0's port is free, the others wait for process 0
    try:
      with signals_exit_at_once(f"waiting for process 0 at --coordinator={_COORDINATOR.value}; nothing to save."):
        timeouts["initialization_timeout"] = coordinator.wait_until_reachable(
          _COORDINATOR.value, _PROCESS_ID.value, num_processes, _INIT_TIMEOUT.value
        )
    except coordinator.CoordinatorError as e:
      cli.fail(str(e))
  not_joined = _not_joined(explicit, num_processes)
  try:
    if explicit:
      coordinator.join(
        jax,
        _COORDINATOR.value,
        num_processes=num_processes,
        process_id=_PROCESS_ID.value,
        not_joined=not_joined,
        **timeouts,
      )
    elif detected:
      coordinator.join(jax, not_joined=not_joined, **timeouts)
  except (ValueError, RuntimeError) as e:
    reason = f"jax.distributed could not start ({type(e).__name__}: {str(e)[:300]})"
    if explicit:
      cli.fail(f"{reason}; check --coordinator, --num_processes and --process_id on every process.")
    cli.fail(  # e.g. SLURM_JOB_ID set by salloc, but no srun task to join
      f"{reason}. Cluster variables set: {_cluster_variables_set()}. Start each process through the cluster manager "
      "(srun, mpirun), or give --coordinator, --num_processes and --process_id; for one process, unset the cluster "
      "variables."
    )
  return jax


def _not_joined(explicit: bool, num_processes: int) -> str:
  """What a process says when the others do not all join by --init_timeout (JAX aborts it 5 s later with a C++ stack
  blaming "another task died")."""
  said = (
    f"not every process joined within --init_timeout={_INIT_TIMEOUT.value} s: one was not started, or stopped at "
    "start-up (its command line or config refused: see its own output); "
  )
  if not explicit:
    return said + (
      f"cluster variables set: {_cluster_variables_set()}; start each process through the cluster manager (srun, "
      "mpirun), for one process unset the cluster variables, or raise --init_timeout"
    )
  said += (
    f"start every process with --coordinator={_COORDINATOR.value} and --num_processes={num_processes}, each with "
    "its own --process_id, or raise --init_timeout"
  )
  if _PROCESS_ID.value:  # something answered at the address: process 0, or another program on that port
    said += " (if process 0 is up, check that nothing else answers at its address)"
  return said


def _exit(code: int, process_count: int):
  if process_count > 1:
    # jax.distributed's exit handler waits at a barrier for every process, and after an error here the
    # others may never come (they stop on their own: liveness.PeerWatchdog). Leave without it.
    flush_output()
    os._exit(code)
  sys.exit(code)


class _QuietLibraries(pylogging.Filter):
  """Drops the INFO chatter of orbax (several lines per checkpoint) and of JAX's backend search (no TPU library
  on a GPU or CPU machine); their warnings still show."""

  def filter(self, record):
    noisy = "/orbax/" in record.pathname or record.pathname.endswith("xla_bridge.py")
    return record.levelno >= pylogging.WARNING or not noisy


def _workdir_problem(workdir: str) -> str | None:
  """Why this process cannot run in ``workdir``, or None. Creating nothing: the workdir, or the folder it would be
  made in, must be a directory this process can write, and a metrics.jsonl there readable."""
  existing = cli.nearest_existing(os.path.abspath(workdir))
  if not os.path.isdir(existing):
    return f"--workdir={workdir}: {existing} is a file, not a directory; choose another path."
  if not os.access(existing, os.W_OK | os.X_OK):
    return (
      f"--workdir={workdir}: {existing} is not writable (permissions, or a read-only file system); "
      "choose another directory."
    )
  if existing != os.path.abspath(workdir):  # not made yet: nothing inside
    return None
  records = os.path.join(existing, "metrics.jsonl")
  if os.path.isfile(records):  # damaged: found now, not by the metrics writer after minutes of compiling
    from light_jax.metrics import MetricsError, read_records

    try:
      read_records(records)
    except MetricsError as e:
      return str(e)
    except OSError as e:  # another user's, or a failing disk: a resumed run reads it
      return (
        f"--workdir={workdir}: cannot read {records} ({e.strerror}); make it readable, or choose another directory."
      )
  # A run resumed there writes into these too: found unwritable only at its first save, it failed after training.
  for name in ("checkpoints", "metrics.jsonl", "step_times.jsonl", "summary.json", "tensorboard"):
    path = os.path.join(existing, name)
    if os.path.exists(path) and not os.access(path, os.W_OK | (os.X_OK if os.path.isdir(path) else 0)):
      return (
        f"--workdir={workdir}: {path} is not writable (permissions, or a read-only file system), and the run "
        "writes there; make it writable, or choose another directory."
      )
  return None


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(_QuietLibraries())
  config = _CONFIG.value
  try:  # before the devices start, which read the config's mesh fields
    config_lib.check_fields(config)
  except config_lib.ConfigError as e:
    cli.fail(f"invalid config: {e}")
  # Found before anything heavy. A process of several joins the others first, to tell them (a machine's own
  # folder, say): else they would wait for it until --init_timeout.
  workdir_problem = _workdir_problem(_WORKDIR.value)
  if workdir_problem and _num_processes() == 1:  # no other process waits for this one at a join
    cli.fail(workdir_problem)
  jax = _start_jax(config)

  from light_jax import liveness, preemption

  # From the join on a signal stops set-up with one line; the trainer arms the same guard at the first step, and
  # from then on a signal saves and stops.
  guard = preemption.PreemptionGuard()
  # In a multi-process run, a process that dies or fails makes the others stop too, with a message.
  watchdog = liveness.PeerWatchdog(
    jax.process_index(), jax.process_count(), _PEER_TIMEOUT.value, _WORKDIR.value, _STEP_TIMEOUT.value
  ).start()
  # What the other processes are told if this one fails (an exception that escapes: a signal's exit, say).
  exit_code, reason_for_peers = ExitCode.ERROR, "unexpected error (see its log)"
  try:
    with guard:
      exit_code, reason_for_peers = _run(jax, config, watchdog, guard, workdir_problem)
  except preemption.StoppedInSetup as e:
    exit_code, reason_for_peers = _stopped_in_set_up(e)
  except Exception as e:
    if jax.process_count() == 1:
      raise
    exit_code, reason_for_peers = _failed(e, jax, watchdog)
  finally:
    watchdog.close(reason_for_peers, because_of_a_peer=exit_code == ExitCode.PEER_FAILURE)
  if exit_code == ExitCode.NONFINITE_STOP:
    sys.exit(int(exit_code))  # every process stopped after the same step and save: leave through the shutdown barrier
  if exit_code or reason_for_peers:  # a reason with exit code 0: stopped in set-up, the others may wait for it
    _exit(exit_code, jax.process_count())


def _failed(e: Exception, jax, watchdog) -> tuple[int, str]:
  """A multi-process run's error in this process: (exit code, reason to give the other processes)."""
  from light_jax import liveness

  # PeerLost: a checkpoint's save or restore lost one, or another process's training or evaluation input failed.
  if liveness.lost_a_peer(e) or isinstance(e, liveness.PeerLost):
    # A collective whose peer is gone fails fast (gloo: connection reset) or hangs (the watchdog ends that).
    # A peer that failed with an error of its own said why before it exited: that is the reason to give.
    said = liveness.first_line(e) or type(e).__name__
    failure = said if isinstance(e, liveness.PeerLost) else f"a collective failed ({said})"
    reason = watchdog.peer_failure(wait_seconds=2 * watchdog.interval + 1)
    liveness.report_stop(
      jax.process_index(),
      jax.process_count(),
      reason or f"{failure}: another process probably died; see its log",
      _WORKDIR.value,
    )
    return ExitCode.PEER_FAILURE, failure
  # This process's own fault (a bug, out of memory, ...): the peers are told and stop too.
  traceback.print_exc()
  return ExitCode.ERROR, f"{type(e).__name__}: {liveness.first_line(e)} (see its log)"


def _refuse(message: str, for_peers: str | None = None) -> tuple[int, str]:
  """Bad input, reported in one line: (exit code 2, the reason the other processes are told). Not cli.fail, which
  exits: main must still tell the others."""
  print(f"error: {message}", file=sys.stderr)
  return ExitCode.BAD_INPUT, for_peers or message


def _stopped_in_set_up(e) -> tuple[int, str]:
  """A signal before the first step: (exit code 0, the reason the other processes are told)."""
  from light_jax import preemption

  preemption.drop_what_set_up_left()
  stopped = f"stopped by {e} during set-up, before the first step: nothing to save"
  print(f"{stopped}; run the same command again to start (or resume) the run.", file=sys.stderr)
  return ExitCode.OK, stopped  # the others stop on this reason (a set-up step may wait for this process)


def _run(jax, config, watchdog, guard, workdir_problem: str | None) -> tuple[int, str | None]:
  """Validates and trains. Returns (exit code, reason to give the other processes or None)."""
  if workdir_problem:  # found before the join (a multi-process run): the others stop on it
    return _refuse(workdir_problem)
  from light_jax import checkpoint as checkpoint_lib
  from light_jax import data as data_lib
  from light_jax import metrics, same_settings, schedules, train_lib

  refused = _check_run(jax, config)
  if refused:
    return refused
  guard.check_set_up()  # a signal during the checks whose raise a library swallowed
  logging.info(
    "JAX %s, process %d of %d, %d devices (%d local)",
    jax.__version__,
    jax.process_index(),
    jax.process_count(),
    jax.device_count(),
    jax.local_device_count(),
  )
  logging.info("resolved config:\n%s", config)
  try:
    summary = train_lib.train_and_evaluate(config, _WORKDIR.value, [(watchdog.step_done, 1)], preemption=guard)
  except (
    data_lib.DataError,
    schedules.ScheduleError,
    checkpoint_lib.CheckpointError,
    metrics.MetricsError,
    same_settings.SettingsDiffer,  # the dataset each machine loaded
  ) as e:
    return _refuse(str(e))
  except OSError as e:  # a full disk met by a write other than a checkpoint's (metrics.jsonl, the summary, a plot)
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
      raise
    return _refuse(
      f"writing {e.filename or f'in --workdir={_WORKDIR.value}'} failed: {e.strerror}. Training stopped: free space "
      "there, or move --workdir to a larger disk; then rerun the same command to resume from the newest checkpoint."
    )
  except train_lib.NonFiniteError as e:
    print(f"stopped: {e}", file=sys.stderr)
    return ExitCode.NONFINITE_STOP, None  # every process saw the same non-finite step and stopped after the same save
  except Exception as e:  # a step or an evaluation batch larger than a device (or this machine) holds
    ran_out = cli.out_of_memory(e)
    if ran_out is None:
      raise
    return _refuse(f"out of {ran_out}. {_ask_for_less(jax, config, on_device=not isinstance(e, MemoryError))}")
  if summary.get("stopped"):
    print(
      f"{summary['stopped']} after step {summary['steps']}: checkpoint saved in {_WORKDIR.value}/checkpoints; "
      f"run the same command again to resume.",
      file=sys.stderr,
    )
  return ExitCode.OK, None


def _ask_for_less(jax, config, on_device: bool) -> str:
  """What asks for less memory, after a run ran out of a device's or this machine's."""
  rerun = (
    "the run resumes from its newest checkpoint, if any. A smaller global_batch_size is another run (another "
    "--workdir)."
  )
  if not on_device:  # the host's: the input pipeline's caches, workers and batches
    return (
      "Ask for less, then rerun: --config.data.cache=disk instead of memory, fewer --config.data.num_workers, a "
      f"smaller --config.data.host_prefetch, or a smaller --config.data.eval_batch_size (now "
      f"{config.data.eval_batch_size:,}); {rerun}"
    )
  # The CPU runs micro-batches unrolled (train_step.accumulate_gradients), all slices in memory at once.
  slices = "" if jax.devices()[0].platform == "cpu" else (
    "--config.micro_batches=N runs each device's batch in N slices, one after the other (the same steps, BatchNorm "
    "over each slice), or "
  )  # fmt: skip
  return (
    f"Training asks {config.global_batch_size:,} images over {jax.device_count()} device(s) a step (a resolution "
    f"phase may set another batch), evaluation data.eval_batch_size={config.data.eval_batch_size:,}. Ask for "
    f"less, then rerun: {slices}a smaller --config.data.eval_batch_size; {rerun}"
  )


def _check_run(jax, config) -> tuple[int, str] | None:
  """The checks before training, in the order that names a cause: _refuse's (exit code, reason), or None."""
  from light_jax import checkpoint as checkpoint_lib
  from light_jax import same_settings

  # Before validate(): with other settings, it may pass on one process and fail on another, naming not the cause.
  try:
    same_settings.check(config, _NUM_PROCESSES.value or jax.process_count(), _INIT_TIMEOUT.value)
  except same_settings.SettingsDiffer as e:
    return _refuse(str(e))
  except same_settings.LateProcess as e:  # alive (the watchdog would have said otherwise), but not coming
    print(f"error: {e}", file=sys.stderr)
    return ExitCode.PEER_FAILURE, str(e)
  try:
    config_lib.validate(config, jax.device_count(), jax.process_count())
  except config_lib.ConfigError as e:
    return _refuse(f"invalid config: {e}")
  try:  # made once the config is valid; it can fail where _workdir_problem's access test passed (/proc, /sys)
    os.makedirs(_WORKDIR.value, exist_ok=True)
  except OSError as e:
    return _refuse(
      f"--workdir={_WORKDIR.value}: cannot create it ({e.strerror}); choose another directory.",
      f"cannot create the workdir: {e.strerror}",
    )
  try:
    if jax.process_count() > 1:
      checkpoint_lib.check_shared_directory(_WORKDIR.value)
    if jax.process_index() == 0:  # one lock per run: the other processes share process 0's workdir
      checkpoint_lib.lock_workdir(_WORKDIR.value)
  except checkpoint_lib.CheckpointError as e:
    return _refuse(str(e))
  return None


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_CONFIG))
