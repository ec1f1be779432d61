"""Overlap of input with compute: batches are placed on the mesh by a background thread, ahead of use."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import jax
from absl import logging

_END = object()


class DevicePrefetcher:
  """Iterates over process-local host batches and yields global ``jax.Array`` batches on the mesh.

  A thread keeps up to ``size`` batches already transferred, so the host prepares and copies batch t+1
  while the devices run step t. ``wait_seconds`` accumulates the time the consumer spent blocked on
  input: the trainer reports it as the input-wait fraction of the step time.
  """

  def __init__(self, host_batches: Iterator[dict], sharding: jax.sharding.Sharding, size: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=max(size, 1))
    self._sharding = sharding
    self.wait_seconds = 0.0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._fill, args=(host_batches,), daemon=True)
    self._thread.start()

  def _fill(self, host_batches):
    try:
      for batch in host_batches:
        if self._stop.is_set() or not self._put(
          {k: jax.make_array_from_process_local_data(self._sharding, v) for k, v in batch.items()}
        ):
          return
      self._put(_END)
    except BaseException as e:  # handed to the consumer, which re-raises it with its traceback
      self._put(e)

  def _put(self, item) -> bool:
    """Queues ``item`` once there is room; False where the consumer closed this first."""
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    start = time.perf_counter()
    item = self._queue.get()
    self.wait_seconds += time.perf_counter() - start
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
