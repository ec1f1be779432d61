"""The sharded update (``optimizer.sharded_update``): each device updates only the part it owns.

After the hierarchical reduction's reduce-scatter over ``local`` and all-reduce over ``node``, device i of a
machine holds shard i of every bucket's summed gradient. Instead of gathering the gradient and updating
all parameters on every device, each device applies the optimizer to its shard (its slice of the packed
parameters, its slice of the optimizer state) and the all-gather over ``local`` carries the updated
parameters. Same bytes on both links; optimizer state and update work per device divided by ``local``
(replicated over ``node``: every machine updates the same shards).

LARS needs whole-tensor norms, and a shard holds pieces of several tensors: the squares of the shard are
summed per tensor with one segment sum (the tensor of each position from the bucket's offsets) and one
small psum over ``local`` completes them: the fused norms of Light's "parallel tensor operator". SGD and
LARS (both trust forms) are supported, with the hierarchical and hitopk strategies (hitopk's scatter-add
leaves the same shard); the optimizer state lives in each device's ``comm_state["optimizer"]``.
docs/techniques.md section 14.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax

from light_jax import optim
from light_jax.parallel import collectives, compression
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import LOCAL
from light_jax.parallel.reducer import GradientReducer

PyTree = Any
OPTIMIZERS = ("sgd", "lars")
STRATEGIES = ("hierarchical", "hitopk")


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One bucket's layout: its tensors (leaf indices) back to back, padded into ``local`` shards."""

  members: tuple[int, ...]
  ends: tuple[int, ...]  # cumulative sizes: member j fills [ends[j-1], ends[j])
  shard: int  # elements per device


@dataclasses.dataclass(frozen=True)
class ShardedUpdate:
  """Hierarchical (or hitopk) reduction to shards, the optimizer on each device's shards, parameters gathered.

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
  strategy: str = "hierarchical"
  updates_parameters = True  # the train step calls apply, not the optimizer
  keeps_residuals: bool = True
  compression: str = "sharded update"

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

  def _segments(self, b: int) -> jax.Array:
    """The leaf index of each position of this device's shard of bucket ``b`` (``num_leaves`` on padding)."""
    bucket = self.buckets[b]
    positions = lax.axis_index(LOCAL) * bucket.shard + jnp.arange(bucket.shard)
    member = jnp.searchsorted(jnp.asarray(bucket.ends), positions, side="right")
    return jnp.asarray((*bucket.members, self.num_leaves))[member]

  def _tensor_norms(self, shards: list[jax.Array], segments: list[jax.Array]) -> jax.Array:
    """Whole-tensor norms from every device's shards: segment sums here, one psum over ``local``."""
    sums = sum(jax.ops.segment_sum(x * x, s, num_segments=self.num_leaves + 1) for x, s in zip(shards, segments))
    return jnp.sqrt(lax.psum(sums, LOCAL))

  def _direction(self, grads: list[jax.Array], params: list[jax.Array]) -> list[jax.Array]:
    """g + wd w on the decayed tensors, times LARS's trust ratio per tensor."""
    segments = [self._segments(b) for b in range(len(self.buckets))]
    decays = jnp.asarray((*self.decays, False))
    wd = self.opt.weight_decay
    decayed = [g + wd * decays[s] * w for g, w, s in zip(grads, params, segments)]
    if self.opt.name == "sgd":
      return decayed
    other = decayed if self.opt.lars_trust == "optax" else grads
    ratios = optim.lars_ratio(
      self.opt.lars_trust,
      self.opt.lars_eta,
      wd,
      self._tensor_norms(params, segments),
      self._tensor_norms(other, segments),
    )
    ratios = jnp.where(decays, ratios, 1.0)
    return [ratios[s] * d for d, s in zip(decayed, segments)]

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

  # --- one step (inside shard_map) ---------------------------------------------------------------
  def reduce(self, local_grads: PyTree, comm_state: PyTree) -> tuple[PyTree, PyTree]:
    """This device's shard of each bucket's mean gradient, {bucket key: (shard,)}: the hierarchical
    reduction, or hitopk's (with its residuals) for the buckets it compresses."""
    base = self.base
    if base.local_clip_norm:
      local_grads = compression.clip_to_norm(local_grads, base.local_clip_norm / math.sqrt(base.nodes * base.local))
    leaves = jax.tree.leaves(local_grads)
    wire = jnp.dtype(base.wire_dtype)
    shards, comm_state = {}, dict(comm_state)
    for b, bucket in enumerate(self.buckets):
      flat = fusion_lib.pack([leaves[m] for m in bucket.members]).astype(jnp.float32)
      if base.bucket_strategy(flat.size).compressed:
        memory = jax.tree.map(lambda x: x[0, 0], comm_state[_key(b)])
        shard, memory = collectives.hierarchical_topk_reduce_to_shard(
          flat, memory, base.k_for(flat.size), base.selector, base.error_feedback, wire, base.momentum_correction
        )
        comm_state[_key(b)] = jax.tree.map(lambda x: x[None, None], memory)
      else:
        shard = collectives.hierarchical_reduce_to_shard(flat, wire)
      shards[_key(b)] = shard / (base.nodes * base.local)
    return shards, comm_state

  def apply(self, grads: PyTree, params: PyTree, opt_state: PyTree, comm_state: PyTree, sync=None):
    """The optimizer on this device's shards; returns (all parameters, opt_state, comm_state)."""
    leaves, treedef = jax.tree.flatten(params)
    index = lax.axis_index(LOCAL)
    param_shards = []
    for bucket in self.buckets:
      flat = fusion_lib.pack([leaves[m] for m in bucket.members]).astype(jnp.float32)
      flat = jnp.pad(flat, (0, bucket.shard * self.base.local - flat.size))
      param_shards.append(lax.dynamic_slice(flat, (index * bucket.shard,), (bucket.shard,)))
    grad_shards = [grads[_key(b)] for b in range(len(self.buckets))]
    direction = dict(zip(grads, self._direction(grad_shards, param_shards)))
    state = jax.tree.map(lambda x: x[0, 0], comm_state["optimizer"])
    updates, state = self._tail.update(direction, state, dict(zip(grads, param_shards)))
    new = list(leaves)
    wire = jnp.dtype(self.base.wire_dtype)
    for b, (bucket, p) in enumerate(zip(self.buckets, param_shards)):
      full = collectives.gather_local_shards(p + updates[_key(b)], wire)
      members = [leaves[m] for m in bucket.members]
      for m, x in zip(bucket.members, fusion_lib.unpack(full, members)):
        new[m] = x.astype(leaves[m].dtype)
    comm_state = dict(comm_state, optimizer=jax.tree.map(lambda x: x[None, None], state))
    return jax.tree.unflatten(treedef, new), opt_state, comm_state

  # --- accounting: the hierarchical reduction's --------------------------------------------------
  def bucket_plan(self, params: PyTree):
    return self.base.bucket_plan(params)

  def bytes_per_step(self, params: PyTree):
    return self.base.bytes_per_step(params)


def sharded_update(
  base: GradientReducer, params: PyTree, opt: ml_collections.ConfigDict, schedule, momentum
) -> ShardedUpdate:
  """The sharded update of ``base``'s buckets for ``params`` (shapes suffice) with the optimizer ``opt``."""
  if base.strategy not in STRATEGIES:
    raise ValueError(f"optimizer.sharded_update needs comm.strategy in {STRATEGIES}, not {base.strategy!r}")
  if opt.name not in OPTIMIZERS:
    raise ValueError(f"optimizer.sharded_update supports {OPTIMIZERS}, not {opt.name!r}")
  leaves = jax.tree.leaves(params)
  order, groups = base.buckets(leaves)
  narrow = jnp.dtype(base.wire_dtype) != jnp.float32
  buckets = []
  for group in groups:
    members = tuple(order[i] for i in group)
    sizes = [math.prod(leaves[m].shape) for m in members]
    # The shard layout of the bucket's collective: hierarchical pads to local x nodes for a narrow wire.
    dense = not base.bucket_strategy(sum(sizes)).compressed
    multiple = base.local * (base.nodes if narrow and dense else 1)
    padded = -(-sum(sizes) // multiple) * multiple
    buckets.append(Bucket(members, tuple(int(e) for e in np.cumsum(sizes)), padded // base.local))
  decays = tuple(bool(d) for d in jax.tree.leaves(optim.decay_mask(params)))
  return ShardedUpdate(base, opt, schedule, momentum, len(leaves), tuple(buckets), decays)


def _key(bucket: int) -> str:
  return f"bucket_{bucket:03d}"
