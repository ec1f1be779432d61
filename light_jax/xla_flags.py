"""XLA flags light_jax sets before JAX starts its backend: on GPUs, and for the CPU's collectives.

What the defaults are in the XLA of jax 0.10 (read in `xla/debug_options_flags.cc`): collectives run
asynchronously on GPU already (the old `xla_gpu_enable_async_*` flags are gone), on a high-priority
stream (`xla_gpu_enable_highest_priority_async_stream=true`); the latency-hiding scheduler, which
moves each bucket's collective early so that it runs during the rest of the backward pass, is off
(`xla_gpu_enable_latency_hiding_scheduler=false`); the combiners merge independent all-reduces,
all-gathers and reduce-scatters up to 30 MiB each.

So on GPU light_jax turns the latency-hiding scheduler on, and caps the combiners at 25 MiB, the
default bucket (`comm.bucket_bytes`): our buckets are already the unit of overlap, and merging two of
them into one collective would hold the first back until the second is ready. docs/techniques.md
section 3 explains why buckets are reduced separately.

On CPU (simulated devices: one thread per device in one process) XLA aborts the whole process when a
collective's threads wait for a late one more than 40 s after a 20-s warning
(`xla_cpu_collective_call_terminate_timeout_seconds`, "Termination timeout ... exceeded"). On a busy
machine with 8 device threads on 2 cores one thread can be that late without anything being wrong.
light_jax raises it to 10 minutes (measured: one device thread held back 100 s before an all-reduce
aborts the process at the default and completes with this; tests/test_throughput.py holds one back 65 s).
Lateness is not the whole story: a 28-epoch batch-1,024 study run died at its 1,334th step (the end of
epoch 23) with XLA's default; with this flag a batch-256 run died at step 3,744 (the end of epoch 16)
after 6 of its 8 device threads had waited 10 minutes in an evaluation's all-reduce for the other 2, and
a batch-4,096 run hung so at step 378 (the end of epoch 27; killed after 3 minutes): hangs, all at an
epoch end, the last two while a test run shared the 2 cores. `evaluation.evaluate` now keeps one
evaluation step in flight, our guess at a guard; the studies' harness (benchmarks/train_runs.py) resumes a
run that dies from its last checkpoint, and `train.py` with the same workdir does the same by hand. In a
run of several processes a survivor's device threads may also wait this long on a dead peer's collective;
light_jax/liveness.py's watchdog, or JAX's heartbeat behind it, stops the survivor first.

To override: any flag you put in XLA_FLAGS yourself wins over ours; LIGHT_JAX_XLA_FLAGS=0 sets none.
The GPU flags are set only where a CUDA plugin is installed.
"""

from __future__ import annotations

import importlib.util
import os

GPU_FLAGS = {
  "xla_gpu_enable_latency_hiding_scheduler": "true",
  "xla_gpu_all_reduce_combine_threshold_bytes": str(25 * 2**20),
  "xla_gpu_all_gather_combine_threshold_bytes": str(25 * 2**20),
  "xla_gpu_reduce_scatter_combine_threshold_bytes": str(25 * 2**20),
}
CPU_FLAGS = {"xla_cpu_collective_call_terminate_timeout_seconds": "600"}
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def has_cuda_plugin() -> bool:
  return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def merged(existing: str, flags: dict[str, str]) -> str:
  """``existing`` XLA_FLAGS with ``flags`` added, except those it already sets."""
  present = {item.lstrip("-").split("=", 1)[0] for item in existing.split()}
  added = [f"--{name}={value}" for name, value in flags.items() if name not in present]
  return " ".join([*existing.split(), *added])


def apply(environ=os.environ) -> None:
  """Adds ``CPU_FLAGS``, and ``GPU_FLAGS`` when a CUDA plugin is installed, to XLA_FLAGS; call before JAX
  starts a backend."""
  if environ.get("LIGHT_JAX_XLA_FLAGS", "1") == "0":
    return
  flags = {**CPU_FLAGS, **(GPU_FLAGS if has_cuda_plugin() else {})}
  environ["XLA_FLAGS"] = merged(environ.get("XLA_FLAGS", ""), flags)
