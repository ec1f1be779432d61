"""Stop every process of a multi-process run, with a clear message, when one of them dies or fails.

Without this a survivor blocks in its next collective until JAX's own heartbeat check kills it with a C++
abort (``heartbeat_timeout_seconds``, 100 s by default) or, for some failures, forever. ``PeerWatchdog``
is a background thread in every process that publishes a counter in the JAX coordination service's
key-value store every ``interval`` seconds and reads everyone else's in one call:

* a peer whose counter has not moved for ``peer_timeout`` seconds is taken for dead (killed, out of
  memory, machine gone);
* a peer that failed with a Python error (bad data on its machine, say) publishes the reason, so the
  others stop within an interval and a second and say why (one that meets its own error in that second
  reports its own);
* losing the key-value store itself, or no answer from it for ``peer_timeout`` seconds, means the coordinator
  (process 0) is gone or hangs (stopped, cut off): the store's calls have no deadline, so they are made from a
  thread of their own, which the watchdog waits for in bounded time;
* every process alive but no training step finished here for ``step_timeout`` seconds means a collective
  is stuck (gloo has been seen to deadlock with all processes alive, each waiting in an all-reduce):
  the loop calls ``step_done`` after each step, and the clock starts at the first one (compilation
  before it takes as long as it takes).

In each case the watchdog prints one line naming the process and the cause and ends this process with
``ExitCode.PEER_FAILURE``; the main thread may be stuck inside a collective, so only ``os._exit`` is sure to
work. Checkpoints already committed stay valid: rerunning the same command on every machine resumes.
JAX's own heartbeat stays on as the backstop (train.py sets it to four times ``peer_timeout``: JAX aborts a process
between half its timeout and its timeout after its coordinator stopped answering, so at twice the watchdog
sometimes lost the race).
"""

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from light_jax import stderr_redirect
from light_jax.exit_codes import ExitCode, flush_output, signals_exit_at_once

_PREFIX = "light_jax/liveness/"


def client():
  """The distributed runtime client jax.distributed.initialize created (its key-value store); orbax reaches it
  the same way."""
  from jax._src import distributed

  return distributed.global_state.client


class PeerWatchdog:
  """Publishes this process's liveness and ends it when a peer stops publishing theirs."""

  def __init__(
    self, process_index: int, process_count: int, peer_timeout: float, workdir: str, step_timeout: float = 0.0
  ):
    self.process_index = process_index
    self.process_count = process_count
    self.peer_timeout = peer_timeout
    self.step_timeout = step_timeout  # 0: off
    self._last_step: float | None = None  # monotonic time of the last finished step
    self.interval = min(2.0, peer_timeout / 5)
    # After reading a peer's failure: how long this process's own thread has to report an error of its own first.
    self.grace = min(self.interval, 1.0)
    self._peer_failure_read: str | None = None
    self.workdir = workdir
    self._stop = threading.Event()
    self._thread = None
    self._exchange: _StoreCall | None = None  # the watchdog's round with the key-value store in flight, if any

  def start(self) -> "PeerWatchdog":
    if self.process_count > 1:
      self._thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)
      self._thread.start()
    return self

  def step_done(self, info=None) -> None:
    """Called by the training loop after each step (a hook): the step-progress clock restarts."""
    del info
    self._last_step = time.monotonic()

  def close(self, failure: str | None = None, because_of_a_peer: bool = False) -> None:
    """Stops watching. ``failure`` (a one-line reason) tells the peers to stop too, instead of waiting;
    ``because_of_a_peer``: this process stopped on another's fault (a collective that lost one), which the peers
    name only where no process published a failure of its own (with 3 processes, one killed, a survivor was named)."""
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    if failure is None and self._peer_failure_read:  # a run that ended well as a peer failed: the peer's news
      self._fail(self._peer_failure_read)
    deadline = time.monotonic() + self.peer_timeout
    if self._exchange is not None:  # its counter, written late, would replace the marker below
      self._exchange.done.wait(self.peer_timeout)
    marker = "lost: " if because_of_a_peer else "failed: "
    key, value = self._key(self.process_index), marker + failure if failure else "done"
    told = _StoreCall(lambda store: store.key_value_set(key, value, allow_overwrite=True))
    if not told.done.wait(max(deadline - time.monotonic(), 0.0)) or told.error is not None:
      return  # the coordinator is gone, or answers nothing: nothing left to tell
    if failure and self.process_index == 0:
      # The key-value store lives in this process: keep it up until the peers have read the reason and left (a
      # tick, then the grace; JAX ends the others with exit 134 once this process is gone).
      # A signal meanwhile exits at once, as a second one does in a run (it was a KeyboardInterrupt traceback).
      with signals_exit_at_once("keeping this process's reason up for the others; they stop on their own."):
        time.sleep(2 * self.interval + self.grace + 1)

  def peer_failure(self, wait_seconds: float) -> str | None:
    """The reason a peer published for its failure ("process i failed: ..."), waiting up to ``wait_seconds`` for
    one, or None. For a collective that failed on a closed connection: a peer that failed with a Python error
    tells why before it exits, which closes its connections."""
    deadline = time.monotonic() + wait_seconds
    while True:
      read = _StoreCall(lambda store: dict(store.key_value_dir_get(_PREFIX)))
      if not read.done.wait(max(deadline - time.monotonic(), self.interval)) or read.error is not None:
        return None  # the coordination service is gone or silent (process 0): no reason to read
      failure = self._failed_peer(read.result)
      if failure or time.monotonic() >= deadline:
        return failure
      time.sleep(min(0.2, self.interval))

  def _failed_peer(self, published: dict[str, str]) -> str | None:
    """ "process i failed: REASON" for the first peer that published a failure of its own in ``published``, else
    "process i stopped because of another process: REASON" for the first that stopped on another's, or None."""
    peers = [(i, published.get(self._key(i), "")) for i in range(self.process_count) if i != self.process_index]
    for marker, says in (("failed: ", "failed"), ("lost: ", "stopped because of another process")):
      for index, value in peers:
        if value.startswith(marker):
          return f"process {index} {says}: {value[len(marker) :]}"
    return None

  def _key(self, index: int) -> str:
    return f"{_PREFIX}{index}"

  def _run(self) -> None:
    counter = 0
    last_seen = {}  # process index -> (value, time it last changed)
    last_contact = time.monotonic()
    while not self._stop.wait(self.interval):
      now = time.monotonic()
      last_step = self._last_step
      if self.step_timeout and last_step is not None and now - last_step > self.step_timeout:
        # Not "every process is alive": a peer that died less than peer_timeout ago has not been noticed yet.
        self._fail(
          f"no training step has finished for {now - last_step:.0f} s (step_timeout {self.step_timeout:g} s): a "
          "collective is probably stuck (gloo has been seen to deadlock so), unless a process died in the last "
          f"{self.peer_timeout:g} s (peer_timeout); see every process's log"
        )
        return
      if self._exchange is None:  # else the last round still waits for its answer
        counter += 1
        self._exchange = _StoreCall(functools.partial(_exchange, self._key(self.process_index), str(counter)))
      exchange = self._exchange
      answered = exchange.done.wait(self.interval)
      if answered:
        self._exchange = None  # read now, so the next tick starts another
      if not answered or exchange.error is not None:
        # The service lives in process 0; one failed or slow call may be a transient.
        silent = time.monotonic() - last_contact
        if silent > self.peer_timeout:
          why = type(exchange.error).__name__ if answered else "no answer"
          self._fail(
            f"lost contact with the coordination service in process 0 for {silent:.0f} s ({why}): process 0 "
            "probably died or hangs (stopped, or cut off from this machine); see its log"
          )
          return
        continue
      published, last_contact = exchange.result, exchange.finished
      failure = self._failed_peer(published)
      if failure:
        # A check every process makes alike (a workdir that is not shared) fails here in the same moment: this
        # process's own error (its exit code, its line) is the one to report. Its main thread closes the watchdog
        # within the grace then; a main thread stuck in a collective does not, and the peer's reason ends it.
        self._peer_failure_read = failure
        if not self._stop.wait(self.grace):
          self._fail(failure)
        return
      for index in range(self.process_count):
        if index == self.process_index:
          continue
        value = published.get(self._key(index), "")
        if value == "done":
          continue
        previous, since = last_seen.get(index, (None, now))
        if value != previous:
          since = now
        last_seen[index] = (value, since)
        if now - since > self.peer_timeout:
          self._fail(
            f"process {index} has given no sign of life for {now - since:.0f} s "
            f"(peer_timeout {self.peer_timeout:g} s): it probably died; see its log"
          )
          return

  def _fail(self, reason: str) -> None:
    try:
      report_stop(self.process_index, self.process_count, reason, self.workdir)
    finally:  # a report that fails must not keep a stuck process alive
      flush_output()
      os._exit(ExitCode.PEER_FAILURE)


def heartbeat_timeout(peer_timeout: float) -> int:
  """JAX's heartbeat timeout, the watchdog's backstop: four times ``peer_timeout``. JAX takes it in milliseconds as
  a 32-bit int: at most 2,000,000 s (cli.MAX_SECONDS is the longest ``peer_timeout``, 1,000,000 s)."""
  return max(int(min(4 * peer_timeout, 2e6)), 1)


def _exchange(key: str, value: str, store) -> dict[str, str]:
  """The watchdog's round with the key-value store: publish this process's counter, read everyone's."""
  store.key_value_set(key, value, allow_overwrite=True)
  return dict(store.key_value_dir_get(_PREFIX))


class _StoreCall:
  """``call(store)`` on the key-value store, in a daemon thread: the store's calls have no deadline (a stopped
  process 0 answers none), and the watchdog, or a process that ends, must not wait in them for ever. ``done`` is
  set when it returns (``result``, at ``finished``) or raises (``error``)."""

  def __init__(self, call: Callable[[Any], Any]):
    self.done = threading.Event()
    self.result: Any = None
    self.error: Exception | None = None
    self.finished: float | None = None  # time.monotonic() when it returned
    threading.Thread(target=self._run, args=(call,), name="peer-watchdog-store", daemon=True).start()

  def _run(self, call: Callable[[Any], Any]) -> None:
    try:
      self.result = call(client())
    except Exception as e:
      self.error = e
    finally:
      self.finished = time.monotonic()
      self.done.set()


_CONNECTION_MARKERS = (
  "UNAVAILABLE",
  "Connection reset",
  "Connection refused",
  "connection closed",
  "Gloo",
  "NCCL",
  "Socket closed",
  "DEADLINE_EXCEEDED",
  "heartbeat",
)


class PeerLost(RuntimeError):
  """A collective of a multi-process step, save or restore failed because another process is gone, or another
  process's input failed: not this process's fault, nor damage or a file-system error (train.py stops with the
  peer's reason, exit 4)."""


def from_every_process(values: list[int]):
  """``values`` of every process, a (process count, len(values)) int64 array (a collective where there are several
  processes: every process calls it alike, with as many values)."""
  import jax
  import numpy as np

  if jax.process_count() == 1:
    return np.array([values], np.int64)
  from jax.experimental import multihost_utils

  gathered = multihost_utils.process_allgather(np.array(values, np.int64))
  return np.asarray(gathered).reshape(jax.process_count(), len(values))


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first line of ``error``'s message, at most ``limit`` characters ("" for none): what one line reports."""
  return (str(error).splitlines() or [""])[0][:limit]


def is_connection_error(error: BaseException) -> bool:
  """Whether a runtime error looks like a lost peer (as opposed to, e.g., running out of memory here)."""
  return any(marker.lower() in str(error).lower() for marker in _CONNECTION_MARKERS)


def lost_a_peer(error: BaseException) -> bool:
  """Whether a collective of several processes failed for want of a peer: a JaxRuntimeError that says so (the
  steps' collectives, the gathers orbax runs through JAX), in ``error`` or what it wraps. Not a file-system or
  TensorStore error, whose text (a path with "gloo" in it, "Resource temporarily unavailable") may hold the same
  words."""
  import jax

  from light_jax.preemption import error_chain

  return jax.process_count() > 1 and any(
    isinstance(cause, jax.errors.JaxRuntimeError) and is_connection_error(cause) for cause in error_chain(error)
  )


def report_stop(process_index: int, process_count: int, reason: str, workdir: str) -> None:
  """One line on stderr (and in the log): which process stops, why, and how to resume."""
  message = (
    f"error: stopping process {process_index} of {process_count}: {reason.rstrip('.')}. Committed checkpoints in "
    f"{workdir}/checkpoints are intact: rerun the same command on every machine to resume from the newest."
  )
  logging.error("%s", message)
  # Past a failed restore's capture of stderr too: this process may end at once (os._exit), the capture unread.
  stderr_redirect.write(f"\n{message}\n")
