"""The sharded update (``optimizer.sharded_update``): each device updates only the part it owns.

After the hierarchical reduction's reduce-scatter over ``local`` and all-reduce over ``node``, device i of a
machine holds shard i of every bucket's summed gradient. Instead of gathering the gradient and updating
all parameters on every device, each device applies the optimizer to its shard (its slice of the packed
parameters, its slice of the optimizer state) and the all-gather over ``local`` carries the updates (each
device then adds them to its replicated parameters). The same bytes on both links, but for LARS's norms (a
psum over ``local`` of two floats per tensor); optimizer state and update work per device divided by
``local`` (replicated over ``node``: every machine updates the same shards).

LARS needs whole-tensor norms, and a shard holds pieces of several tensors: each device sums the squares
of its pieces (one static slice per piece; which pieces a device holds is known when tracing, so a
``lax.switch`` on the local index picks its device's slicing) and one small psum over ``local`` of the
per-tensor sums completes them: the fused norms of Light's "parallel tensor operator". (A segment sum with
each position's tensor found by ``searchsorted`` does the same in one op, but both are scatters and
searches over the whole shard: 0.8 s per 5.8M-element shard on this CPU, against 5 ms for the slices.) SGD and
LARS (both trust forms) are supported, with the hierarchical and hitopk strategies (hitopk's scatter-add
leaves the same shard; with ``comm.fusion="adaptive"`` hitopk only, whose buckets are planned once before the
run: a dense strategy's are planned again for each phase, and the shards with them); the optimizer state lives in
each device's ``comm_state["optimizer"]``.
docs/techniques.md section 14.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax import lax

from light_jax import optim
from light_jax.parallel import collectives, compression, strategies
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import LOCAL, per_device, this_device
from light_jax.parallel.reducer import GradientReducer

PyTree = Any
OPTIMIZERS = ("sgd", "lars")
STRATEGIES = ("hierarchical", "hitopk")


@dataclasses.dataclass(frozen=True)
class Piece:
  """The part of one tensor in one device's shard: ``size`` elements of leaf ``leaf`` from its flat
  element ``start``, at ``offset`` in the shard."""

  leaf: int
  start: int
  offset: int
  size: int


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One bucket's layout: its tensors (leaf indices) back to back, padded into ``local`` shards."""

  members: tuple[int, ...]
  shard: int  # elements per device
  pieces: tuple[tuple[Piece, ...], ...]  # per local device: its shard's pieces, in order (then padding)


def split_into_shards(members: tuple[int, ...], sizes: list[int], shard: int, local: int) -> Bucket:
  """The bucket of tensors ``members`` (of ``sizes`` elements) back to back, cut into ``local`` shards."""
  pieces = []
  for device in range(local):
    low, high = device * shard, (device + 1) * shard
    mine, begin = [], 0
    for m, size in zip(members, sizes):
      first, last = max(low, begin), min(high, begin + size)  # the tensor's overlap with the shard
      if first < last:
        mine.append(Piece(m, first - begin, first - low, last - first))
      begin += size
    pieces.append(tuple(mine))
  return Bucket(members, shard, tuple(pieces))


@dataclasses.dataclass(frozen=True)
class ShardedUpdate:
  """Hierarchical (or hitopk) reduction to shards, the optimizer on each device's shards, the updates gathered.

  ``apply`` updates the parameters itself (like DiLoCo's), so the train step calls it instead of the
  optimizer; ``init_optimizer_state`` is then empty and the state is per device in ``comm_state``.
  """

  base: GradientReducer
  opt: ml_collections.ConfigDict
  schedule: Any
  momentum: Any
  num_leaves: int
  buckets: tuple[Bucket, ...]
  decays: tuple[bool, ...]  # per leaf: weight decay and trust ratio (optim.decay_mask)
  decay: bool = True  # False: the weight decay ran before the reduction (optim.decay_before_reduction)
  strategy: str = "hierarchical"
  updates_parameters = True  # the train step calls apply, not the optimizer

  @property
  def compression(self) -> str:
    """For the log: the reduction's compression (hitopk's density) too."""
    return f"sharded update, {self.base.compression}" if self.base.compression else "sharded update"

  def at_density(self, density: float) -> ShardedUpdate:
    """The same, with hitopk's k at ``density`` (the density warm-up); the shard layout does not change."""
    return dataclasses.replace(self, base=self.base.at_density(density))

  # --- the optimizer on shards ------------------------------------------------------------------------
  @property
  def _tail(self) -> optax.GradientTransformation:
    """What follows the weight decay (and LARS's trust ratio), elementwise, in build_optimizer's order:
    SGD's momentum then learning rate (optax.sgd), LARS's learning rate then momentum (optax.lars)."""
    momentum = optim.momentum_transform(self.momentum, self.opt.nesterov)
    learning_rate = optax.scale_by_learning_rate(self.schedule)
    return optax.chain(momentum, learning_rate) if self.opt.name == "sgd" else optax.chain(learning_rate, momentum)

  def _on_device(self, b: int, fn, *operands) -> jax.Array:
    """``fn(pieces, shard, *operands)`` with the pieces of this device's shard of bucket ``b``."""
    bucket = self.buckets[b]
    branches = [functools.partial(fn, pieces, bucket.shard) for pieces in bucket.pieces]
    return lax.switch(lax.axis_index(LOCAL), branches, *operands)

  def _direction(self, grads: list[jax.Array], params: list[jax.Array]) -> list[jax.Array]:
    """g + wd w on the decayed tensors, times LARS's trust ratio per tensor: per bucket one branch for the
    sums of squares of this device's pieces, one psum over ``local`` of them all, one branch for the result
    (few branches: each branch's output is materialised, so the per-piece work stays inside them)."""
    # decay=False: LARS's trust ratio ran before the reduction with its weight decay (as build_optimizer's).
    wd, lars = (self.opt.weight_decay, self.opt.name == "lars") if self.decay else (0.0, False)
    ratios = jnp.ones((self.num_leaves,), jnp.float32)
    if lars:
      # Rows: |w|^2 and |g + wd w|^2 (optax's form) or |g|^2 (MLPerf's), per decayed leaf.
      sums = functools.partial(_sums_of_squares, decays=self.decays, wd=wd if self.opt.lars_trust == "optax" else 0.0)
      local_sums = sum(self._on_device(b, sums, g, w) for b, (g, w) in enumerate(zip(grads, params)))
      norms = jnp.sqrt(lax.psum(local_sums, LOCAL))
      ratios = optim.lars_ratio(self.opt.lars_trust, self.opt.lars_eta, wd, norms[0], norms[1])
    scale = functools.partial(_decay_and_scale, decays=self.decays, wd=wd)
    return [self._on_device(b, scale, g, w, ratios) for b, (g, w) in enumerate(zip(grads, params))]

  # --- state -------------------------------------------------------------------------------------
  def init_optimizer_state(self, params: PyTree) -> PyTree:
    return optax.EmptyState()

  def init_state(self, params: PyTree) -> dict[str, PyTree]:
    """The base reducer's residuals (hitopk), and the optimizer state of this device's shards."""
    local = self.base.local
    shards = {_key(b): jnp.zeros((bucket.shard,), jnp.float32) for b, bucket in enumerate(self.buckets)}
    state = jax.tree.map(
      lambda x: jnp.broadcast_to(x, (self.base.nodes, local, *jnp.shape(x))), self._tail.init(shards)
    )
    return self.base.init_state(params) | {"optimizer": state}

  def rescale_residuals(self, comm_state: PyTree, factor: jax.Array) -> PyTree:
    """The base reducer's residuals times ``factor``; the optimizer state untouched."""
    residuals = {k: v for k, v in comm_state.items() if k != "optimizer"}
    return self.base.rescale_residuals(residuals, factor) | {"optimizer": comm_state["optimizer"]}

  # --- one step (inside shard_map) ---------------------------------------------------------------
  def reduce(self, local_grads: PyTree, comm_state: PyTree) -> tuple[PyTree, PyTree]:
    """This device's shard of each bucket's mean gradient, {bucket key: (shard,)}: the hierarchical
    reduction, or hitopk's (with its residuals) for the buckets it compresses."""
    base = self.base
    if base.local_clip_norm:
      local_grads = compression.clip_local(local_grads, base.local_clip_norm, base.nodes * base.local)
    leaves = jax.tree.leaves(local_grads)
    wire = jnp.dtype(base.wire_dtype)
    shards, comm_state = {}, dict(comm_state)
    for b, bucket in enumerate(self.buckets):
      # float32 whatever the gradients' dtype: sharded_update lays out the shards of a float32 vector.
      flat = fusion_lib.pack([leaves[m] for m in bucket.members]).astype(jnp.float32)
      if base.strategy_for_size(flat.size).compressed:
        memory = this_device(comm_state[_key(b)])
        shard, memory = collectives.hierarchical_topk_reduce_to_shard(
          flat,
          memory,
          base.k_for(flat.size),
          base.selector,
          base.error_feedback,
          wire,
          base.correction,
          base.compact_pairs,
        )
        comm_state[_key(b)] = per_device(memory)
      else:
        if base.momentum_correction:
          flat, comm_state[_key(b)] = base.dense_momentum(flat, comm_state[_key(b)])
        shard = collectives.hierarchical_reduce_to_shard(flat, wire)
      shards[_key(b)] = shard / (base.nodes * base.local)
    return shards, comm_state

  def machine_params(self, params: PyTree, comm_state: PyTree) -> PyTree:
    """The replicated parameters: every device runs its forward pass on them."""
    return params

  def apply(
    self, grads: PyTree, params: PyTree, opt_state: PyTree, comm_state: PyTree, step=None, record_boundaries=()
  ):
    """The optimizer on this device's shards; returns (all parameters, opt_state, comm_state). (``step`` and
    ``record_boundaries``: the interface DiLoCo shares; unused here.)"""
    leaves, treedef = jax.tree.flatten(params)
    param_shards = [self._on_device(b, _take_pieces, leaves) for b in range(len(self.buckets))]
    grad_shards = [grads[_key(b)] for b in range(len(self.buckets))]
    direction = dict(zip(grads, self._direction(grad_shards, param_shards)))
    state = this_device(comm_state["optimizer"])
    updates, state = self._tail.update(direction, state, dict(zip(grads, param_shards)))
    new = list(leaves)
    wire = jnp.dtype(self.base.wire_dtype)
    for b, bucket in enumerate(self.buckets):
      # The updates cross the wire, not the new parameters: at a narrow wire dtype the parameters would be
      # rounded to it every step (an update below half a bfloat16 step would vanish). Every device adds the
      # same gathered update to the same parameters, so the replicas stay equal.
      update = collectives.gather_local_shards(updates[_key(b)], wire).astype(jnp.float32)
      members = [leaves[m] for m in bucket.members]
      for m, u in zip(bucket.members, fusion_lib.unpack(update, members)):
        new[m] = (leaves[m] + u).astype(leaves[m].dtype)
    comm_state = dict(comm_state, optimizer=per_device(state))
    return jax.tree.unflatten(treedef, new), opt_state, comm_state

  def after_step(self, params: PyTree, opt_state: PyTree, comm_state: PyTree, step=None, record_boundaries=()):
    """Nothing after the step (DiLoCo's outer step goes here)."""
    return params, opt_state, comm_state

  # --- accounting: the hierarchical reduction's, and LARS's norms ---------------------------------
  def bucket_plan(self, params: PyTree):
    return self.base.bucket_plan(params)

  def bytes_per_step(self, params: PyTree) -> strategies.CommBytes:
    """The reduction's bytes (the all-gather of the updates replaces the reduction's own), plus with LARS the
    psum over ``local`` of two float32 sums of squares per tensor (``_direction``)."""
    comm = self.base.bytes_per_step(params)
    if self.opt.name == "lars" and self.decay:
      comm += strategies.CommBytes(intra_node=strategies.ring_allreduce_bytes(2 * self.num_leaves * 4, self.base.local))
    return comm


def sharded_update(
  base: GradientReducer, params: PyTree, opt: ml_collections.ConfigDict, schedule, momentum, decay: bool = True
) -> ShardedUpdate:
  """The sharded update of ``base``'s buckets for ``params`` (shapes suffice) with the optimizer ``opt``;
  ``decay=False`` leaves out the weight decay and LARS's trust ratio, which ran before the reduction (as
  ``build_optimizer``'s)."""
  if base.strategy not in STRATEGIES:
    raise ValueError(f"optimizer.sharded_update needs comm.strategy in {STRATEGIES}, not {base.strategy!r}")
  if opt.name not in OPTIMIZERS:
    raise ValueError(f"optimizer.sharded_update supports {OPTIMIZERS}, not {opt.name!r}")
  leaves = jax.tree.leaves(params)
  order, groups = base.buckets(leaves)
  # float32, not the gradients' dtype: ShardedUpdate.reduce packs every bucket in float32 whatever the gradients'
  # dtype, and the collective pads by the wire dtype against the vector it is given.
  narrow = jnp.dtype(base.wire_dtype) != jnp.float32
  buckets = []
  for group in groups:
    members = tuple(order[i] for i in group)
    sizes = [math.prod(leaves[m].shape) for m in members]
    # The shard layout of the bucket's collective: a dense bucket's as the hierarchical reduction pads it, a
    # hitopk bucket's into plain local shards (hitopk pads so whatever the wire dtype).
    dense = not base.strategy_for_size(sum(sizes)).compressed
    padded = collectives.hierarchical_padded_size(sum(sizes), base.local, base.nodes, narrow and dense)
    buckets.append(split_into_shards(members, sizes, padded // base.local, base.local))
  decays = tuple(bool(d) for d in jax.tree.leaves(optim.decay_mask(params)))
  return ShardedUpdate(base, opt, schedule, momentum, len(leaves), tuple(buckets), decays, decay)


def _key(bucket: int) -> str:
  return f"bucket_{bucket:03d}"


# The branches of ShardedUpdate._on_device: one device's static pieces of a shard of ``shard`` elements.
def _take_pieces(pieces: tuple[Piece, ...], shard: int, leaves: list[jax.Array]) -> jax.Array:
  """This device's shard of the packed tensors ``leaves``: its pieces back to back, then zero padding."""
  parts = [leaves[p.leaf].reshape(-1)[p.start : p.start + p.size].astype(jnp.float32) for p in pieces]
  return jnp.concatenate([*parts, jnp.zeros((shard - sum(p.size for p in pieces),), jnp.float32)])


def _sums_of_squares(
  pieces: tuple[Piece, ...], shard: int, g: jax.Array, w: jax.Array, decays: tuple[bool, ...], wd: float
) -> jax.Array:
  """(2, leaves): per decayed leaf, the sums of squares of its pieces of ``w`` and of ``g + wd w`` (0 for
  leaves not in this shard or not decayed)."""
  sums = jnp.zeros((2, len(decays)), jnp.float32)
  for p in pieces:
    if decays[p.leaf]:
      w_piece, g_piece = w[p.offset : p.offset + p.size], g[p.offset : p.offset + p.size]
      sums = sums.at[:, p.leaf].set(
        jnp.stack([jnp.sum(jnp.square(w_piece)), jnp.sum(jnp.square(g_piece + wd * w_piece))])
      )
  return sums


def _decay_and_scale(
  pieces: tuple[Piece, ...],
  shard: int,
  g: jax.Array,
  w: jax.Array,
  ratios: jax.Array,
  decays: tuple[bool, ...],
  wd: float,
) -> jax.Array:
  """Per piece: ``ratio x (g + wd w)`` for a decayed leaf, ``g`` for the others (and the padding)."""
  parts = []
  for p in pieces:
    g_piece, w_piece = g[p.offset : p.offset + p.size], w[p.offset : p.offset + p.size]
    parts.append(ratios[p.leaf] * (g_piece + wd * w_piece) if decays[p.leaf] else g_piece)
  used = sum(p.size for p in pieces)
  return jnp.concatenate([*parts, g[used:]])
