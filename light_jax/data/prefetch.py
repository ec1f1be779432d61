"""Overlap of input with compute: batches are placed on the mesh by a background thread, ahead of use."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator

import jax
from absl import logging

from light_jax import liveness
from light_jax.data.source import DataError

_END = object()
_NO_WAIT = (0.0, 0.0)  # (from, to) in time.perf_counter(): no wait for other processes


class InputFailed(Exception):
  """Reading a batch failed in some process, and every process raises this alike, at the same batch, having agreed
  on it (so that they can save the steps done together). ``error``: this process's own error, or, where another
  process's read failed, a ``liveness.PeerLost`` that names it."""

  def __init__(self, error: Exception):
    super().__init__(str(error))
    self.error = error


class DevicePrefetcher:
  """Iterates over process-local host batches and yields global ``jax.Array`` batches on the mesh.

  A thread keeps up to ``size`` batches already transferred, so the host prepares and copies batch t+1
  while the devices run step t. ``wait_seconds`` accumulates the time the consumer spent blocked on
  this process's input: the trainer reports it as the input-wait fraction of the step time.

  ``agreed``, in a run of several processes: the processes agree on each batch before it is queued, so that a batch
  that one process cannot read or place ends every process's batches at the same step (``InputFailed``). Else the
  others would wait in that step's collectives for the failed one, and nothing could be saved. The agreement is made
  by this thread, ahead of the steps, through the coordination service's key-value store (host to host, not through
  the devices' queue of work). A process whose host runs ahead then waits for the others' votes where it waited in the
  step's collectives before: that wait is not this process's input, and ``wait_seconds`` leaves it out (on 2 x 4
  simulated devices it was a tenth to a half of the step time).
  """

  def __init__(
    self, host_batches: Iterator[dict], sharding: jax.sharding.Sharding, size: int = 2, agreed: bool = False
  ):
    self._queue: queue.Queue = queue.Queue(maxsize=max(size, 1))
    self._sharding = sharding
    self.wait_seconds = 0.0
    self._stop = threading.Event()
    self._votes = _BatchVotes(self._stop) if agreed and jax.process_count() > 1 else None
    self._thread = threading.Thread(target=self._fill, args=(host_batches,), daemon=True)
    self._thread.start()

  def _fill(self, host_batches):
    try:
      host_batches = iter(host_batches)
      for index in itertools.count():
        if self._stop.is_set():  # no transfer begun after close(): one cut at the interpreter's exit aborts it
          return
        placed, error = None, None
        try:
          placed = {k: jax.make_array_from_process_local_data(self._sharding, v) for k, v in next(host_batches).items()}
        except StopIteration:
          pass
        except Exception as e:  # a damaged record, say, or no memory left to place the batch
          if not self._votes:
            raise
          error = e
        waited = self._votes.agree(index, placed is not None, error) if self._votes else _NO_WAIT
        if waited is None:
          return  # closed meanwhile
        if placed is None:
          break
        if not self._put(placed, *waited):
          return
      self._put(_END)
    except BaseException as e:  # handed to the consumer, which re-raises it with its traceback
      self._put(e)

  def _put(self, item, peers_from: float = 0.0, peers_to: float = 0.0) -> bool:
    """Queues ``item``, with when its thread waited for the other processes' votes on it, once there is room; False
    where the consumer closed this first."""
    while not self._stop.is_set():
      try:
        self._queue.put((item, peers_from, peers_to), timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    start = time.perf_counter()
    item, peers_from, peers_to = self._queue.get()
    end = time.perf_counter()
    self.wait_seconds += end - start - max(0.0, min(end, peers_to) - max(start, peers_from))
    if item is _END:
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self, timeout: float = 10.0):
    """Stops the thread and waits for it to leave, up to ``timeout`` seconds (it finishes the batch it is making).
    A daemon thread still inside a transfer when the interpreter exits is cut in C++ code, which aborts the process:
    a run that had saved and stopped on a SIGTERM then exited 134 ("FATAL: exception not rethrown")."""
    self._stop.set()
    self._thread.join(timeout)
    if self._thread.is_alive():
      logging.warning(
        "the input thread did not stop within %g s of the run's end (a host batch still on its way)", timeout
      )


class _BatchVotes:
  """Each process's word on each batch ("read", "failed", "ended"), through the coordination service's key-value
  store (jax.distributed's, in process 0): every process publishes its vote, process 0 reads them all and publishes
  the outcome, which the others read. Two calls per batch in a process, N - 1 more in process 0 (about 0.5 ms each
  on one machine). A process whose vote is late is waited for: it is behind by the batches its own prefetcher holds
  at most, since the steps' collectives keep the processes together; one that died is found by the peer watchdog
  (light_jax/liveness.py), which ends this process, as it does when the store itself is gone."""

  # Each process makes its agreed prefetchers in the same order (one per run; a run is one process's life in
  # train.py): the same names in every process.
  _prefetchers = itertools.count()

  def __init__(self, stop: threading.Event):
    self._prefix = f"light_jax/input/{next(self._prefetchers)}/"
    self._stop = stop
    self._index, self._count = jax.process_index(), jax.process_count()

  def agree(self, index: int, read: bool, error: Exception | None) -> tuple[float, float] | None:
    """Votes on batch ``index`` (``read``: placed; ``error``: its read or placement failed; neither: the batches
    ended) and returns when it waited for the other processes, (from, to) in time.perf_counter(); None where this
    prefetcher was closed meanwhile. Raises ``InputFailed`` in every process alike where one process's batch failed:
    its own error in that process, a ``liveness.PeerLost`` naming it in the others."""
    vote = "read" if read else "failed" if error else "ended"
    start = time.perf_counter()
    everyone = self._exchange(index, vote)
    if everyone is None:
      return None
    failed = [process for process, said in enumerate(everyone) if said == "failed"]
    if failed:
      lost = liveness.PeerLost(f"process {failed[0]} could not read its training batches (see its log)")
      raise InputFailed(error or lost) from error
    if "ended" in everyone and set(everyone) != {"ended"}:  # each reads its part of the same steps: cannot happen
      ended = [process for process, said in enumerate(everyone) if said == "ended"]
      raise InputFailed(DataError(f"processes {ended} ran out of training batches before the others"))
    return start, time.perf_counter()

  def _exchange(self, index: int, vote: str) -> list[str] | None:
    """Every process's vote on batch ``index``, in process order; None if the prefetcher is closed first."""
    batch = f"{self._prefix}{index}"
    if not self._call(lambda store: store.key_value_set(f"{batch}/{self._index}", vote, allow_overwrite=True)):
      return None
    if self._index:
      everyone = self._wait_for(f"{batch}/outcome")
      return None if everyone is None else everyone.split(",")
    everyone = [vote]
    for process in range(1, self._count):
      said = self._wait_for(f"{batch}/{process}")
      if said is None:
        return None
      everyone.append(said)
    if not self._call(lambda store: store.key_value_set(f"{batch}/outcome", ",".join(everyone), allow_overwrite=True)):
      return None
    if index:  # every process has voted on this batch, so each has read the outcome of the one before
      self._call(lambda store: store.key_value_delete(f"{self._prefix}{index - 1}"), needed=False)
    return everyone

  def _wait_for(self, key: str) -> str | None:
    """The value at ``key`` once it is set (the store answers at once then), or None if the prefetcher is closed
    first (checked every second)."""
    got = []
    while not got:
      if not self._call(lambda store: got.append(store.blocking_key_value_get(key, 1000)), waits=True):
        return None
    return got[0]

  def _call(self, call, waits: bool = False, needed: bool = True) -> bool:
    """``call(store)``, again while the store does not answer (a moment's outage; the watchdog ends this process if
    it lasts; a set made again overwrites), until it returns: True, or False if the prefetcher is closed first.
    ``waits``: a blocking get, whose timeout is not an error; ``needed``: False for a clean-up, given up at its
    first error."""
    said = False
    while not self._stop.is_set():
      try:
        call(liveness.client())
        return True
      except jax.errors.JaxRuntimeError as e:
        if waits and str(e).startswith("DEADLINE_EXCEEDED"):
          return True
        if not needed or not liveness.is_connection_error(e):
          if needed:
            raise
          logging.warning("removing the training input's votes from the key-value store failed: %s", e)
          return True
        if not said:
          logging.warning("the key-value store did not answer a training batch's vote (%s); trying again", e)
          said = True
        self._stop.wait(0.5)
    return False
