"""Pick grain's worker-process count and prefetch depth for this machine by measuring, in bounded time.

The best settings depend on the cores, the decoder, the image sizes and whether a cache is hit, so they
are measured at start-up on the batches the run is about to read: for each candidate, start the
iterator, let the first max(1, workers) batches through (worker start-up is not throughput), then count
batches for ``seconds_each``. The fastest wins; a candidate within ``tolerance`` of it but smaller wins
instead (fewer processes, fewer batches in memory). Tables are logged.

Two knobs, tuned one after the other: the worker count (``data.num_workers``), then the prefetch depth
(``data.host_prefetch``), grain's buffer of batches being assembled ahead of use in each iterator. The
depth also bounds grain's parallelism: at most min(read_threads, depth) batches are in flight, so a
depth below ``data.read_threads`` leaves threads idle. A config value >= 0 pins a knob and skips its
measurement.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from absl import logging


def candidate_counts(cpus: int | None = None) -> list[int]:
  """0 (in-process threads), then 1, 2, 4, ... up to the CPU count."""
  cpus = cpus or len(os.sched_getaffinity(0))  # the cores this process may use, not the machine's
  counts, w = [0], 1
  while w <= cpus:
    counts.append(w)
    w *= 2
  if counts[-1] != cpus:
    counts.append(cpus)
  return counts


def measure(make_iterator: Callable[[int], Iterator], workers: int, seconds: float) -> float:
  """Batches per second from ``make_iterator(workers)`` after its first max(1, workers) batches."""
  iterator = make_iterator(workers)
  # W workers start together, so when the first batch arrives W - 1 more are nearly done: skip W
  # batches (at least 1) before the clock starts, or more workers would look faster than they are.
  warmup = max(1, workers)
  try:
    count, start = 0, None
    for seen, _ in enumerate(iterator, 1):  # a run shorter than the measurement just ends it early
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


def free_memory_bytes() -> int:
  """Memory available to new allocations on this machine (Linux: free pages plus reclaimable cache)."""
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def prefetch_candidates(read_threads: int) -> list[int]:
  """1, 2, 4, ... up to twice the read threads (at least 4)."""
  counts, depth = [], 1
  while depth <= max(4, 2 * read_threads):
    counts.append(depth)
    depth *= 2
  return counts


def _pick(rates: dict[int, float], tolerance: float) -> int:
  fastest = max(rates.values())
  return min(k for k, r in rates.items() if r >= (1 - tolerance) * fastest)


def best_input_settings(
  make_iterator: Callable[[int, int], Iterator],
  workers: int,
  prefetch: int,
  read_threads: int,
  seconds_each: float = 3.0,
  tolerance: float = 0.05,
  batch_bytes: int = 0,
  memory_budget: int = 0,
) -> tuple[int, int]:
  """(worker processes, prefetch depth): each measured when it is -1, else kept.

  ``make_iterator(workers, prefetch)`` starts the batches the run will read with those settings.
  Measured depths keep depth x max(1, workers) batches of ``batch_bytes`` (the run's largest) within
  ``memory_budget`` bytes (0: no bound): every worker holds up to ``depth`` finished batches.
  """

  def depth_cap(count: int) -> int:
    if not (batch_bytes and memory_budget):
      return 1 << 30
    return max(1, memory_budget // (max(1, count) * batch_bytes))

  if workers < 0:
    rates = {}
    for count in candidate_counts():
      depth = prefetch if prefetch >= 0 else min(max(read_threads, 2), depth_cap(count))
      rates[count] = measure(lambda w: make_iterator(w, depth), count, seconds_each)
      logging.info("input autotune: %d worker process(es): %.2f batches/s", count, rates[count])
    workers = _pick(rates, tolerance)
    logging.info(
      "input autotune: using %d worker process(es) (%.2f batches/s; measured %s)",
      workers,
      rates[workers],
      ", ".join(f"{w}: {r:.2f}" for w, r in rates.items()),
    )
  if prefetch < 0:
    rates = {}
    all_depths = prefetch_candidates(read_threads)
    candidates = [d for d in all_depths if d <= depth_cap(workers)] or [1]
    if len(candidates) < len(all_depths):
      logging.info(
        "input autotune: prefetch depth at most %d (%d worker process(es) x depth x %.0f MB batches within %.1f GB)",
        candidates[-1],
        workers,
        batch_bytes / 1e6,
        memory_budget / 1e9,
      )
    for depth in candidates:
      rates[depth] = measure(lambda w: make_iterator(w, depth), workers, seconds_each)
      logging.info("input autotune: prefetch depth %d: %.2f batches/s", depth, rates[depth])
    prefetch = _pick(rates, tolerance)
    logging.info(
      "input autotune: using prefetch depth %d with %d read thread(s) (%.2f batches/s; measured %s)",
      prefetch,
      read_threads,
      rates[prefetch],
      ", ".join(f"{d}: {r:.2f}" for d, r in rates.items()),
    )
  return workers, prefetch
