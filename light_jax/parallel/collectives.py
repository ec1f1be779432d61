"""Gradient all-reduce strategies over the (node, local) mesh, written as lax collectives.

Every function here runs *inside* ``jax.shard_map`` over both mesh axes and takes the device's
**local** gradient (not yet reduced; see ``train_step.py`` for how the step avoids JAX's implicit psum).

Dense strategies (``comm.strategy``), ``flat vector -> its sum over all devices``:
- ``dense``: one ``psum`` over (node, local); XLA/NCCL picks the algorithm (a flat ring or tree).
- ``hierarchical``: reduce-scatter over ``local`` (fast links), all-reduce of the 1/n shard over
  ``node`` (slow links), all-gather over ``local``. Only d/n elements per device cross machines.

Compressed strategies, ``(flat vector, residual) -> (approximate sum, new residual)`` (the residual is a
``compression.Memory`` with its velocity under DGC momentum correction, ``correction``):
- ``hitopk`` (HiTopKComm): reduce-scatter over ``local`` (dense), error feedback + top-k
  on the device's 1/n shard, all-gather of (values, int32 indices) over ``node`` among
  devices of the same local rank, scatter-add, all-gather over ``local``. The slow link carries 2k
  numbers per device instead of the shard.
- ``topk``: the flat baseline: error feedback + top-k of the whole vector on each device, all-gather
  of (values, indices) over every device, scatter-add.
- ``gtopk`` (gTop-k, Shi et al. ICDCS'19): error feedback + top-k on each
  device, then log2(P) rounds of recursive doubling: swap the k (value, index) pairs with the
  device whose linear index differs in bit r (``ppermute``), add the two sparse sets, keep the top-k of
  the sum. Partners compute the same set, so after the last round every device holds the same global
  index set G. The paper sends the merged partial sums and returns to each residual the values that
  missed G; here one k-element psum of every device's corrected gradient at G gives the exact sums
  instead, and the residual is the corrected gradient off G, so error feedback loses nothing (partial
  sums dropped in an early round would otherwise vanish). Needs a power-of-two device count.
hitopk and topk have an EF21 form (``comm.feedback="ef21"``, a ``compression.Estimate`` for state): they send top-k of
the change of each sender's momentum step and return the sum of every sender's estimate (``_add_to_total``).
The top-k strategies can send their pairs compact (``compact_pairs``: a bfloat16 value and a uint16 index,
``compression.pair_dtypes``); gTop-k only in its merge rounds, its sums at G stay float32.
Buckets too small to be worth compressing (``min_compress_elements``) go to the strategy's dense
fallback (``Strategy.dense_fallback`` in ``strategies.py``).

Each strategy's record (bytes per level, state size, dense fallback) is in ``strategies.py``; the
reducer that applies one to a whole gradient pytree, bucket by bucket, is ``reducer.py``. The algorithms
and their papers: docs/techniques.md sections 1 and 4.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from light_jax.parallel import compression
from light_jax.parallel.mesh import AXES, LOCAL, NODE


def _moved_as_bits(collective: Callable[..., jax.Array], x: jax.Array, *args, **kwargs) -> jax.Array:
  """``collective(x, ...)`` for a collective that only moves data (all-gather, all-to-all, ppermute), with a
  16-bit float ``x`` moved as its bits (uint16; exact). XLA's CPU backend widens 16-bit float collectives to
  float32, so the emulated links carried twice the bytes of bfloat16 hops and values; NCCL moves uint16 as
  16-bit words (docs/techniques.md section 1)."""
  if jnp.dtype(x.dtype).itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    return collective(x, *args, **kwargs)
  return lax.bitcast_convert_type(collective(lax.bitcast_convert_type(x, jnp.uint16), *args, **kwargs), x.dtype)


def dense_allreduce(x: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """Sum of flat ``x`` over every device with one psum (in ``wire_dtype``, which then also accumulates)."""
  return lax.psum(x.astype(wire_dtype), AXES).astype(x.dtype)


def _reduce_scatter(x: jax.Array, axis: str, wire_dtype) -> jax.Array:
  """Tiled reduce-scatter of flat ``x`` (size divisible by the axis size) over ``axis``.

  With a narrower ``wire_dtype`` the chunks travel in it (an all-to-all) and are summed in x's dtype
  on arrival, so the accumulation stays float32 while the link carries half the bytes.
  """
  if lax.axis_size(axis) == 1:  # nothing crosses a link: no rounding to the wire dtype either
    return x
  if jnp.dtype(wire_dtype) == x.dtype:
    return lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
  chunks = x.astype(wire_dtype).reshape(lax.axis_size(axis), -1)
  received = _moved_as_bits(lax.all_to_all, chunks, axis, split_axis=0, concat_axis=0)  # chunk i from every peer
  return received.astype(x.dtype).sum(axis=0)


def _all_gather(shard: jax.Array, axis: str, wire_dtype) -> jax.Array:
  if lax.axis_size(axis) == 1:  # nothing crosses a link: no rounding to the wire dtype either
    return shard
  return _moved_as_bits(lax.all_gather, shard.astype(wire_dtype), axis, axis=0, tiled=True).astype(shard.dtype)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def hierarchical_padded_size(elements: int, local: int, nodes: int, narrow_wire: bool) -> int:
  """The length ``hierarchical_reduce_to_shard`` zero-pads a flat vector of ``elements`` to: ``local`` equal
  shards, x ``nodes`` with a wire dtype narrower than the vector's (whose node all-reduce is then a
  reduce-scatter and an all-gather). The byte formulas and the sharded update lay out shards by it too."""
  return round_up(elements, local * (nodes if narrow_wire else 1))


def _scatter_to_local_shard(x: jax.Array, wire_dtype, padded_size: int) -> jax.Array:
  """Zero-pads flat ``x`` to ``padded_size`` (a multiple of ``local``) and reduce-scatters it over ``local``."""
  return _reduce_scatter(jnp.pad(x, (0, padded_size - x.size)), LOCAL, wire_dtype)


def hierarchical_allreduce(x: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """Sum of flat ``x`` over every device: reduce-scatter(local) -> all-reduce(node) -> all-gather(local)."""
  return gather_local_shards(hierarchical_reduce_to_shard(x, wire_dtype), wire_dtype)[: x.size]


def hierarchical_reduce_to_shard(x: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """This device's shard of the sum of flat ``x`` over every device: ``x`` zero-padded to ``local`` equal
  shards (x ``nodes`` with a narrower wire dtype), shard ``i`` on the device of local index ``i``."""
  narrow = jnp.dtype(wire_dtype) != x.dtype
  padded = hierarchical_padded_size(x.size, lax.axis_size(LOCAL), lax.axis_size(NODE), narrow)
  shard = _scatter_to_local_shard(x, wire_dtype, padded)  # this device's 1/n of the node's sum
  return _sum_over_nodes(shard, wire_dtype)


def _sum_over_nodes(shard: jax.Array, wire_dtype) -> jax.Array:
  """The all-reduce of a local shard over ``node``, the only inter-node traffic of the hierarchical reductions;
  with a narrower wire dtype a reduce-scatter and an all-gather, to accumulate in float32."""
  if jnp.dtype(wire_dtype) != shard.dtype:
    return _all_gather(_reduce_scatter(shard, NODE, wire_dtype), NODE, wire_dtype)
  return lax.psum(shard, NODE)


def machines_allreduce(x: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """Sum over the machines of flat ``x``, which every device of a machine holds the same (DiLoCo's change of the
  parameters): each device takes its own 1/local slice, with no reduce-scatter inside the machine (it would only
  add ``local`` copies), all-reduces it over ``node`` and all-gathers the slices over ``local``."""
  local = lax.axis_size(LOCAL)
  padded = hierarchical_padded_size(x.size, local, lax.axis_size(NODE), jnp.dtype(wire_dtype) != x.dtype)
  own = jnp.pad(x, (0, padded - x.size)).reshape(local, -1)[lax.axis_index(LOCAL)]
  return gather_local_shards(_sum_over_nodes(own, wire_dtype), wire_dtype)[: x.size]


def gather_local_shards(shard: jax.Array, wire_dtype=jnp.float32) -> jax.Array:
  """The shards of every device of the node, in local order (the padded flat vector)."""
  return _all_gather(shard, LOCAL, wire_dtype)


def hierarchical_topk_allreduce(
  x: jax.Array,
  residual: jax.Array | compression.Memory,
  k: int,
  selector: str,
  error_feedback: bool,
  wire_dtype=jnp.float32,
  correction: compression.MomentumCorrection | None = None,
  compact_pairs: bool = False,
) -> tuple[jax.Array, jax.Array | compression.Memory]:
  """HiTopK: dense inside the node, k (value, index) pairs per device across nodes.

  Args:
    x: flat local gradient (d,).
    residual: this device's error-feedback residual, the size of its local shard (ceil(d / n),).
    k: entries kept per shard.
    wire_dtype: dtype of the two dense intra-node hops; the sparse values cross nodes in float32 unless
      ``compact_pairs`` (bfloat16, the rounding kept in the residual).
  """
  shard, residual = hierarchical_topk_reduce_to_shard(
    x, residual, k, selector, error_feedback, wire_dtype, correction, compact_pairs
  )
  return _all_gather(shard, LOCAL, wire_dtype)[: x.size], residual


def hierarchical_topk_reduce_to_shard(
  x: jax.Array,
  residual: jax.Array | compression.Memory,
  k: int,
  selector: str,
  error_feedback: bool,
  wire_dtype=jnp.float32,
  correction: compression.MomentumCorrection | None = None,
  compact_pairs: bool = False,
) -> tuple[jax.Array, jax.Array | compression.Memory]:
  """HiTopK up to this device's shard of the (approximate) sum: ``x`` zero-padded to ``local`` shards."""
  shard = _scatter_to_local_shard(x, wire_dtype, round_up(x.size, lax.axis_size(LOCAL)))
  # (nodes x k) pairs: the same local rank's shard on every node
  return _top_k_sum(shard, residual, k, selector, error_feedback, correction, compact_pairs, NODE)


def _top_k_sum(
  x: jax.Array,
  residual: jax.Array | compression.Memory,
  k: int,
  selector: str,
  error_feedback: bool,
  correction: compression.MomentumCorrection | None,
  compact_pairs: bool,
  axis,
) -> tuple[jax.Array, jax.Array | compression.Memory]:
  """Each device's k pairs of ``x`` summed over ``axis``: the top-k after error feedback, or with EF21 the
  top-k change of the senders' estimates, which the pairs move; returns (the sum, the new residual or estimate)."""
  value_dtype, _ = compression.pair_dtypes(compact_pairs, x.dtype)
  if isinstance(residual, compression.Estimate):
    indices, values, estimate = compression.select_change(x, residual, k, selector, correction, value_dtype)
    return _add_to_total(estimate, indices, values, axis, compact_pairs)
  indices, values, residual = compression.apply_error_feedback(
    x, residual, k, selector, error_feedback, correction, value_dtype
  )
  return _sum_pairs(jnp.zeros_like(x), indices, values, axis, compact_pairs), residual


def _add_to_total(
  estimate: compression.Estimate, indices: jax.Array, values: jax.Array, axis, compact: bool
) -> tuple[jax.Array, compression.Estimate]:
  """EF21's reduction: every sender's pairs over ``axis`` added to the sum of the estimates; returns (that sum,
  the state holding it)."""
  total = estimate.total + _sum_pairs(jnp.zeros_like(estimate.total), indices, values, axis, compact)
  return total, estimate._replace(total=total)


def _pack_pairs(
  indices: jax.Array, values: jax.Array, size: int, compact: bool
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """One device's k pairs from a vector of ``size`` entries as they cross the wire: (indices, values, counts).

  Indices travel as int32, or ``compact`` as uint16: offsets inside 65,536-entry blocks, the pairs ordered by
  index, with an int32 count of pairs per block where ``size`` is longer (``compression.group_by_block``;
  counts is None otherwise). Values travel in the pair dtype (``compression.pair_dtypes``)."""
  value_dtype, index_dtype = compression.pair_dtypes(compact, values.dtype)
  counts = None
  blocks = compression.index_blocks(size, compact)
  if blocks:
    indices, values, counts = compression.group_by_block(indices, values, blocks)
  return indices.astype(index_dtype), values.astype(value_dtype), counts


def _sum_pairs(zeros: jax.Array, indices: jax.Array, values: jax.Array, axis, compact: bool) -> jax.Array:
  """All-gathers every device's (index, value) pairs over ``axis`` and adds them into ``zeros`` in its dtype
  (``_pack_pairs`` says how they travel); or, where pairs would cost more bytes than the whole vector
  (``compression.sparse_sum_bytes``), all-reduces the vector with each device's values in place."""
  senders = math.prod(lax.axis_size(a) for a in (axis if isinstance(axis, tuple) else (axis,)))
  _, dense = compression.sparse_sum_bytes(indices.size, zeros.size, compact, senders, zeros.dtype.itemsize)
  if dense:  # values rounded as their pairs would be (the residual kept the rounding), summed in zeros' dtype
    return lax.psum(zeros.at[indices].add(values.astype(zeros.dtype)), axis)
  indices, values, counts = _pack_pairs(indices, values, zeros.size, compact)
  all_indices = lax.all_gather(indices, axis).reshape(-1, indices.size)  # a row per sender
  if counts is not None:
    all_counts = lax.all_gather(counts, axis).reshape(-1, counts.size)
    all_indices = jax.vmap(compression.indices_from_blocks)(all_indices, all_counts)
  all_values = _moved_as_bits(lax.all_gather, values, axis).reshape(all_indices.shape).astype(zeros.dtype)
  # One scatter-add per sender, in sender order: a single one over every sender's pairs runs on GPU with
  # atomics, so the order of the addends at a shared index (and the sum's last bits) would differ between
  # devices and the replicas drift apart. A sender's own indices are distinct (its top-k), except mstopk's
  # padding on a non-finite vector, so no ``unique_indices``.
  rows = (all_indices.astype(jnp.int32), all_values)
  return lax.scan(lambda total, row: (total.at[row[0]].add(row[1]), None), zeros, rows)[0]


def topk_allreduce(
  x: jax.Array,
  residual: jax.Array | compression.Memory,
  k: int,
  selector: str,
  error_feedback: bool,
  wire_dtype=jnp.float32,
  correction: compression.MomentumCorrection | None = None,
  compact_pairs: bool = False,
) -> tuple[jax.Array, jax.Array | compression.Memory]:
  """Flat top-k: every device selects k entries of its whole gradient; all-gather over all devices.

  No dense hop, so ``wire_dtype`` does not apply."""
  del wire_dtype
  return _top_k_sum(x, residual, k, selector, error_feedback, correction, compact_pairs, AXES)


def gtopk_allreduce(
  x: jax.Array,
  residual: jax.Array | compression.Memory,
  k: int,
  selector: str,
  error_feedback: bool,
  wire_dtype=jnp.float32,
  correction: compression.MomentumCorrection | None = None,
  compact_pairs: bool = False,
) -> tuple[jax.Array, jax.Array | compression.Memory]:
  """gTop-k: recursive-doubling merge of the devices' top-k sets, then exact sums at the winners.

  Rounds whose partner distance is below ``local`` stay inside the node; the last log2(nodes) cross
  nodes, k (value, index) pairs each. No dense hop, so ``wire_dtype`` does not apply. With
  ``compact_pairs`` the rounds' pairs travel as bfloat16 values and uint16 indices (block offsets and
  counts in longer vectors): they only rank candidates, and each device merges the rounded values it sent,
  so partners still agree on one set; the sums at the winners stay exact float32.
  """
  del wire_dtype
  if isinstance(residual, compression.Estimate):
    raise ValueError("gtopk merges the devices' selections into one set; it has no EF21 form (comm.feedback)")
  value_dtype, _ = compression.pair_dtypes(compact_pairs, x.dtype)
  corrected, forget_sent = compression.compensate(x, residual, error_feedback, correction)
  select = compression.SELECTORS[selector]
  indices, values = select(corrected, k)
  num_devices = lax.axis_size(NODE) * lax.axis_size(LOCAL)
  for r in range(num_devices.bit_length() - 1):
    partner = [(i, i ^ (1 << r)) for i in range(num_devices)]  # linear index over (node, local)
    values = values.astype(value_dtype).astype(x.dtype)  # what the partner receives, merged alike on both sides
    sent_indices, sent_values, counts = _pack_pairs(indices, values, x.size, compact_pairs)
    their_indices = lax.ppermute(sent_indices, AXES, partner)
    their_values = _moved_as_bits(lax.ppermute, sent_values, AXES, partner).astype(x.dtype)
    if counts is not None:
      their_indices = compression.indices_from_blocks(their_indices, lax.ppermute(counts, AXES, partner))
    # Each index holds at most two addends, and a + b == b + a exactly: partners get the same set.
    merged = jnp.zeros_like(x).at[indices].add(values).at[their_indices.astype(jnp.int32)].add(their_values)
    indices, values = select(merged, k)
  summed = lax.psum(corrected[indices], AXES)  # exact sums at the global top-k set
  return jnp.zeros_like(x).at[indices].set(summed), forget_sent(indices)
