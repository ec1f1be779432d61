"""Preemption: SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0.

Before the first step (set-up: loading and caching the data, compiling, tuning the input, which can take hours
with a cache to build) there is nothing new to save: a signal then ends set-up at once (``StoppedInSetup``). A
second signal exits at once. In a multi-process run ``requested`` is a collective (an all-gather of
the flag), so every process must call it at the same steps; the trainer does so every
``log_every_steps`` steps, and all processes then stop after the same step.

A stop's raise in set-up lands wherever the main thread is, inside libraries too: what it wraps or cuts short is
handled here as well (``error_chain``, the unraisable reports it leaves).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

from light_jax import stderr_redirect
from light_jax.exit_codes import flush_output


class StoppedInSetup(BaseException):
  """A stop signal came before the guard was armed (``PreemptionGuard.arm``): in set-up, with nothing to save.
  A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` on its way (a restore's fallback to
  an older checkpoint, say) takes it for an error."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class PreemptionGuard:
  """Installs the signal handlers on creation (main thread only); ``uninstall`` restores the old ones.

  Also a context manager that uninstalls on exit. train.py installs one once the processes have joined and hands
  it to the trainer, which otherwise installs its own before set-up: without one, a SIGTERM ends the process
  without a word and a Ctrl-C is a traceback. Until ``arm`` (just
  before the first step) a signal raises ``StoppedInSetup``; from then on it is noted, and the trainer saves and
  stops after the current step. It also keeps the reports of a raise Python could not deliver off stderr (a
  process-wide ``sys.unraisablehook`` filter, left installed).
  """

  def __init__(self):
    self.signal = None
    self.armed = False
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      _drop_swallowed_stops()
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self.signal is not None:
      flush_output()
      os._exit(128 + signum)  # second signal: no save, no cleanup
    self.signal = signum
    if not self.armed:
      logging.warning("received %s during set-up: stopping now (nothing to save yet)", signal.Signals(signum).name)
      raise StoppedInSetup(signum)
    logging.warning(
      "received %s: finishing the current step, saving a checkpoint, then exiting (send it again to exit at once)",
      signal.Signals(signum).name,
    )

  def check_set_up(self) -> None:
    """Raises ``StoppedInSetup`` for a signal in set-up whose raise a library swallowed (asyncio logs and drops an
    exception raised in its callbacks: orbax's restore runs some). Called between set-up's stages."""
    if self.signal is not None and not self.armed:
      raise StoppedInSetup(self.signal)

  def arm(self) -> None:
    """From the first step on, a signal saves and stops after the current step."""
    self.check_set_up()
    self.armed = True

  def requested(self) -> bool:
    """Whether any process received a signal (a collective when there are several processes)."""
    if jax.process_count() == 1:
      return self.signal is not None
    return bool(np.any(multihost_utils.process_allgather(np.array(self.signal is not None))))

  def uninstall(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def __enter__(self) -> PreemptionGuard:
    return self

  def __exit__(self, exc_type, error, traceback) -> None:
    self.uninstall()
    stop = next((e for e in error_chain(error) if isinstance(e, StoppedInSetup)), None)
    if stop is not None and stop is not error:
      # The raise landed inside a library, which made an error of its own of it (numpy's C code: "SystemError:
      # ... returned a result with an exception set"; orbax: an Exception wrapping it): a stop, not a failure.
      raise StoppedInSetup(stop.signum) from error


def error_chain(error: BaseException | None):
  """``error``, then what it wraps (raised from, or while handling), each once."""
  seen = set()
  while error is not None and id(error) not in seen:
    yield error
    seen.add(id(error))
    error = error.__cause__ or error.__context__


def _wraps_a_stop(error: BaseException | None) -> bool:
  """Whether ``error`` is a stop in set-up, or wraps one."""
  return any(isinstance(e, StoppedInSetup) for e in error_chain(error))


# What a stop in set-up may cut short: objects of the libraries set-up runs in.
_SET_UP_LIBRARIES = frozenset({"orbax", "jax", "jaxlib", "grain", "flax", "optax", "asyncio", "concurrent"})


def _drop_swallowed_stops() -> None:
  """A stop's raise that lands in a callback Python cannot raise from (JAX's garbage-collection callback) is
  printed with a traceback ("Exception ignored in: ...") and set-up goes on; the guard has noted the signal, and
  set-up stops at its next check (``check_set_up``). That print is left out. Installed again by a guard that finds
  the hook replaced (pytest puts back its own after each test)."""
  stderr_redirect.drop_unraisables(lambda unraisable: _wraps_a_stop(unraisable.exc_value), marker="drops_stops")


def drop_what_set_up_left() -> None:
  """For the rest of the process, which is ending after a stop in set-up: what the signal's raise cut short
  complains as it is freed, after the run's last line, through sys.unraisablehook (an orbax object whose
  ``__init__`` it interrupted: "Exception ignored in: ... __del__") or as a warning ("coroutine ... was never
  awaited"). Those are dropped when they come from the libraries set-up runs in: nothing of them is saved or used
  again. Anything else is still reported."""

  def cut_short(unraisable) -> bool:
    owner = getattr(unraisable.object, "__module__", None) or type(unraisable.object).__module__
    return _wraps_a_stop(unraisable.exc_value) or str(owner).split(".")[0] in _SET_UP_LIBRARIES

  stderr_redirect.drop_unraisables(cut_short)
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
