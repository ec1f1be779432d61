"""Gradient fusion: many small tensors reduced as a few large flat buffers ("buckets").

Every collective has a fixed start-up cost (alpha in the alpha-beta model of cost_model, issue #3);
reducing 160 ResNet-50 tensors one by one pays it 160 times (hierarchical: 3 x 160). Buckets pay it
once per bucket, and each bucket is still its own collective, so XLA can overlap the early buckets with
the rest of the backward pass.

``fixed`` (Horovod / PyTorch DDP style): walk the tensors in backward order (the last layer's gradient
is ready first) and close a bucket when adding the next tensor would pass ``bucket_bytes``; a tensor
larger than the threshold gets a bucket of its own. The adaptive MG-WFBP planner is issue #3.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

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
  """Indices of the leaves in the order their gradients are produced.

  Approximated as the reverse of the pytree order: flax names modules by creation, but dict pytrees
  sort keys, so this is only roughly the reverse of the forward pass. The adaptive planner (issue #3)
  replaces it with the measured order.
  """
  return list(range(len(leaves)))[::-1]


def reduce_in_buckets(leaves: Sequence[jax.Array], buckets: Sequence[Sequence[int]],
                      order: Sequence[int], allreduce: Callable[[jax.Array], jax.Array]) -> list[jax.Array]:
  """Applies ``allreduce`` to each bucket as one flat buffer and splits the results back.

  ``buckets`` index into ``order``, which indexes into ``leaves``.
  """
  out: list[jax.Array | None] = [None] * len(leaves)
  for bucket in buckets:
    members = [order[i] for i in bucket]
    flat = jnp.concatenate([leaves[m].reshape(-1) for m in members])
    reduced = allreduce(flat)
    offset = 0
    for m in members:
      size = leaves[m].size
      out[m] = reduced[offset:offset + size].reshape(leaves[m].shape)
      offset += size
  return out
