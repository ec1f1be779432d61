"""``GradientReducer``: a strategy (``strategies.py``) applied to a whole gradient pytree, bucket by bucket.

Local gradients are packed into buckets (``fusion.py``), each bucket is reduced by the strategy's
collective (or its dense fallback when too small to compress), and the sums are divided by the device
count, so the result is the mean gradient over the global batch. The residuals of the compressed
strategies are ``comm_state``: one float32 vector per compressed bucket per device (with DGC momentum
correction a ``compression.Memory`` of two, residual and velocity, and a velocity for each dense bucket; with
EF21 a ``compression.Estimate`` of three instead of the ``Memory``), carried in the train state with leading
dims (nodes, local), sharded over both mesh axes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from light_jax.parallel import compression, diloco, powersgd, strategies
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import per_device, this_device
from light_jax.parallel.strategies import CommBytes

PyTree = Any
FUSIONS = ("none", "fixed", "adaptive")
AUTO = "auto"  # comm.strategy: a strategy per bucket, chosen by the cost model (cost_model.plan_auto)
POWERSGD = powersgd.NAME  # comm.strategy: rank-r compression of whole tensors (powersgd.PowerSGDReducer)
DILOCO = diloco.NAME  # comm.strategy: local steps in each machine, an outer step across machines (diloco.DiLoCo)
STRATEGIES = (*strategies.NAMES, POWERSGD, DILOCO, AUTO)  # every comm.strategy
# comm.feedback: what the top-k strategies keep of what they did not send. "residual": error feedback (sent
# later); "ef21": an estimate per entry, applied whole every step (compression.select_change).
FEEDBACKS = ("residual", "ef21")
EF21_STRATEGIES = ("hitopk", "topk")  # gtopk merges the devices' selections into one set: no estimate per sender


def may_select_top_k(strategy: str) -> bool:
  """Whether ``strategy`` selects top-k entries (hitopk, topk, gtopk) or may (auto, for its buckets): the
  strategies with a density, and with residuals that fix their buckets for a run."""
  return strategy == AUTO or (strategy in strategies.NAMES and strategies.get(strategy).compressed)


def takes_compact_pairs(strategy: str) -> bool:
  """Whether comm.compact_pairs applies to ``strategy``: the top-k strategies, and auto (for its buckets of those)."""
  return strategy == AUTO or strategies.sends_compact_pairs(strategy)


@dataclasses.dataclass(frozen=True)
class GradientReducer:
  """Turns local gradients into the mean gradient over all devices, bucket by bucket.

  ``reduce`` runs inside shard_map; ``init_state`` gives the per-device residuals of the compressed
  buckets (empty for the dense strategies); ``bytes_per_step`` is the exact traffic per device.

  Attributes:
    strategy: a name in ``strategies.REGISTRY``, or "auto" (a strategy per bucket, ``choices``).
    nodes, local: the mesh shape.
    fusion: ``"none"`` (a collective per tensor), ``"fixed"`` (buckets up to ``bucket_bytes``) or
      ``"adaptive"`` (the MG-WFBP ``groups``, planned by ``cost_model.plan_adaptive_fusion``).
    density: fraction of entries kept by the compressed strategies (k per ``topk_unit``).
    selector: ``"exact"`` or ``"mstopk"`` (compression.py).
    error_feedback: keep what top-k did not send and add it to the next step's gradient.
    feedback: ``"residual"`` (error feedback as above) or ``"ef21"``: send top-k of the change of each
      device's momentum step, and return the sum of the estimates its peers hold, every entry every step
      (``compression.select_change``; needs ``momentum_correction`` and hitopk or topk).
    min_compress_elements: buckets whose top-k unit is smaller than this go to the strategy's dense
      fallback: top-k would save little and cost a selection.
    wire_dtype: dtype of the dense hops on the wire (``comm.dtype``): "bfloat16" halves their bytes;
      hierarchical and hitopk still accumulate in float32 (dense's psum accumulates in the wire dtype).
    order: leaf indices in backward order (``fusion.profile_parameters``); None = reversed pytree order.
    groups: for ``"adaptive"``, the buckets as positions in ``order``.
    choices: for ``strategy="auto"``, the strategy of each bucket (``cost_model.plan_auto``).
    compact_pairs: the top-k pairs cross the wire as a bfloat16 value and a uint16 index (an offset in its
      65,536-entry block, with per-block counts, in longer vectors: ``compression.pair_dtypes``); the rounding
      stays in the residual (gtopk: its merge rounds only, its sums stay exact). The top-k strategies, and
      auto's buckets that take one of them.
    momentum_correction: > 0: DGC momentum correction with this momentum (``compression.compensate``);
      the optimizer then runs without momentum.
    nesterov: the momentum correction's momentum is Nesterov's (``compression.MomentumCorrection``).
    momentum_masking: the momentum correction zeroes the velocity where entries were sent too (DGC's
      momentum factor masking; ``compression.MomentumCorrection``).
    local_clip_norm: > 0: each device's local gradient is clipped to this global norm / sqrt(devices)
      before the reduction (DGC's local gradient clipping).
    sqrt_crossover_size: 0: k = density x the bucket's top-k unit; > 0: k = density x sqrt(unit x this),
      set by ``with_sqrt_allocation`` (``comm.k_allocation="sqrt"``): the unit size at which the square-root
      share equals the proportional one (smaller units keep more than density x unit, larger less).
  """

  strategy: str
  nodes: int
  local: int
  fusion: str = "none"
  bucket_bytes: int = fusion_lib.DEFAULT_BUCKET_BYTES
  density: float = 1.0
  selector: str = "exact"
  error_feedback: bool = True
  feedback: str = "residual"
  min_compress_elements: int = 512
  wire_dtype: str = "float32"
  order: tuple[int, ...] | None = None
  groups: tuple[tuple[int, ...], ...] | None = None
  choices: tuple[str, ...] | None = None
  compact_pairs: bool = False
  momentum_correction: float = 0.0
  nesterov: bool = False
  momentum_masking: bool = True
  local_clip_norm: float = 0.0
  sqrt_crossover_size: float = 0.0
  updates_parameters = False  # the train step applies the optimizer to what ``reduce`` returns

  def __post_init__(self):
    if self.feedback not in FEEDBACKS:
      raise ValueError(f"unknown feedback {self.feedback!r}; known: {FEEDBACKS}")
    ef21_fits = self.momentum_correction and self.strategy in EF21_STRATEGIES
    if self.feedback == "ef21" and not (ef21_fits and self.error_feedback and not self.momentum_masking):
      raise ValueError(
        f"feedback 'ef21' needs momentum correction without masking, error feedback and one of {EF21_STRATEGIES}; "
        f"got momentum_correction={self.momentum_correction}, momentum_masking={self.momentum_masking}, "
        f"error_feedback={self.error_feedback}, strategy {self.strategy!r}"
      )
    if self.compact_pairs and not takes_compact_pairs(self.strategy):
      capable = [s.name for s in strategies.REGISTRY.values() if s.compact_pairs]
      raise ValueError(f"compact pairs: strategy {self.strategy!r} cannot send them; use one of {capable} or auto")
    # Checked here too, not only in config.py: gtopk's ppermute fails deep in tracing otherwise.
    for name in dict.fromkeys(self.choices or ()) if self.strategy == AUTO else (self.strategy,):
      error = strategies.device_count_error(name, self.nodes, self.local)
      if error:
        raise ValueError(error if self.strategy != AUTO else f"strategy 'auto' chose {name!r} for a bucket: {error}")

  @property
  def spec(self) -> strategies.Strategy:
    if self.strategy == AUTO:
      raise ValueError("strategy='auto' has a strategy per bucket: use bucket_reducer(b), after cost_model.plan_auto")
    return strategies.get(self.strategy)

  @property
  def correction(self) -> compression.MomentumCorrection | None:
    """DGC's momentum correction as the collectives take it, or None without it."""
    if not self.momentum_correction:
      return None
    return compression.MomentumCorrection(self.momentum_correction, self.nesterov, self.momentum_masking)

  def at_density(self, density: float) -> GradientReducer:
    """This reducer with top-k keeping ``density`` (the density warm-up of the compressed strategies)."""
    return dataclasses.replace(self, density=density)

  @property
  def compression(self) -> str:
    """How this reducer compresses, for the logs ("" when it does not)."""
    if not may_select_top_k(self.strategy):
      return ""
    where = ""
    if self.strategy == AUTO and self.choices is not None:  # planned: say in how many buckets
      top_k = sum(may_select_top_k(choice) for choice in self.choices)
      if not top_k:
        return ""
      where = f" in {top_k} of {len(self.choices)} buckets"
    return (
      f"top-k density {self.density:.4g}{where}"
      + (", k in proportion to sqrt(size)" if self.sqrt_crossover_size else "")
      + (", compact pairs (bfloat16 value, uint16 index)" if self.compact_pairs else "")
      + (", EF21 estimates" if self.feedback == "ef21" else "")
    )

  def bucket_reducer(self, bucket: int) -> GradientReducer:
    """The one-strategy reducer of bucket ``bucket``: this one, or for "auto" the strategy chosen for it."""
    if self.strategy != AUTO:
      return self
    if self.choices is None:
      raise ValueError("strategy='auto' needs choices: build the reducer with cost_model.plan_auto")
    return self.with_strategy(self.choices[bucket])

  def with_strategy(self, name: str, compact_pairs: bool | None = None) -> GradientReducer:
    """This reducer with one strategy for every bucket; compact pairs (``compact_pairs``, else this
    reducer's) stay on where ``name`` can send them: "auto" with compact pairs sends them from its top-k
    buckets (hitopk, topk, gtopk) and has none elsewhere."""
    compact = (self.compact_pairs if compact_pairs is None else compact_pairs) and strategies.sends_compact_pairs(name)
    return dataclasses.replace(self, strategy=name, choices=None, compact_pairs=compact)

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

  def topk_unit(self, elements: int) -> int:
    """Entries of the vector top-k runs on (and of its residual) for a bucket of ``elements``."""
    return self.spec.topk_unit(elements, self.local)

  def is_compressed(self, elements: int) -> bool:
    return self.spec.compressed and self.topk_unit(elements) >= self.min_compress_elements

  def selection_elements(self, elements: int) -> int:
    """Entries the top-k selections of a bucket of ``elements`` run on, all of them (0 when it goes dense):
    the unit once per selection of its strategy (gtopk: log2(P) + 1)."""
    if not self.k_for(elements):
      return 0
    return self.topk_unit(elements) * self.strategy_for_size(elements).selections(self.nodes * self.local)

  def k_for(self, elements: int) -> int:
    """Entries top-k keeps of a bucket of ``elements`` (0 when the bucket goes dense)."""
    if not self.is_compressed(elements):
      return 0
    unit = self.topk_unit(elements)
    if self.sqrt_crossover_size:  # the square-root share, at most the unit (num_selected caps it)
      return compression.num_selected(unit, self.density * math.sqrt(self.sqrt_crossover_size / unit))
    return compression.num_selected(unit, self.density)

  def with_sqrt_allocation(self, params: PyTree) -> GradientReducer:
    """This reducer with each compressed bucket's k in proportion to the square root of its top-k unit,
    the total the same as density x all units: sum_i d sqrt(u_i r) = d sum_i u_i for
    r = (sum_i u_i / sum_i sqrt(u_i))^2. For resnet8_fast per tensor (fusion "none") on 2 x 4 devices, the
    3x3 kernels of 2,304 entries per shard then keep 2.4x their proportional share, the largest (36,864) 0.6x.
    A bucket whose share would exceed its unit sends whole (``num_selected`` caps k), and what it gives up is
    not passed on, so near density 1 the total falls short of density x all units."""
    _, _, sizes = self._bucket_sizes(jax.tree.leaves(params))
    units = [
      self.bucket_reducer(b).topk_unit(n) for b, n in enumerate(sizes) if self.bucket_reducer(b).is_compressed(n)
    ]
    if not units:
      return self
    return dataclasses.replace(self, sqrt_crossover_size=(sum(units) / sum(math.sqrt(u) for u in units)) ** 2)

  def strategy_for_size(self, elements: int) -> strategies.Strategy:
    """The strategy that reduces a bucket of ``elements`` entries: this reducer's, or its dense fallback for a
    bucket too small to compress (``is_compressed``). With "auto", ask ``bucket_reducer(b)``."""
    spec = self.spec
    return spec if not spec.compressed or self.is_compressed(elements) else strategies.get(spec.dense_fallback)

  def _bucket_sizes(self, leaves) -> tuple[list[int], list[list[int]], list[int]]:
    order, buckets = self.buckets(leaves)
    sizes = [sum(math.prod(leaves[order[i]].shape) for i in bucket) for bucket in buckets]
    return order, buckets, sizes

  # --- state -------------------------------------------------------------------------------------
  def init_state(self, params: PyTree) -> dict[str, jax.Array | compression.Memory | None]:
    """Zero residuals, {"bucket_i": float32 (nodes, local, compressed size)}, for compressed buckets
    (a ``compression.Memory`` of two such arrays with momentum correction, a ``compression.Estimate`` of
    three with EF21; None without error feedback, which keeps nothing). With momentum correction each dense
    bucket keeps its velocity too, (nodes, local, its size)."""
    _, _, sizes = self._bucket_sizes(jax.tree.leaves(params))
    state = {}
    for b, n in enumerate(sizes):
      if self.bucket_reducer(b).is_compressed(n):
        zeros = jnp.zeros((self.nodes, self.local, self.bucket_reducer(b).topk_unit(n)), jnp.float32)
        if self.feedback == "ef21":
          state[_key(b)] = compression.Estimate(zeros, zeros, zeros)
        elif self.momentum_correction:
          state[_key(b)] = compression.Memory(zeros, zeros)
        else:
          state[_key(b)] = zeros if self.error_feedback else None
      elif self.momentum_correction:  # a dense bucket keeps its velocity too: the optimizer has no momentum
        state[_key(b)] = jnp.zeros((self.nodes, self.local, n), jnp.float32)
    return state

  def rescale_residuals(self, comm_state: dict[str, Any], factor: jax.Array) -> dict[str, Any]:
    """``comm_state`` with every error-feedback residual times ``factor`` (velocities untouched).

    With ``comm.residual_units="update"`` the train step passes lr(t-1) / lr(t): a residual kept in
    units of the current learning rate then holds sum lr(s) g(s) / lr(t), so the optimizer's lr(t) applies
    each unsent gradient at its own step's rate (``schedules.residual_rescale``).
    """
    if not self.momentum_correction:  # every entry is a compressed bucket's residual
      return jax.tree.map(lambda r: r * factor, comm_state)
    return {  # Memory(residual, velocity) for compressed buckets, a bare velocity for dense ones (an EF21
      # Estimate has no residual: comm.residual_units="update" is a config error with it)
      key: state._replace(residual=state.residual * factor) if isinstance(state, compression.Memory) else state
      for key, state in comm_state.items()
    }

  # --- the reduction (inside shard_map) ----------------------------------------------------------
  def reduce(self, local_grads: PyTree, comm_state: dict[str, Any]) -> tuple[PyTree, dict[str, Any]]:
    """Inside shard_map, on one device's gradient: clip it (``local_clip_norm``), pack its leaves into the
    buckets, reduce each bucket with its strategy, unpack; returns (the mean gradient, the new comm_state).
    ``comm_state`` holds per bucket its per-device state: a compressed bucket's residual (a
    ``compression.Memory`` with DGC's velocity under momentum correction, a ``compression.Estimate`` under
    EF21), or under momentum correction a dense bucket's velocity."""
    if self.local_clip_norm:
      local_grads = compression.clip_local(local_grads, self.local_clip_norm, self.nodes * self.local)
    leaves, treedef = jax.tree.flatten(local_grads)
    narrow = next((x.dtype for x in leaves if x.dtype != jnp.float32), None)
    if narrow is not None:  # the parameters are float32 in every config; a 16-bit sum over every device overflows
      raise TypeError(
        f"the reducer sums float32 gradients, not {narrow}: a sum over every device in {narrow} overflows (float16) "
        "or loses the small ones; cast the gradient to float32 (comm.dtype sets what the links carry)"
      )
    order, buckets, sizes = self._bucket_sizes(leaves)
    wire_dtype = jnp.dtype(self.wire_dtype)
    new_state = {}
    summed: list[jax.Array | None] = [None] * len(leaves)
    for b, (bucket, size) in enumerate(zip(buckets, sizes)):
      members = [order[i] for i in bucket]
      flat = fusion_lib.pack([leaves[m] for m in members])
      this = self.bucket_reducer(b)
      spec = this.strategy_for_size(size)
      if spec.compressed:
        # This device's block of the (nodes, local, ...) arrays.
        memory = this_device(comm_state[_key(b)])
        flat, memory = spec.reduce(
          flat,
          memory,
          this.k_for(size),
          self.selector,
          self.error_feedback,
          wire_dtype,
          self.correction,
          this.compact_pairs,
        )
        new_state[_key(b)] = per_device(memory)
      else:
        if self.momentum_correction:
          flat, new_state[_key(b)] = self.dense_momentum(flat, comm_state[_key(b)])
        flat = spec.reduce(flat, wire_dtype)
      for m, g in zip(members, fusion_lib.unpack(flat, [leaves[m] for m in members])):
        summed[m] = g
    num_devices = self.nodes * self.local
    return jax.tree.unflatten(treedef, [g / num_devices for g in summed]), new_state

  def dense_momentum(self, flat: jax.Array, velocity: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the step a dense bucket sends, its new velocity) under momentum correction; ``velocity`` is this
    device's (1, 1, n) block. A velocity per device: the sum of their steps is momentum SGD's."""
    new, step = self.correction.step(flat, velocity[0, 0])
    return step, new[None, None]

  def bucket_plan(self, params: PyTree) -> list[tuple[str, int, int]]:
    """One step's collectives: (strategy, elements, k) per bucket, in reduction order."""
    _, _, sizes = self._bucket_sizes(jax.tree.leaves(params))
    buckets = [(self.bucket_reducer(b), n) for b, n in enumerate(sizes)]
    return [(one.strategy_for_size(n).name, n, one.k_for(n)) for one, n in buckets]

  def bytes_per_step(self, params: PyTree) -> CommBytes:
    itemsize = jnp.dtype(jax.tree.leaves(params)[0].dtype).itemsize
    wire = jnp.dtype(self.wire_dtype).itemsize
    total = CommBytes()
    for name, n, k in self.bucket_plan(params):
      buffer = strategies.Buffer(n, itemsize, self.nodes, self.local, k, wire, compact_pairs=self.compact_pairs)
      total += strategies.get(name).bytes(buffer)
    return total


class Reducer(Protocol):
  """What the train step and CompiledSteps use of a gradient reducer: GradientReducer, powersgd.PowerSGDReducer,
  diloco.DiLoCo, and sharded_update.ShardedUpdate (which wraps a GradientReducer). Those with
  ``updates_parameters`` also have ``init_optimizer_state``, ``machine_params`` (the parameters the forward pass
  runs on), ``apply(grads, params, opt_state, comm_state, step, record_boundaries)`` (the step calls them
  instead of the optimizer) and ``after_step(params, opt_state, comm_state, step, record_boundaries)`` (after
  the decision to keep or skip the step: DiLoCo's outer step); those with error-feedback residuals of gradients
  (GradientReducer, ShardedUpdate) also ``rescale_residuals`` (``comm.residual_units="update"``)."""

  @property
  def updates_parameters(self) -> bool: ...

  @property
  def compression(self) -> str: ...  # how it compresses, for the logs ("" when it does not)

  def init_state(self, params: PyTree) -> PyTree: ...  # the train state's comm_state, leading dims (nodes, local)

  def reduce(self, local_grads: PyTree, comm_state: PyTree) -> tuple[PyTree, PyTree]: ...  # inside shard_map

  def at_density(self, density: float) -> Reducer: ...  # the density warm-up's phases (top-k; others: self)

  def bucket_plan(self, params: PyTree) -> list[tuple[str, int, int]]: ...  # (strategy, elements, k) per bucket

  def bytes_per_step(self, params: PyTree) -> CommBytes: ...


def make_gradient_reducer(
  strategy: str,
  nodes: int,
  local: int,
  fusion: str = "none",
  bucket_bytes: int = fusion_lib.DEFAULT_BUCKET_BYTES,
  **compression_options,
) -> Reducer:
  """A reducer for ``strategy``; ``compression_options`` are density, selector, error_feedback, ...
  (for "powersgd": rank, error_feedback, min_compress_elements, wire_dtype, local_clip_norm)."""
  if strategy == POWERSGD:
    return powersgd.PowerSGDReducer(nodes, local, **compression_options)
  if strategy != AUTO:
    strategies.get(strategy)  # a clear error for an unknown name
  if fusion not in FUSIONS:
    raise ValueError(f"unknown comm.fusion {fusion!r}; known: {', '.join(FUSIONS)}")
  return GradientReducer(
    strategy=strategy, nodes=nodes, local=local, fusion=fusion, bucket_bytes=bucket_bytes, **compression_options
  )


def reducer_from_config(
  comm,
  nodes: int,
  local: int,
  order: tuple[int, ...] | None = None,
  momentum: float = 0.0,
  optimizer: optax.GradientTransformation | None = None,
  nesterov: bool = False,
) -> Reducer:
  """The reducer the config's ``comm`` block describes on a ``nodes`` x ``local`` mesh, leaves reduced in
  ``order``; ``momentum`` and ``nesterov`` (``optimizer.momentum``, ``optimizer.nesterov``) are the
  velocity's with ``comm.momentum_correction``.
  With ``comm.fusion="adaptive"`` it has fixed buckets until ``cost_model.plan_adaptive_fusion`` plans its
  MG-WFBP groups; with ``comm.strategy="auto"`` it is hierarchical until ``cost_model.plan_auto`` chooses
  each bucket's strategy. ``optimizer``: DiLoCo's inner optimizer."""
  if comm.strategy == DILOCO:
    return diloco.DiLoCo(
      nodes,
      local,
      sync_every=comm.sync_every,
      outer_lr=comm.outer_lr,
      outer_momentum=comm.outer_momentum,
      inner_tx=optimizer,
      wire_dtype=comm.dtype,
    )
  if comm.strategy == POWERSGD:
    return powersgd.PowerSGDReducer(
      nodes,
      local,
      rank=comm.rank,
      error_feedback=comm.error_feedback,
      min_compress_elements=comm.min_compress_elements,
      wire_dtype=comm.dtype,
      local_clip_norm=comm.local_clip_norm,
    )
  return make_gradient_reducer(
    "hierarchical" if comm.strategy == AUTO else comm.strategy,
    nodes,
    local,
    "fixed" if comm.fusion == "adaptive" else comm.fusion,
    comm.bucket_bytes,
    density=comm.density,
    selector=comm.topk_selector,
    error_feedback=comm.error_feedback,
    feedback=comm.feedback,
    min_compress_elements=comm.min_compress_elements,
    wire_dtype=comm.dtype,
    compact_pairs=comm.compact_pairs and comm.strategy != AUTO,  # auto's: cost_model.plan_auto gives them
    order=order,
    momentum_correction=momentum if comm.momentum_correction else 0.0,
    nesterov=nesterov,
    momentum_masking=comm.momentum_masking,
    local_clip_norm=comm.local_clip_norm,
  )


def _key(bucket: int) -> str:
  return f"bucket_{bucket:03d}"
