"""Gradient all-reduce strategies over the (node, local) mesh, written as lax collectives.

Every function here runs *inside* ``jax.shard_map`` over both mesh axes and takes the device's
**local** gradient (not yet reduced; see ``train_lib`` for how the step avoids JAX's implicit psum).

Dense strategies (``comm.strategy``), ``flat vector -> its sum over all devices``:
- ``dense``: one ``psum`` over (node, local); XLA/NCCL picks the algorithm (a flat ring or tree).
- ``hierarchical``: reduce-scatter over ``local`` (fast links), all-reduce of the 1/n shard over
  ``node`` (slow links), all-gather over ``local``. Only d/n elements per device cross machines.

Compressed strategies, ``(flat vector, residual) -> (approximate sum, new residual)``:
- ``hitopk`` (HiTopKComm, light-techniques.md section 1): reduce-scatter over ``local`` (dense), error
  feedback + top-k on the device's 1/n shard, all-gather of (values, int32 indices) over ``node`` among
  devices of the same local rank, scatter-add, all-gather over ``local``. The slow link carries 2k
  numbers per device instead of the shard.
- ``topk``: the flat baseline: error feedback + top-k of the whole vector on each device, all-gather
  of (values, indices) over every device, scatter-add.
- ``gtopk`` (gTop-k, Shi et al. ICDCS'19, light-techniques.md section 4): error feedback + top-k on
  each device, then log2(P) rounds of recursive doubling: swap the k (value, index) pairs with the
  device whose linear index differs in bit r (``ppermute``), add the two sparse sets, keep the top-k of
  the sum. Partners compute the same set, so after the last round every device holds the same global
  index set G. The paper sends the merged partial sums and returns to each residual the values that
  missed G; here one k-element psum of every device's corrected gradient at G gives the exact sums
  instead, and the residual is the corrected gradient off G, so error feedback loses nothing (partial
  sums dropped in an early round would otherwise vanish). Needs a power-of-two device count.
Buckets too small to be worth compressing (``min_compress_elements``) go dense (hierarchical for
``hitopk``, psum for ``topk``).

``GradientReducer`` applies a strategy to a whole gradient pytree, bucket by bucket (fusion.py), and
divides by the device count, so the result is the mean gradient over the global batch. The residuals
of the compressed strategies are ``comm_state``: one float32 vector per compressed bucket per device,
carried in the train state with leading dims (nodes, local), sharded over both mesh axes.

Byte accounting (``CommBytes``): bytes one device *sends* per step over each link level, from the
shapes alone, for ring algorithms (the ones NCCL and gloo use at these sizes). For a flat ring or
all-gather that spans several nodes, the devices at node boundaries send their whole traffic over the
slow link and set the pace, so that worst case is what ``dense`` and ``topk`` report as inter-node bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from light_jax.parallel import compression
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import AXES, LOCAL, NODE

PyTree = Any
INDEX_BYTES = 4  # int32 indices


def dense_allreduce(x: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """Sum of flat ``x`` over every device with one psum (in ``wire_dtype``, which then also accumulates)."""
  return lax.psum(x.astype(wire_dtype), AXES).astype(x.dtype)


def _reduce_scatter(x: jax.Array, axis: str, wire_dtype) -> jax.Array:
  """Tiled reduce-scatter of flat ``x`` (size divisible by the axis size) over ``axis``.

  With a narrower ``wire_dtype`` the chunks travel in it (an all-to-all) and are summed in x's dtype
  on arrival, so the accumulation stays float32 while the link carries half the bytes.
  """
  if jnp.dtype(wire_dtype) == x.dtype:
    return lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
  chunks = x.astype(wire_dtype).reshape(lax.axis_size(axis), -1)
  received = lax.all_to_all(chunks, axis, split_axis=0, concat_axis=0)   # chunk i from every peer
  return received.astype(x.dtype).sum(axis=0)


def _all_gather(shard: jax.Array, axis: str, wire_dtype) -> jax.Array:
  return lax.all_gather(shard.astype(wire_dtype), axis, axis=0, tiled=True).astype(shard.dtype)


def _scatter_to_local_shard(x: jax.Array, wire_dtype, multiple: int = 1) -> jax.Array:
  """Zero-pads flat ``x`` to a multiple of ``local x multiple`` and reduce-scatters it over ``local``."""
  local = lax.axis_size(LOCAL)
  x = jnp.pad(x, (0, _round_up(x.size, local * multiple) - x.size))
  return _reduce_scatter(x, LOCAL, wire_dtype)


def hierarchical_allreduce(x: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """Sum of flat ``x`` over every device: reduce-scatter(local) -> all-reduce(node) -> all-gather(local)."""
  narrow = jnp.dtype(wire_dtype) != x.dtype
  nodes = lax.axis_size(NODE) if narrow else 1
  shard = _scatter_to_local_shard(x, wire_dtype, nodes)    # this device's 1/n of the node's sum
  if narrow:   # all-reduce over nodes as reduce-scatter + all-gather, to accumulate in float32
    shard = _all_gather(_reduce_scatter(shard, NODE, wire_dtype), NODE, wire_dtype)
  else:
    shard = lax.psum(shard, NODE)                          # the only inter-node traffic
  return _all_gather(shard, LOCAL, wire_dtype)[:x.size]


def hierarchical_topk_allreduce(x: jax.Array, residual: jax.Array, k: int, selector: str,
                                error_feedback: bool, wire_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """HiTopK: dense inside the node, k (value, index) pairs per device across nodes.

  Args:
    x: flat local gradient (d,).
    residual: this device's error-feedback residual, the size of its local shard (ceil(d / n),).
    k: entries kept per shard.
    wire_dtype: dtype of the two dense intra-node hops; the sparse values cross nodes in float32.
  """
  shard = _scatter_to_local_shard(x, wire_dtype)
  indices, values, residual = compression.apply_error_feedback(shard, residual, k, selector, error_feedback)
  all_indices = lax.all_gather(indices, NODE)          # (nodes, k): same local rank on every node
  all_values = lax.all_gather(values, NODE)
  shard = jnp.zeros_like(shard).at[all_indices.reshape(-1)].add(all_values.reshape(-1))
  return _all_gather(shard, LOCAL, wire_dtype)[:x.size], residual


def topk_allreduce(x: jax.Array, residual: jax.Array, k: int, selector: str,
                   error_feedback: bool, wire_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Flat top-k: every device selects k entries of its whole gradient; all-gather over all devices.

  No dense hop, so ``wire_dtype`` does not apply."""
  del wire_dtype
  indices, values, residual = compression.apply_error_feedback(x, residual, k, selector, error_feedback)
  all_indices = lax.all_gather(indices, AXES)
  all_values = lax.all_gather(values, AXES)
  return jnp.zeros_like(x).at[all_indices.reshape(-1)].add(all_values.reshape(-1)), residual


def gtopk_allreduce(x: jax.Array, residual: jax.Array, k: int, selector: str,
                    error_feedback: bool, wire_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """gTop-k: recursive-doubling merge of the devices' top-k sets, then exact sums at the winners.

  Rounds whose partner distance is below ``local`` stay inside the node; the last log2(nodes) cross
  nodes, k (value, index) pairs each. No dense hop, so ``wire_dtype`` does not apply.
  """
  del wire_dtype
  corrected = x + residual if error_feedback else x
  select = compression.SELECTORS[selector]
  indices, values = select(corrected, k)
  num_devices = lax.axis_size(NODE) * lax.axis_size(LOCAL)
  for r in range(num_devices.bit_length() - 1):
    partner = [(i, i ^ (1 << r)) for i in range(num_devices)]   # linear index over (node, local)
    their_indices = lax.ppermute(indices, AXES, partner)
    their_values = lax.ppermute(values, AXES, partner)
    # Each index holds at most two addends, and a + b == b + a exactly: partners get the same set.
    merged = jnp.zeros_like(x).at[indices].add(values).at[their_indices].add(their_values)
    indices, values = select(merged, k)
  summed = lax.psum(corrected[indices], AXES)                # exact sums at the global top-k set
  new_residual = corrected.at[indices].set(0.0) if error_feedback else residual
  return jnp.zeros_like(x).at[indices].set(summed), new_residual


DENSE_STRATEGIES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "dense": dense_allreduce,
    "hierarchical": hierarchical_allreduce,
}
COMPRESSED_STRATEGIES = {
    "hitopk": hierarchical_topk_allreduce,
    "topk": topk_allreduce,
    "gtopk": gtopk_allreduce,
}
# What a compressed strategy does with a bucket too small to compress.
DENSE_FALLBACK = {"hitopk": "hierarchical", "topk": "dense", "gtopk": "dense"}
STRATEGIES = (*DENSE_STRATEGIES, *COMPRESSED_STRATEGIES)
FUSIONS = ("none", "fixed", "adaptive")


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


def strategy_bytes(strategy: str, num_elements: int, itemsize: int, nodes: int, local: int, k: int = 0,
                   wire_itemsize: int | None = None) -> CommBytes:
  """Exact per-device bytes of reducing one flat buffer of ``num_elements`` with ``strategy`` (ring model).

  ``k`` is the number of entries a compressed strategy keeps (per local shard for ``hitopk``, per
  device for ``topk`` and ``gtopk``); ``wire_itemsize`` is the element size on the dense hops (default ``itemsize``).
  """
  wire = wire_itemsize or itemsize
  narrow = wire != itemsize
  multiple = local * nodes if narrow and strategy == "hierarchical" else local
  shard_elements = _round_up(num_elements, multiple) // local
  # reduce-scatter and all-gather over `local` each send (n-1)/n of the padded buffer.
  scatter_gather = 2 * (local - 1) * shard_elements * wire
  if strategy == "dense":
    per_device = ring_allreduce_bytes(num_elements * wire, nodes * local)
    return CommBytes(intra_node=per_device if local > 1 else 0, inter_node=per_device if nodes > 1 else 0)
  if strategy == "hierarchical":
    return CommBytes(intra_node=scatter_gather, inter_node=ring_allreduce_bytes(shard_elements * wire, nodes))
  if strategy == "hitopk":
    # All-gather over `node` of k (value, index) pairs: (N-1) x k x 8 bytes per device.
    return CommBytes(intra_node=scatter_gather, inter_node=(nodes - 1) * k * (itemsize + INDEX_BYTES))
  if strategy == "topk":
    per_device = (nodes * local - 1) * k * (itemsize + INDEX_BYTES)
    return CommBytes(intra_node=per_device if local > 1 else 0, inter_node=per_device if nodes > 1 else 0)
  if strategy == "gtopk":
    # log2(local) rounds inside the node and log2(nodes) across, k x 8 bytes each (both are powers of
    # two), then a ring all-reduce of k float32 sums over every device.
    pairs = k * (itemsize + INDEX_BYTES)
    sums = strategy_bytes("dense", k, itemsize, nodes, local)
    return CommBytes(intra_node=(local.bit_length() - 1) * pairs + sums.intra_node,
                     inter_node=(nodes.bit_length() - 1) * pairs + sums.inter_node)
  raise ValueError(f"unknown strategy {strategy!r}; known: {list(STRATEGIES)}")


@dataclasses.dataclass(frozen=True)
class GradientReducer:
  """Turns local gradients into the mean gradient over all devices, bucket by bucket.

  ``reduce`` runs inside shard_map; ``init_state`` gives the per-device residuals of the compressed
  buckets (empty for the dense strategies); ``bytes_per_step`` is the exact traffic per device.

  Attributes:
    strategy: one of ``STRATEGIES``.
    nodes, local: the mesh shape.
    fusion: ``"none"`` (a collective per tensor), ``"fixed"`` (buckets up to ``bucket_bytes``) or
      ``"adaptive"`` (the MG-WFBP ``groups``, planned by ``cost_model.plan_adaptive_fusion``).
    density: fraction of entries kept by the compressed strategies (k per shard or per device).
    selector: ``"exact"`` or ``"mstopk"`` (compression.py).
    error_feedback: keep what top-k did not send and add it to the next step's gradient.
    min_compress_elements: buckets whose compressed unit (local shard for hitopk, whole bucket for
      topk) is smaller than this go dense: top-k would save little and cost a selection.
    wire_dtype: dtype of the dense hops on the wire (``comm.dtype``): "bfloat16" halves their bytes;
      hierarchical and hitopk still accumulate in float32 (dense's psum accumulates in the wire dtype).
    order: leaf indices in backward order (``fusion.profile_parameters``); None = reversed pytree order.
    groups: for ``"adaptive"``, the buckets as positions in ``order``.
  """

  strategy: str
  nodes: int
  local: int
  fusion: str = "none"
  bucket_bytes: int = fusion_lib.DEFAULT_BUCKET_BYTES
  density: float = 1.0
  selector: str = "exact"
  error_feedback: bool = True
  min_compress_elements: int = 512
  wire_dtype: str = "float32"
  order: tuple[int, ...] | None = None
  groups: tuple[tuple[int, ...], ...] | None = None

  # --- planning (static, from shapes) ---------------------------------------------------------------
  def buckets(self, leaves) -> tuple[list[int], list[list[int]]]:
    """(backward order of the leaves, buckets as lists of positions in that order)."""
    order = list(self.order) if self.order is not None else fusion_lib.backward_order(leaves)
    if self.fusion == "none":
      return order, [[i] for i in range(len(order))]
    if self.fusion == "adaptive":
      if self.groups is None:
        raise ValueError("fusion='adaptive' needs groups: build the reducer with cost_model.plan_adaptive_fusion")
      return order, [list(g) for g in self.groups]
    sizes = [math.prod(leaves[i].shape) * jnp.dtype(leaves[i].dtype).itemsize for i in order]
    return order, fusion_lib.plan_fixed_buckets(sizes, self.bucket_bytes)

  def compressed_size(self, elements: int) -> int:
    """Entries of the vector top-k runs on (and of its residual)."""
    return _round_up(elements, self.local) // self.local if self.strategy == "hitopk" else elements

  def is_compressed(self, elements: int) -> bool:
    return self.strategy in COMPRESSED_STRATEGIES and self.compressed_size(elements) >= self.min_compress_elements

  def _bucket_sizes(self, leaves) -> tuple[list[int], list[list[int]], list[int]]:
    order, buckets = self.buckets(leaves)
    sizes = [sum(math.prod(leaves[order[i]].shape) for i in bucket) for bucket in buckets]
    return order, buckets, sizes

  # --- state -------------------------------------------------------------------------------------
  def init_state(self, params: PyTree) -> dict[str, jax.Array]:
    """Zero residuals, {"bucket_i": float32 (nodes, local, compressed size)}, for compressed buckets."""
    _, _, sizes = self._bucket_sizes(jax.tree.leaves(params))
    return {_key(b): jnp.zeros((self.nodes, self.local, self.compressed_size(n)), jnp.float32)
            for b, n in enumerate(sizes) if self.is_compressed(n)}

  # --- the reduction (inside shard_map) ----------------------------------------------------------
  def reduce(self, local_grads: PyTree, comm_state: dict[str, jax.Array]) -> tuple[PyTree, dict[str, jax.Array]]:
    leaves, treedef = jax.tree.flatten(local_grads)
    order, buckets, sizes = self._bucket_sizes(leaves)
    new_state = {}
    summed: list[jax.Array | None] = [None] * len(leaves)
    for b, (bucket, size) in enumerate(zip(buckets, sizes)):
      members = [order[i] for i in bucket]
      flat = fusion_lib.pack([leaves[m] for m in members])
      if self.is_compressed(size):
        residual = comm_state[_key(b)][0, 0]   # this device's block of the (nodes, local, ...) array
        k = compression.num_selected(residual.size, self.density)
        flat, residual = COMPRESSED_STRATEGIES[self.strategy](flat, residual, k, self.selector, self.error_feedback,
                                                              jnp.dtype(self.wire_dtype))
        new_state[_key(b)] = residual[None, None]
      else:
        flat = DENSE_STRATEGIES[DENSE_FALLBACK.get(self.strategy, self.strategy)](flat, jnp.dtype(self.wire_dtype))
      for m, g in zip(members, fusion_lib.unpack(flat, [leaves[m] for m in members])):
        summed[m] = g
    num_devices = self.nodes * self.local
    return jax.tree.unflatten(treedef, [g / num_devices for g in summed]), new_state

  def bytes_per_step(self, params: PyTree) -> CommBytes:
    leaves = jax.tree.leaves(params)
    _, _, sizes = self._bucket_sizes(leaves)
    itemsize = jnp.dtype(leaves[0].dtype).itemsize
    wire = jnp.dtype(self.wire_dtype).itemsize
    total = CommBytes()
    for n in sizes:
      if self.is_compressed(n):
        k = compression.num_selected(self.compressed_size(n), self.density)
        total += strategy_bytes(self.strategy, n, itemsize, self.nodes, self.local, k, wire)
      else:
        total += strategy_bytes(DENSE_FALLBACK.get(self.strategy, self.strategy), n, itemsize, self.nodes,
                                self.local, wire_itemsize=wire)
    return total


def make_gradient_reducer(strategy: str, nodes: int, local: int, fusion: str = "none",
                          bucket_bytes: int = fusion_lib.DEFAULT_BUCKET_BYTES, **compression_options) -> GradientReducer:
  """A reducer for ``strategy``; ``compression_options`` are density, selector, error_feedback, ..."""
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown comm.strategy {strategy!r}; known: {list(STRATEGIES)}")
  if fusion not in FUSIONS:
    raise ValueError(f"unknown comm.fusion {fusion!r}; known: {', '.join(FUSIONS)}")
  return GradientReducer(strategy=strategy, nodes=nodes, local=local, fusion=fusion, bucket_bytes=bucket_bytes,
                         **compression_options)


def _key(bucket: int) -> str:
  return f"bucket_{bucket:03d}"


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple
