"""XLA flags light_jax sets on GPUs, before JAX starts its backend.

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

To override: any flag you put in XLA_FLAGS yourself wins over ours; LIGHT_JAX_XLA_FLAGS=0 sets none.
Nothing is set where no CUDA plugin is installed (CPU runs stay as they are).
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
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def has_cuda_plugin() -> bool:
  return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def merged(existing: str, flags: dict[str, str]) -> str:
  """``existing`` XLA_FLAGS with ``flags`` added, except those it already sets."""
  present = {item.lstrip("-").split("=", 1)[0] for item in existing.split()}
  added = [f"--{name}={value}" for name, value in flags.items() if name not in present]
  return " ".join([*existing.split(), *added])


def apply(environ=os.environ) -> None:
  """Adds ``GPU_FLAGS`` to XLA_FLAGS when a CUDA plugin is installed; call before JAX starts a backend."""
  if environ.get("LIGHT_JAX_XLA_FLAGS", "1") == "0" or not has_cuda_plugin():
    return
  environ["XLA_FLAGS"] = merged(environ.get("XLA_FLAGS", ""), GPU_FLAGS)
