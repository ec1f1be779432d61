"""Gradient fusion: many small tensors reduced as a few large flat buffers ("buckets").

Every collective has a fixed start-up cost (alpha in the alpha-beta model of cost_model.py);
reducing 160 ResNet-50 tensors one by one pays it 160 times (hierarchical: 3 x 160). Buckets pay it
once per bucket, and each bucket is still its own collective, so XLA can overlap the early buckets with
the rest of the backward pass.

Tensors are taken in backward order (the last layer's gradient is ready first), as profiled from the
model's forward pass by ``profile_parameters``.

- ``fixed`` (Horovod / PyTorch DDP style): close a bucket when adding the next tensor would pass
  ``bucket_bytes``; a tensor larger than the threshold gets a bucket of its own.
- ``adaptive`` (MG-WFBP, Shi et al. INFOCOM'19; docs/techniques.md section 3): ``plan_mgwfbp`` merges a
  tensor into the next one when the next gradient is ready before this tensor's collective would end,
  and waiting for it costs less than one more start-up (alpha). Needs per-tensor backward times (from
  FLOPs here) and the alpha-beta cost of the strategy (cost_model.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# PyTorch DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 * 2**20


def plan_fixed_buckets(sizes_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
  """Groups tensor indices into buckets of at most ``bucket_bytes`` (a bigger tensor stands alone).

  Args:
    sizes_bytes: bytes of each tensor, *in backward order* (index 0 is reduced first).
    bucket_bytes: threshold; 0 puts every tensor in one bucket.
  Returns:
    Lists of indices into ``sizes_bytes``, each list one bucket, in reduction order.
  """
  buckets: list[list[int]] = []
  current: list[int] = []
  current_bytes = 0
  for i, size in enumerate(sizes_bytes):
    if current and bucket_bytes and current_bytes + size > bucket_bytes:
      buckets.append(current)
      current, current_bytes = [], 0
    current.append(i)
    current_bytes += size
  if current:
    buckets.append(current)
  return buckets


def backward_order(leaves: Sequence[jax.Array]) -> list[int]:
  """Fallback order when no profile is given: the reverse of the pytree order (dict pytrees sort keys,
  so this is only roughly the reverse of the forward pass; ``profile_parameters`` gives the real one)."""
  return list(range(len(leaves)))[::-1]


@dataclasses.dataclass(frozen=True)
class ParameterProfile:
  """Per parameter tensor (indexed like ``jax.tree.leaves(params)``): when its gradient is produced.

  Attributes:
    order: leaf indices in backward order (first = gradient ready first).
    backward_flops: estimated FLOPs of each leaf's part of the backward pass, in leaf order.
    params: the parameter tree as shapes (jax.ShapeDtypeStruct leaves).
  """

  order: tuple[int, ...]
  backward_flops: tuple[float, ...]
  params: object = None


def profile_parameters(model: nn.Module, input_shape: Sequence[int]) -> ParameterProfile:
  """Backward order and FLOP estimates of every parameter, from one abstract forward pass.

  Order: modules in the order the forward pass calls them, reversed. FLOPs: a kernel applied at every
  output position costs 2 x size x positions forward and twice that backward (input and weight
  gradients); scales and biases are element-wise and cost about their output size.
  """
  output_positions: dict[tuple[str, ...], int] = {}

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and context.module.path not in output_positions:
      shape = getattr(out, "shape", (1,))
      output_positions[context.module.path] = math.prod(shape[1:-1]) if len(shape) > 2 else 1
    return out

  with nn.intercept_methods(record):
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, *input_shape)), train=False))
  paths = [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(variables["params"])]
  leaves = jax.tree.leaves(variables["params"])
  call_rank = {path: i for i, path in enumerate(output_positions)}
  flops = [4.0 * leaf.size * output_positions.get(path[:-1], 1) for path, leaf in zip(paths, leaves)]
  forward = sorted(range(len(leaves)), key=lambda i: (call_rank.get(paths[i][:-1], len(call_rank)), i))
  return ParameterProfile(order=tuple(reversed(forward)), backward_flops=tuple(flops), params=variables["params"])


def plan_mgwfbp(
  backward_seconds: Sequence[float], sizes_bytes: Sequence[float], alpha: float, beta: float
) -> list[list[int]]:
  """MG-WFBP merged-gradient groups, all inputs in backward order (position 0 is ready first).

  Position i's gradient is ready at R(i) = t_b(0) + ... + t_b(i); its collective starts at
  S(i) = max(S(i-1) + t_c(i-1), R(i)) with t_c(M) = alpha + beta M (0 for a slot merged away).
  Scanning i = 0, 1, ...: with r = R(i+1), merge i into i+1 when r < S(i) + t_c(i) (i+1 is ready
  before i's collective would end) and either S(i) > r (i's collective has not started yet) or
  r - S(i) < alpha (waiting costs less than one more start-up); otherwise close the group.

  Returns:
    Groups of positions, in order; each group is one fused collective.
  """
  n = len(sizes_bytes)
  if n == 0:
    return []
  ready = np.cumsum(np.asarray(backward_seconds, np.float64))
  comm = [float(b) for b in sizes_bytes]  # bytes sent at each position's slot
  groups = [[0]]
  for i in range(n - 1):
    t_c = [alpha + beta * b if b > 0 else 0.0 for b in comm]
    start = np.empty(n)
    for j in range(n):
      start[j] = ready[j] if j == 0 else max(start[j - 1] + t_c[j - 1], ready[j])
    r = ready[i + 1]
    if r < start[i] + t_c[i] and (start[i] > r or r - start[i] < alpha):
      comm[i + 1] += comm[i]
      comm[i] = 0.0
      groups[-1].append(i + 1)
    else:
      groups.append([i + 1])
  return groups


def pack(tensors: Sequence[jax.Array]) -> jax.Array:
  """One flat buffer holding ``tensors`` back to back."""
  return jnp.concatenate([t.reshape(-1) for t in tensors])


def unpack(flat: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
  """Splits a buffer made by ``pack`` back into tensors shaped like ``like``."""
  out, offset = [], 0
  for t in like:
    out.append(flat[offset : offset + t.size].reshape(t.shape))
    offset += t.size
  return out
