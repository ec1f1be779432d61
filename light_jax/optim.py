"""Optimizers for large-batch training: SGD (momentum, Nesterov), LARS and LAMB, from optax.

- The learning rate is a schedule from ``light_jax/schedules.py`` (warm-up, decay, linear scaling);
  the momentum may be one too (``optimizer.momentum_schedule="cycle"``, ``schedules.momentum_schedule``).
- Biases and BatchNorm parameters (every parameter with ndim <= 1) get no weight decay and, for LARS and
  LAMB, no trust ratio: the MLPerf ResNet-50 convention, and the LAMB paper's.
- LARS has two trust ratios (``optimizer.lars_trust``, docs/techniques.md section 11): optax's
  ``eta ||w|| / ||g + wd w||`` and the MLPerf reference's ``eta ||w|| / (||g|| + wd ||w||)``.
- With ``comm.momentum_correction`` the gradient reducer keeps the momentum (DGC): the optimizer then
  runs without its own (``momentum_in_optimizer``), and SGD's weight decay moves before the reduction,
  or, with ``comm.decay_in_velocity=False``, stays after it with a momentum of its own
  (``decay_momentum``, ``decayed_weights_with_momentum``).
- With ``comm.local_trust_ratio`` LARS's weight decay and trust ratio run on each device's gradient
  before the reduction (``local_transform``) and the optimizer keeps only the learning rate and momentum:
  a top-k reduction then sends pieces of the scaled update, and error feedback conserves it.
- LARS is ``scale_by_lars_trust_ratio`` + optax's learning rate and momentum: the same steps as
  ``optax.lars`` (tested), one pass per norm instead of three. ``optimizer.fused_norms`` computes the
  norms of every tensor from packed buffers (``tensor_norms``) instead of two reductions per tensor
  (Light's "parallel tensor operator"; docs/techniques.md section 14).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

LARS_TRUST = ("optax", "mlperf")


class Optimizer(NamedTuple):
  """What applies the reduced gradient (``from_config``): the optax optimizer, and the parts it was built from,
  which the sharded update (``optimizer.sharded_update``) builds its optimizer on shards from."""

  tx: optax.GradientTransformation
  schedule: optax.Schedule  # the learning rate of the step
  momentum: float | Callable  # 0 when the gradient reducer keeps it (DGC momentum correction)
  decay: bool  # False when the weight decay runs on each device before the reduction


def from_config(
  config: ml_collections.ConfigDict, schedule: optax.Schedule, momentum: float | Callable | None = None
) -> Optimizer:
  """The optimizer the config describes, with the learning rate ``schedule``. ``momentum``: a float or a schedule
  of the step (``schedules.momentum_schedule``); None: ``optimizer.momentum``. Either way 0 when the reducer
  keeps the momentum (``momentum_in_optimizer``)."""
  if not momentum_in_optimizer(config):
    momentum = 0.0
  elif momentum is None:
    momentum = config.optimizer.momentum
  decay = not decay_before_reduction(config)
  tx = build_optimizer(config.optimizer, schedule, momentum, decay, decay_momentum(config))
  return Optimizer(tx, schedule, momentum, decay)


def decay_mask(params):
  """True for parameters that get weight decay (and LARS trust ratios): conv and dense kernels."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def momentum_in_optimizer(config: ml_collections.ConfigDict) -> bool:
  """False when the gradient reducer applies the momentum instead (DGC momentum correction)."""
  return not config.comm.momentum_correction


def local_transform(config: ml_collections.ConfigDict) -> optax.GradientTransformation | None:
  """What runs on each device's own gradient before the reduction (stateless), else None: LARS's weight
  decay and trust ratio with ``comm.local_trust_ratio``; SGD's weight decay with ``comm.momentum_correction``
  (``decay_before_reduction``)."""
  if config.comm.local_trust_ratio:
    return _lars_trust(config.optimizer)
  if decay_before_reduction(config):
    return optax.add_decayed_weights(config.optimizer.weight_decay, mask=decay_mask)
  return None


def decay_before_reduction(config: ml_collections.ConfigDict) -> bool:
  """Whether the weight decay (and LARS's trust ratio) runs on each device before the reduction.

  With ``comm.local_trust_ratio``; and for SGD with DGC's momentum correction, so that ``wd w`` enters the
  reducer's velocity as it enters optax's momentum (DGC's algorithm; after the reduction without a
  momentum it would decay 1 / (1 - momentum) times less), unless ``comm.decay_in_velocity=False``
  gives it a momentum of its own after the reduction (``decay_momentum``).
  """
  return config.comm.local_trust_ratio or (_sgd_with_momentum_correction(config) and config.comm.decay_in_velocity)


def decay_momentum(config: ml_collections.ConfigDict) -> float:
  """The momentum of the weight decay alone, after the reduction: ``optimizer.momentum`` when momentum
  correction keeps the gradient's momentum in the reducer and ``comm.decay_in_velocity=False``, else 0."""
  if _sgd_with_momentum_correction(config) and not config.comm.decay_in_velocity:
    return config.optimizer.momentum
  return 0.0


def _sgd_with_momentum_correction(config: ml_collections.ConfigDict) -> bool:
  """SGD whose momentum the reducer keeps (DGC momentum correction), where the weight decay can go either side."""
  return config.comm.momentum_correction and config.optimizer.name == "sgd"


def _lars_trust(opt: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """LARS's weight decay and trust ratio with ``opt``'s values (before the reduction or after it)."""
  return scale_by_lars_trust_ratio(opt.lars_eta, opt.weight_decay, decay_mask, opt.lars_trust, opt.fused_norms)


def build_optimizer(
  opt: ml_collections.ConfigDict,
  schedule: optax.Schedule,
  momentum: float | Callable | None = None,
  decay: bool = True,
  decay_momentum: float = 0.0,
) -> optax.GradientTransformation:
  """The optimizer named by ``opt.name`` (``config.optimizer``), applied to the reduced mean gradient.

  ``momentum``: a float, a schedule of the step (``schedules.momentum_schedule``), or None for
  ``opt.momentum``; 0 turns momentum off (DGC momentum correction keeps it in the reducer instead).
  ``decay=False``: without the weight decay (and LARS's trust ratio), which ``local_transform`` then
  applies on each device before the reduction (``decay_before_reduction``).
  ``decay_momentum``: SGD's weight decay through a momentum of its own (``decay_momentum(config)``).
  """
  momentum = opt.momentum if momentum is None else momentum
  scheduled = callable(momentum)
  weight_decay = opt.weight_decay if decay else 0.0
  if opt.name == "sgd" and decay_momentum:
    return optax.chain(
      decayed_weights_with_momentum(weight_decay, decay_momentum, opt.nesterov),
      optax.sgd(schedule, momentum=momentum or None, nesterov=opt.nesterov),
    )
  # A constant momentum through optax.sgd, a scheduled one through momentum_transform: the same update, but
  # checkpoints hold the optimizer state's tree, which differs between the two (kept, so old runs resume).
  if opt.name == "sgd" and not scheduled:
    return optax.chain(
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      optax.sgd(schedule, momentum=momentum or None, nesterov=opt.nesterov),
    )
  if opt.name == "sgd":
    return optax.chain(
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      momentum_transform(momentum, opt.nesterov),
      optax.scale_by_learning_rate(schedule),
    )
  if opt.name == "lars":
    tail = [optax.scale_by_learning_rate(schedule), momentum_transform(momentum, opt.nesterov)]
    if not decay:
      return optax.chain(*tail)
    return optax.chain(_lars_trust(opt), *tail)
  if opt.name == "lamb":
    # optax.lamb's chain (its b2, eps), but the first moment's decay is optimizer.momentum (optimizer.nesterov is
    # SGD's and LARS's: this is the paper's LAMB), and the trust ratio, like the weight decay, is the kernels'
    # only: optax.lamb gives biases and BatchNorm one too, which the LAMB paper's reference code leaves out.
    return optax.chain(
      optax.scale_by_adam(b1=opt.momentum, b2=0.999, eps=1e-6),
      optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
      optax.masked(optax.scale_by_trust_ratio(), decay_mask),
      optax.scale_by_learning_rate(schedule),
    )
  raise ValueError(f"unknown optimizer {opt.name!r}")  # config.validate refuses it first


def momentum_transform(momentum: float | Callable, nesterov: bool) -> optax.GradientTransformation:
  """Momentum (optax.trace); a schedule of the step goes through optax.inject_hyperparams. A momentum of 0
  (DGC's momentum correction keeps it in the reducer) is the identity, without a trace of zeros."""
  if callable(momentum):
    return optax.inject_hyperparams(optax.trace, static_args="nesterov")(decay=momentum, nesterov=nesterov)
  if momentum == 0:
    return optax.identity()
  return optax.trace(decay=momentum, nesterov=nesterov)


def decayed_weights_with_momentum(weight_decay: float, momentum: float, nesterov: bool) -> optax.GradientTransformation:
  """``updates`` plus momentum SGD's step for ``wd w`` alone (``optax.trace`` of it; kernels only).

  Momentum is linear, so momentum SGD's step for ``g + wd w`` is its step for ``g`` plus its step for
  ``wd w``. With momentum correction the reducer sends the first; this adds the second after the
  reduction. The weights are the same on every device, so ``wd w`` needs no communication.
  """
  # optax's momentum SGD (with the decay masked to the kernels), run on zero gradients: its step for wd w.
  decay_step = optax.chain(
    optax.add_decayed_weights(weight_decay, mask=decay_mask), optax.trace(decay=momentum, nesterov=nesterov)
  )

  def update_fn(updates, state, params):
    stepped, state = decay_step.update(jax.tree.map(jnp.zeros_like, updates), state, params)
    return jax.tree.map(jnp.add, updates, stepped), state

  return optax.GradientTransformation(decay_step.init, update_fn)


def lars_ratio(form: str, eta: float, weight_decay: float, w_norms: jax.Array, other_norms: jax.Array) -> jax.Array:
  """Trust ratios from the norms of the weights and of ``g + wd w`` ("optax") or of ``g`` ("mlperf");
  1 where a norm is zero."""
  denominator = other_norms if form == "optax" else other_norms + weight_decay * w_norms
  return jnp.where((w_norms > 0) & (other_norms > 0), eta * w_norms / jnp.where(denominator > 0, denominator, 1.0), 1.0)


NORM_BLOCK = 1024  # tensors are padded to whole rows of this many entries in the packed buffer


def tensor_norms(leaves: list[jax.Array]) -> jax.Array:
  """The L2 norm of every tensor in ``leaves``, in two passes over one packed buffer instead of one
  reduction per tensor: each tensor padded with zeros to whole rows of ``NORM_BLOCK``, the rows summed,
  then the row sums of each tensor added (a segment sum over rows, whose ids are a small constant)."""
  padded = [jnp.pad(x.reshape(-1).astype(jnp.float32), (0, -x.size % NORM_BLOCK)) for x in leaves]
  rows = jnp.concatenate(padded).reshape(-1, NORM_BLOCK)
  row_sums = jnp.sum(rows * rows, axis=1)
  segment = np.repeat(np.arange(len(leaves)), [p.size // NORM_BLOCK for p in padded])
  return jnp.sqrt(jax.ops.segment_sum(row_sums, segment, num_segments=len(leaves), indices_are_sorted=True))


def scale_by_lars_trust_ratio(
  eta: float, weight_decay: float, mask: Callable, form: str = "optax", fused: bool = False
) -> optax.GradientTransformation:
  """LARS's weight decay and trust ratio: for the tensors ``mask`` selects (kernels), ``ratio x (g + wd w)``
  with ratio ``eta ||w|| / ||g + wd w||`` (``form="optax"``, optax.lars's) or ``eta ||w|| / (||g|| +
  wd ||w||)`` (``"mlperf"``, the MLPerf ResNet-50 reference's); the others (biases, BatchNorm) pass
  unchanged, without weight decay. A zero norm gives a ratio of 1. Then the learning rate and momentum,
  as in ``optax.lars`` (tested equal to it).

  The norms: one ``jnp.linalg.norm`` per tensor, or with ``fused`` all of them from ``tensor_norms``.
  (optax's own ``scale_by_trust_ratio`` takes each norm through ``safe_norm``, three passes over the
  tensor: its LARS update took 2x as long on ResNet-50 here, ``benchmarks/update_step.py``.)
  """

  def update_fn(updates, state, params):
    g, treedef = jax.tree.flatten(updates)
    w = treedef.flatten_up_to(params)
    chosen = [i for i, m in enumerate(treedef.flatten_up_to(mask(params))) if m]
    decayed = {i: g[i] + weight_decay * w[i] for i in chosen}
    norms = tensor_norms if fused else (lambda xs: jnp.stack([jnp.linalg.norm(x) for x in xs]))
    other = [decayed[i] for i in chosen] if form == "optax" else [g[i] for i in chosen]
    ratios = lars_ratio(form, eta, weight_decay, norms([w[i] for i in chosen]), norms(other))
    out = list(g)
    for r, i in enumerate(chosen):
      out[i] = ratios[r].astype(g[i].dtype) * decayed[i]
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def cross_entropy(logits, labels, num_classes: int, label_smoothing: float):
  """Mean softmax cross-entropy against (optionally smoothed) one-hot labels; logits float32."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()
