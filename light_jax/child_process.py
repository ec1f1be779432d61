"""Child processes that end with the process that started them (Linux)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
try:  # looked up here, in the parent: a child forked from a process with threads should do little before exec
  _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
  _prctl = None


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
  """In a child process of ``parent`` (its pid, taken in the parent: ``functools.partial(die_with_parent,
  os.getpid())``): the kernel sends it ``signum`` when the thread that started it ends (the main thread, for the
  callers here: so, the process), so no worker outlives a parent killed with SIGKILL (out of memory, a second
  signal, a peer's failure ending the run with os._exit). Linux only (prctl); elsewhere nothing changes. For
  ``ProcessPoolExecutor(initializer=...)`` and ``subprocess.Popen(preexec_fn=...)``; the setting survives an exec
  (``ip netns exec``'s too)."""
  if _prctl is None:
    return
  _prctl(_PR_SET_PDEATHSIG, signum)
  # The parent ended before the prctl took effect: its orphan was adopted, by init or by a subreaper (a container's
  # init, systemd --user), whose pid is not 1.
  if os.getppid() != parent:
    os._exit(1)


def bound_to_this_process(signum: int = signal.SIGKILL) -> Callable[[], None]:
  """``die_with_parent`` with this process as the parent: for a child's ``preexec_fn`` or a pool's ``initializer``."""
  return functools.partial(die_with_parent, os.getpid(), signum)
