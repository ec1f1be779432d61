"""Child processes that end with the process that started them (Linux)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:
  """In a child process: the kernel sends it ``signum`` when the process that started it ends, so no worker
  outlives a parent killed with SIGKILL (out of memory, a second signal, a peer's failure ending the run with
  os._exit). Linux only (prctl); elsewhere nothing changes. For ``ProcessPoolExecutor(initializer=...)`` and
  ``subprocess.Popen(preexec_fn=...)``."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
  except (OSError, AttributeError):
    return
  if os.getppid() == 1:  # the parent ended before the prctl took effect
    os._exit(1)
