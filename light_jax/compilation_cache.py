"""JAX's persistent compilation cache for train.py: a run started again (a resume after a kill or a preemption, a
retried trial of a study, the same command twice) reads its compiled programs from disk instead of compiling them.
A program is the same only with the same config: each new hyper-parameter set (a study's next trial) compiles.

JAX keeps the cache off unless a directory is set. train.py sets ``--compilation_cache_dir``, else JAX's own
``JAX_COMPILATION_CACHE_DIR``, else ``~/.cache/light_jax/compilation_cache/HOST``. The host is in the default path
because an XLA:CPU entry is machine code for the CPU that compiled it: machines that share a home folder keep
apart, and none runs code built for another CPU. JAX writes entries from process 0 only (a run of several machines
gains on all of them only from a folder they share at the same path, given by hand: the path is part of each
entry's key), and only for programs that took at least ``jax_persistent_cache_min_compile_time_secs`` (1 s) to
compile. A hit returns the executable that was compiled, so a run's numbers do not depend on it.

The cache is trusted code: a folder that another user owns or can write to is refused. It has no size cap (0.2-0.3
MB a program of the Fashion-MNIST model at width 8 on CPU): delete the folder to reclaim its space. An entry cut
short (a process killed while writing it) is not written again: JAX warns at each start that it cannot read it,
and compiles; delete the folder then too. Measured on 2 CPU cores (README, "Checkpoints, resume and faults"): one
epoch of 4,096 images with the default config took 26.6-28.3 s with an empty cache, 14.9-16.9 s with a filled one.
"""

from __future__ import annotations

import os
import socket
import stat
import threading

import jax
from absl import logging

_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = 0
_hits_lock = threading.Lock()


def default_directory() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "light_jax", "compilation_cache", socket.gethostname())


def problem(directory: str) -> str | None:
  """Why ``directory`` cannot hold the cache (made here, for this user only, if missing), or None. An entry is code
  that runs: a folder another user can write to would let them run theirs in this process."""
  try:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.stat(directory)
  except OSError as e:
    return f"{directory} cannot be made ({e.strerror})"
  if not os.access(directory, os.W_OK | os.X_OK):
    return f"{directory} is not writable"
  if info.st_uid != os.geteuid():
    return f"{directory} belongs to another user (uid {info.st_uid}), who could put code there that this run executes"
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    return (
      f"{directory} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}), who could put code there that "
      "this run executes"
    )
  return None


def directory_for(flag_value: str | None) -> str | None:
  """The cache's directory for ``--compilation_cache_dir`` (None: not given; '': off), or None for off."""
  directory = (os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_directory()) if flag_value is None else flag_value
  return os.path.abspath(os.path.expanduser(directory)) if directory else None


def enable(flag_value: str | None) -> str | None:
  """Turns the cache on (``directory_for``); returns its directory, or None where it stays off. Call once per
  process, before its first compile (JAX sets its cache up then). A directory that cannot be used is a warning, not
  an error: the run compiles as it would without a cache."""
  # JAX_ENABLE_COMPILATION_CACHE=false keeps it off whatever the folder.
  directory = directory_for(flag_value) if jax.config.jax_enable_compilation_cache else None
  reason = problem(directory) if directory else None
  if reason:
    logging.warning(
      "compilation cache off: %s; each start compiles again. Give --compilation_cache_dir=DIR (a folder only you "
      "can write), or --compilation_cache_dir= to turn it off without this warning.",
      reason,
    )
  elif not directory:
    logging.info("compilation cache: off")
  if reason or not directory:
    jax.config.update("jax_compilation_cache_dir", None)  # JAX_COMPILATION_CACHE_DIR would still point there
    return None
  # No size cap: JAX's capped cache stops writing for good once one entry lacks its access-time file (an entry
  # written uncapped, or a process killed between the two writes). The folder grows with each new program.
  jax.config.update("jax_compilation_cache_dir", directory)
  logging.info("compilation cache: %s", directory)
  return directory


def _count_hit(event: str, **_) -> None:
  global _hits
  if event == _HIT_EVENT:
    with _hits_lock:
      _hits += 1


# Counted from import on, whoever turned the cache on (train.py's enable, or JAX_COMPILATION_CACHE_DIR alone).
jax.monitoring.register_event_listener(_count_hit)


def hits() -> int:
  """How many programs this process has read from the cache so far."""
  return _hits
