"""Pick the number of grain worker processes for this machine by measuring, in bounded time.

The best count depends on the cores, the decoder, the image sizes and whether a cache is hit, so it is
measured at start-up on the batches the run is about to read: for each candidate, start the iterator,
let the first max(1, workers) batches through (worker start-up is not throughput), then count batches for
``seconds_each``. The fastest wins; a count within ``tolerance`` of it but smaller wins instead (fewer
processes, less memory). The table is logged. ``data.num_workers`` >= 0 pins the count and skips this.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator

from absl import logging


def candidate_counts(cpus: int | None = None) -> list[int]:
  """0 (in-process threads), then 1, 2, 4, ... up to the CPU count."""
  cpus = cpus or os.cpu_count() or 1
  counts, w = [0], 1
  while w <= cpus:
    counts.append(w)
    w *= 2
  if counts[-1] != cpus:
    counts.append(cpus)
  return counts


def measure(make_iterator: Callable[[int], Iterator], workers: int, seconds: float) -> float:
  """Batches per second from ``make_iterator(workers)`` after its first batch."""
  iterator = make_iterator(workers)
  # W workers start together, so when the first batch arrives W - 1 more are nearly done: skip W
  # batches (at least 1) before the clock starts, or more workers would look faster than they are.
  warmup = max(1, workers)
  try:
    count, start = 0, None
    for seen, _ in enumerate(iterator, 1):   # a run shorter than the measurement just ends it early
      if seen <= warmup:
        start = time.perf_counter()
        continue
      count += 1
      if time.perf_counter() - start >= seconds:
        break
    return count / (time.perf_counter() - start) if count else 0.0
  finally:
    close = getattr(iterator, "close", None)
    if close is not None:
      close()


def best_worker_count(make_iterator: Callable[[int], Iterator], candidates: list[int] | None = None,
                      seconds_each: float = 3.0, tolerance: float = 0.05) -> int:
  candidates = candidates or candidate_counts()
  rates = {}
  for workers in candidates:
    rates[workers] = measure(make_iterator, workers, seconds_each)
    logging.info("input autotune: %d worker process(es): %.2f batches/s", workers, rates[workers])
  fastest = max(rates.values())
  best = min(w for w, r in rates.items() if r >= (1 - tolerance) * fastest)
  logging.info("input autotune: using %d worker process(es) (%.2f batches/s; measured %s)", best, rates[best],
               ", ".join(f"{w}: {r:.2f}" for w, r in rates.items()))
  return best
