"""The gradient-reduction strategies (``comm.strategy``): one record each, in one registry.

A ``Strategy`` holds what the reducer, the byte accounting and the cost model know about a strategy, so
that they read its record rather than test its name (the features that only some strategies take are
listed by name where they are checked: EF21 and the sharded update in ``reducer.py`` and
``sharded_update.py``, checked by ``config.py``):

- ``reduce``: its collective (``collectives.py``), run inside ``shard_map`` on one flat bucket;
- ``bytes``: what one device sends per step, per link level, for one bucket (the ring model);
- for the compressed (top-k) strategies: ``topk_unit`` (the vector top-k runs on, which is also the
  size of the per-device error-feedback residual) and ``dense_fallback`` (the dense strategy for a
  bucket too small to compress);
- ``flat``: one collective spanning every device, so it runs at the pace of the slowest link;
- ``needs_power_of_two_devices``.

To add a strategy: write its collective in ``collectives.py``, its byte count here, and one
``Strategy(...)`` entry in ``REGISTRY``. The formulas: docs/techniques.md sections 1 and 4.

Byte accounting (``CommBytes``): bytes one device *sends* per step over each link level, from the shapes
alone, for ring algorithms (the ones NCCL and gloo use at these sizes). For a flat ring or all-gather
that spans several nodes, the devices at node boundaries send their whole traffic over the slow link and
set the pace, so that worst case is what ``dense`` and ``topk`` report as inter-node bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from light_jax.parallel import collectives, compression


@dataclasses.dataclass(frozen=True)
class CommBytes:
  """Bytes one device sends per training step, by link level."""

  intra_node: int = 0
  inter_node: int = 0

  def __add__(self, other: CommBytes) -> CommBytes:
    return CommBytes(self.intra_node + other.intra_node, self.inter_node + other.inter_node)


def ring_allreduce_bytes(num_bytes: int, group: int) -> int:
  """Bytes each member sends in a ring all-reduce of ``num_bytes`` over ``group`` members: 2(g-1)/g x M."""
  return 2 * (group - 1) * num_bytes // group if group > 1 else 0


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One flat bucket as the byte formulas see it: ``elements`` of ``itemsize`` bytes (``wire_itemsize``
  on the dense hops), on a ``nodes`` x ``local`` mesh; ``k`` entries kept by a top-k strategy, whose
  pairs are compact with ``compact_pairs`` (``compression.pair_dtypes``)."""

  elements: int
  itemsize: int
  nodes: int
  local: int
  k: int = 0
  wire_itemsize: int | None = None
  compact_pairs: bool = False

  @property
  def wire(self) -> int:
    return self.wire_itemsize or self.itemsize

  def pair_bytes(self, unit: int) -> int:
    """k (value, index) pairs of a top-k unit of ``unit`` entries: the gradient's dtype and int32, or
    compact (bfloat16 and uint16, with a count per 65,536-entry block above that size)."""
    return compression.pair_bytes(self.k, unit, self.compact_pairs, self.itemsize)

  def local_scatter_gather(self, padded_size: int) -> tuple[int, int]:
    """(elements of a device's local shard, bytes of the reduce-scatter + all-gather over ``local``) of the
    vector zero-padded to ``padded_size``."""
    shard = padded_size // self.local
    return shard, 2 * (self.local - 1) * shard * self.wire


def _on_both_levels(b: Buffer, per_device: int) -> CommBytes:
  """A flat collective over every device: its traffic crosses whichever levels the mesh has."""
  return CommBytes(intra_node=per_device if b.local > 1 else 0, inter_node=per_device if b.nodes > 1 else 0)


def dense_bytes(b: Buffer) -> CommBytes:
  return _on_both_levels(b, ring_allreduce_bytes(b.elements * b.wire, b.nodes * b.local))


def hierarchical_bytes(b: Buffer) -> CommBytes:
  # A narrower wire dtype pads to local x nodes: the node all-reduce becomes reduce-scatter + all-gather.
  narrow = b.wire != b.itemsize
  shard, intra = b.local_scatter_gather(collectives.hierarchical_padded_size(b.elements, b.local, b.nodes, narrow))
  return CommBytes(intra_node=intra, inter_node=ring_allreduce_bytes(shard * b.wire, b.nodes))


def hitopk_bytes(b: Buffer) -> CommBytes:
  # All-gather over `node` of k (value, index) pairs: (N-1) x k x 8 bytes per device (4 compact, + block counts),
  # or an all-reduce of the shard where that costs less (compression.sparse_sum_bytes).
  shard, intra = b.local_scatter_gather(collectives.round_up(b.elements, b.local))
  inter, _ = compression.sparse_sum_bytes(b.k, shard, b.compact_pairs, b.nodes, b.itemsize)
  return CommBytes(intra_node=intra, inter_node=inter)


def topk_bytes(b: Buffer) -> CommBytes:
  return _on_both_levels(
    b, compression.sparse_sum_bytes(b.k, b.elements, b.compact_pairs, b.nodes * b.local, b.itemsize)[0]
  )


def gtopk_bytes(b: Buffer) -> CommBytes:
  # log2(local) rounds inside the node and log2(nodes) across, k pairs each (both are powers of two; compact
  # or not), then a ring all-reduce of k exact sums over every device (in the gradient's dtype).
  pairs = b.pair_bytes(b.elements)
  sums = dense_bytes(Buffer(b.k, b.itemsize, b.nodes, b.local))
  return CommBytes(
    intra_node=(b.local.bit_length() - 1) * pairs + sums.intra_node,
    inter_node=(b.nodes.bit_length() - 1) * pairs + sums.inter_node,
  )


def one_selection(devices: int) -> int:
  del devices
  return 1


def gtopk_selections(devices: int) -> int:
  # Top-k of the corrected vector, then again of the merged (full-size) vector after each of log2(P) rounds.
  return devices.bit_length()


def whole_bucket(elements: int, local: int) -> int:
  del local
  return elements


def local_shard(elements: int, local: int) -> int:
  return collectives.round_up(elements, local) // local


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One gradient-reduction strategy.

  Attributes:
    name: the ``comm.strategy`` value.
    reduce: dense: ``(flat, wire_dtype) -> flat sum``; compressed: ``(flat, residual, k, selector,
      error_feedback, wire_dtype, correction, compact_pairs) -> (approximate flat sum, new residual)``.
      Inside shard_map.
    bytes: ``Buffer -> CommBytes``, per device per step for one bucket.
    compressed: keeps k entries per ``topk_unit`` and a per-device residual of that size.
    topk_unit: ``(bucket elements, local) -> elements`` top-k runs on.
    dense_fallback: compressed strategies: the strategy for buckets whose top-k unit is below
      ``comm.min_compress_elements``.
    flat: one collective over every device, paced by the slowest link (not a sum of the two levels).
    needs_power_of_two_devices: the algorithm pairs devices by the bits of their index.
    compact_pairs: compressed strategies that can send their pairs compact (``comm.compact_pairs``).
    selections: compressed strategies: ``devices -> `` top-k selections of a whole ``topk_unit`` each device
      runs per step (the simulator charges each).
  """

  name: str
  reduce: Callable
  bytes: Callable[[Buffer], CommBytes]
  compressed: bool = False
  topk_unit: Callable[[int, int], int] = whole_bucket
  dense_fallback: str | None = None
  flat: bool = False
  needs_power_of_two_devices: bool = False
  compact_pairs: bool = False
  selections: Callable[[int], int] = one_selection


REGISTRY: dict[str, Strategy] = {
  s.name: s
  for s in (
    Strategy("dense", collectives.dense_allreduce, dense_bytes, flat=True),
    Strategy("hierarchical", collectives.hierarchical_allreduce, hierarchical_bytes),
    Strategy(
      "hitopk",
      collectives.hierarchical_topk_allreduce,
      hitopk_bytes,
      compressed=True,
      topk_unit=local_shard,
      dense_fallback="hierarchical",
      compact_pairs=True,
    ),
    Strategy(
      "topk",
      collectives.topk_allreduce,
      topk_bytes,
      compressed=True,
      dense_fallback="dense",
      flat=True,
      compact_pairs=True,
    ),
    Strategy(
      "gtopk",
      collectives.gtopk_allreduce,
      gtopk_bytes,
      compressed=True,
      dense_fallback="dense",
      needs_power_of_two_devices=True,
      compact_pairs=True,
      selections=gtopk_selections,
    ),
  )
}
NAMES = tuple(REGISTRY)


def device_count_error(name: str, nodes: int, local: int) -> str | None:
  """Why strategy ``name`` cannot run on a ``nodes`` x ``local`` mesh, or None if it can."""
  devices = nodes * local
  if not (get(name).needs_power_of_two_devices and devices & (devices - 1)):
    return None
  others = [s.name for s in REGISTRY.values() if s.compressed and not s.needs_power_of_two_devices]
  return (
    f"comm.strategy={name!r} pairs devices by the bits of their index and needs "
    f"a power-of-two device count, not {nodes} x {local} = {devices}; use {' or '.join(map(repr, others))}, "
    f"or a mesh of {1 << (devices.bit_length() - 1)} devices."
  )


def get(name: str) -> Strategy:
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown comm.strategy {name!r}; known: {list(NAMES)}") from None


def sends_compact_pairs(name: str) -> bool:
  """Whether ``name`` is a strategy that can send its top-k pairs compact (``comm.compact_pairs``)."""
  return name in REGISTRY and REGISTRY[name].compact_pairs


def strategy_bytes(
  name: str, elements: int, itemsize: int, nodes: int, local: int, k: int = 0, wire_itemsize: int | None = None
) -> CommBytes:
  """Exact per-device bytes of reducing one flat buffer of ``elements`` with strategy ``name`` (ring model).

  ``k`` is the number of entries a compressed strategy keeps per ``topk_unit``; ``wire_itemsize`` is the
  element size on the dense hops (default ``itemsize``).
  """
  return get(name).bytes(Buffer(elements, itemsize, nodes, local, k, wire_itemsize))
