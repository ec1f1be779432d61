"""Gradient all-reduce strategies over the (node, local) mesh, written as lax collectives.

Every function here runs *inside* ``jax.shard_map`` over both mesh axes and takes the device's
**local** gradient (not yet reduced; see ``train_lib`` for how the step avoids JAX's implicit psum).

Strategies (``comm.strategy``), each a pure function ``array -> sum of that array over all devices``:
- ``dense``: one ``psum`` over (node, local); XLA/NCCL picks the algorithm (a flat ring or tree).
- ``hierarchical``: reduce-scatter over ``local`` (fast links), all-reduce of the 1/n shard over
  ``node`` (slow links), all-gather over ``local``. Only d/n elements per device cross machines.

``GradientReducer`` wraps a strategy for a whole gradient pytree and divides by the device count, so
the result is the gradient of the mean loss over the global batch. Strategies with per-device state
(error-feedback residuals of the top-k family, issue #3) keep it in ``comm_state``, which the train
state carries sharded over both mesh axes.

Byte accounting (``CommBytes``): bytes one device *sends* per step over each link level, from the
shapes alone, for ring algorithms (the ones NCCL and gloo use at these sizes). For a flat ring that spans
several nodes, the devices at node boundaries send their whole ring traffic over the slow link and set
the pace, so that worst case is what ``dense`` reports as inter-node bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import AXES, LOCAL, NODE

PyTree = Any


def dense_allreduce(x: jax.Array) -> jax.Array:
  """Sum of ``x`` over every device with one psum."""
  return lax.psum(x, AXES)


def hierarchical_allreduce(x: jax.Array) -> jax.Array:
  """Sum of ``x`` over every device: reduce-scatter(local) -> all-reduce(node) -> all-gather(local).

  The tensor is flattened and zero-padded to a multiple of the local device count so the scatter
  splits it evenly; the padding is dropped after the gather.
  """
  local = lax.axis_size(LOCAL)
  flat = x.reshape(-1)
  padded_size = _round_up(flat.size, local)
  flat = jnp.pad(flat, (0, padded_size - flat.size))
  shard = lax.psum_scatter(flat, LOCAL, scatter_dimension=0, tiled=True)  # this device's 1/n, summed in node
  shard = lax.psum(shard, NODE)                                           # summed over nodes
  full = lax.all_gather(shard, LOCAL, axis=0, tiled=True)
  return full[: x.size].reshape(x.shape)


STRATEGIES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "dense": dense_allreduce,
    "hierarchical": hierarchical_allreduce,
}


@dataclasses.dataclass(frozen=True)
class CommBytes:
  """Bytes one device sends per training step, by link level."""

  intra_node: int = 0
  inter_node: int = 0

  def __add__(self, other: "CommBytes") -> "CommBytes":
    return CommBytes(self.intra_node + other.intra_node, self.inter_node + other.inter_node)


def ring_allreduce_bytes(num_bytes: int, group: int) -> int:
  """Bytes each member sends in a ring all-reduce of ``num_bytes`` over ``group`` members: 2(g-1)/g x M."""
  return 2 * (group - 1) * num_bytes // group if group > 1 else 0


def strategy_bytes(strategy: str, num_elements: int, itemsize: int, nodes: int, local: int) -> CommBytes:
  """Exact per-device bytes of reducing one tensor of ``num_elements`` with ``strategy`` (ring model)."""
  if strategy == "dense":
    per_device = ring_allreduce_bytes(num_elements * itemsize, nodes * local)
    return CommBytes(intra_node=per_device if local > 1 else 0, inter_node=per_device if nodes > 1 else 0)
  if strategy == "hierarchical":
    padded = _round_up(num_elements, local)
    shard_bytes = padded // local * itemsize
    # reduce-scatter and all-gather over `local` each send (n-1)/n of the padded tensor.
    intra = 2 * (local - 1) * shard_bytes
    return CommBytes(intra_node=intra, inter_node=ring_allreduce_bytes(shard_bytes, nodes))
  raise ValueError(f"unknown strategy {strategy!r}; known: {sorted(STRATEGIES)}")


@dataclasses.dataclass(frozen=True)
class GradientReducer:
  """Turns local gradients into the mean gradient over all devices.

  ``reduce`` runs inside shard_map; ``init_state`` gives the per-device state the strategy carries
  between steps (none for dense and hierarchical); ``bytes_per_step`` is the exact traffic per device.
  With ``fusion="none"`` each tensor gets its own collective; with ``"fixed"`` tensors are packed into
  flat buckets of up to ``bucket_bytes`` (see fusion.py).
  """

  strategy: str
  nodes: int
  local: int
  fusion: str = "none"
  bucket_bytes: int = fusion_lib.DEFAULT_BUCKET_BYTES

  def init_state(self, params: PyTree) -> PyTree:
    del params
    return ()

  def buckets(self, leaves) -> tuple[list[int], list[list[int]]]:
    """(backward order of the leaves, buckets as lists of positions in that order)."""
    order = fusion_lib.backward_order(leaves)
    if self.fusion == "none":
      return order, [[i] for i in range(len(order))]
    sizes = [math.prod(leaves[i].shape) * jnp.dtype(leaves[i].dtype).itemsize for i in order]
    return order, fusion_lib.plan_fixed_buckets(sizes, self.bucket_bytes)

  def reduce(self, local_grads: PyTree, comm_state: PyTree) -> tuple[PyTree, PyTree]:
    leaves, treedef = jax.tree.flatten(local_grads)
    order, buckets = self.buckets(leaves)
    summed = fusion_lib.reduce_in_buckets(leaves, buckets, order, STRATEGIES[self.strategy])
    num_devices = self.nodes * self.local
    return jax.tree.unflatten(treedef, [g / num_devices for g in summed]), comm_state

  def bytes_per_step(self, params: PyTree) -> CommBytes:
    leaves = jax.tree.leaves(params)
    order, buckets = self.buckets(leaves)
    total = CommBytes()
    for bucket in buckets:
      members = [leaves[order[i]] for i in bucket]
      elements = sum(math.prod(p.shape) for p in members)
      total += strategy_bytes(self.strategy, elements, jnp.dtype(members[0].dtype).itemsize, self.nodes, self.local)
    return total


def make_gradient_reducer(strategy: str, nodes: int, local: int, fusion: str = "none",
                          bucket_bytes: int = fusion_lib.DEFAULT_BUCKET_BYTES) -> GradientReducer:
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown comm.strategy {strategy!r}; known: {sorted(STRATEGIES)}")
  if fusion not in ("none", "fixed"):
    raise ValueError(f"unknown comm.fusion {fusion!r}; known: none, fixed")
  return GradientReducer(strategy=strategy, nodes=nodes, local=local, fusion=fusion, bucket_bytes=bucket_bytes)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple
