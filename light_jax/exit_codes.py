"""Exit codes of ``train.py``, for scripts and cluster managers that restart runs, and leaving at once with one."""

import atexit
import contextlib
import enum
import os
import signal
import sys
import threading


class ExitCode(enum.IntEnum):
  OK = 0  # finished, or preempted after saving a checkpoint (rerun to resume)
  ERROR = 1  # an unexpected error in this process (its traceback is printed)
  BAD_INPUT = 2  # invalid config, missing or corrupt data, unusable checkpoint: the message says what to fix
  NONFINITE_STOP = 3  # non-finite loss with train.on_nonfinite=stop: checkpoint saved, every process stopped
  PEER_FAILURE = 4  # another process of a multi-process run died, hung, failed, or never joined


def exit_now(line: str, code: int, exit_handlers: bool = False):
  """Prints ``line`` on stderr and exits with ``code`` at once, without Python's exit handlers (jax.distributed's
  waits at a barrier for every process), or with them (``exit_handlers``: a program of one process, whose handlers
  remove its temporary folders and the output folders it made but wrote nothing in, light_jax/cli.py)."""
  print(line, file=sys.stderr)
  if exit_handlers:
    # A second Ctrl-C meanwhile would run them again from inside one (Popen.wait's lock, held: a hang).
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    atexit._run_exitfuncs()  # what a normal exit runs; os._exit below skips the interpreter's shutdown after them
  flush_output()
  os._exit(code)


def flush_output(timeout: float = 1.0) -> None:
  """Flushes stdout and stderr before an ``os._exit``, which drops what they buffer (the epochs' result lines, when
  stdout is a file), waiting at most ``timeout``: from another thread, a main thread blocked writing to a full pipe
  holds the buffer's lock, and a signal handler may have interrupted a write (a reentrant flush raises)."""

  def flush():
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()

  flusher = threading.Thread(target=flush, daemon=True, name="flush-before-exit")
  flusher.start()
  flusher.join(timeout)


@contextlib.contextmanager
def signals_exit_at_once(doing: str, exit_handlers: bool = False):
  """While inside (main thread only; elsewhere it does nothing), a Ctrl-C or SIGTERM exits at once with
  128 + its number and the line "stopped by SIGNAME while ``doing``" (``exit_now``'s ``exit_handlers``). The
  benchmarks measure inside it: a Ctrl-C raised as a KeyboardInterrupt into JAX mid-computation printed a
  traceback, and the interpreter's shutdown then crashed (a segfault, exit 139)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def leave(signum, frame):
    del frame
    exit_now(f"stopped by {signal.Signals(signum).name} while {doing}", 128 + signum, exit_handlers)

  previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
