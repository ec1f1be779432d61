"""Optimizers for large-batch training: SGD (momentum, Nesterov), LARS and LAMB, from optax.

- The learning rate is a schedule from ``light_jax/schedules.py`` (warm-up, decay, linear scaling);
  the momentum may be one too (``optimizer.momentum_schedule="cycle"``, ``schedules.momentum_schedule``).
- Biases and BatchNorm parameters (every parameter with ndim <= 1) get no weight decay and, for LARS,
  no trust ratio: the MLPerf ResNet-50 convention.
- LARS has two trust ratios (``optimizer.lars_trust``, docs/techniques.md section 11): optax's
  ``eta ||w|| / ||g + wd w||`` and the MLPerf reference's ``eta ||w|| / (||g|| + wd ||w||)``.
- With ``comm.momentum_correction`` the gradient reducer keeps the momentum (DGC): the optimizer then
  runs without its own (``momentum_in_optimizer``).
- ``optimizer.fused_norms``: LARS computes the norms of every tensor in two passes over packed buffers
  (``tensor_norms``) instead of two reductions per tensor (Light's "parallel tensor operator";
  docs/techniques.md section 14).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

LARS_TRUST = ("optax", "mlperf")


def decay_mask(params):
  """True for parameters that get weight decay (and LARS trust ratios): conv and dense kernels."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def momentum_in_optimizer(config: ml_collections.ConfigDict) -> bool:
  """False when the gradient reducer applies the momentum instead (DGC momentum correction)."""
  return not config.comm.momentum_correction


def build_optimizer(
  opt: ml_collections.ConfigDict,
  schedule: optax.Schedule,
  momentum: float | Callable | None = None,
) -> optax.GradientTransformation:
  """The optimizer named by ``opt.name`` (``config.optimizer``), applied to the reduced mean gradient.

  ``momentum``: a float, a schedule of the step (``schedules.momentum_schedule``), or None for
  ``opt.momentum``; 0 turns momentum off (DGC momentum correction keeps it in the reducer instead).
  """
  momentum = opt.momentum if momentum is None else momentum
  scheduled = callable(momentum)
  if opt.name == "sgd" and not scheduled:
    return optax.chain(
      optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
      optax.sgd(schedule, momentum=momentum or None, nesterov=opt.nesterov),
    )
  if opt.name == "sgd":
    return optax.chain(
      optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
      _trace(momentum, opt.nesterov),
      optax.scale_by_learning_rate(schedule),
    )
  if opt.name == "lars" and opt.fused_norms:
    trust = scale_by_fused_trust_ratio(opt.lars_eta, opt.weight_decay, decay_mask, opt.lars_trust)
    return optax.chain(trust, optax.scale_by_learning_rate(schedule), _trace(momentum, opt.nesterov))
  if opt.name == "lars" and opt.lars_trust == "optax" and not scheduled:
    return optax.lars(
      schedule,
      weight_decay=opt.weight_decay,
      weight_decay_mask=decay_mask,
      trust_coefficient=opt.lars_eta,
      trust_ratio_mask=decay_mask,
      momentum=momentum,
      nesterov=opt.nesterov,
    )
  if opt.name == "lars":
    # optax.lars's chain, with the MLPerf trust ratio and/or a momentum schedule.
    if opt.lars_trust == "mlperf":
      trust = scale_by_mlperf_trust_ratio(opt.lars_eta, opt.weight_decay, decay_mask)
    else:
      trust = optax.chain(
        optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
        optax.masked(optax.scale_by_trust_ratio(trust_coefficient=opt.lars_eta), decay_mask),
      )
    return optax.chain(trust, optax.scale_by_learning_rate(schedule), _trace(momentum, opt.nesterov))
  if opt.name == "lamb":
    return optax.lamb(schedule, weight_decay=opt.weight_decay, mask=decay_mask)
  raise ValueError(f"unknown optimizer {opt.name!r}")  # config.validate refuses it first


def _trace(momentum: float | Callable, nesterov: bool) -> optax.GradientTransformation:
  """Momentum (optax.trace); a schedule of the step goes through optax.inject_hyperparams."""
  if callable(momentum):
    return optax.inject_hyperparams(optax.trace, static_args="nesterov")(decay=momentum, nesterov=nesterov)
  return optax.trace(decay=momentum, nesterov=nesterov)


def scale_by_mlperf_trust_ratio(eta: float, weight_decay: float, mask: Callable) -> optax.GradientTransformation:
  """The MLPerf ResNet-50 LARS step direction: ``eta ||w|| / (||g|| + wd ||w||) x (g + wd w)``.

  For the tensors ``mask`` selects (kernels); the others (biases, BatchNorm) pass unchanged, without
  weight decay. A zero norm (a fresh zero tensor, or a zero gradient) gives a trust ratio of 1.
  """

  def update_fn(updates, state, params):
    def one(g, w, selected):
      if not selected:
        return g
      w_norm, g_norm = jnp.linalg.norm(w), jnp.linalg.norm(g)
      ratio = jnp.where((w_norm > 0) & (g_norm > 0), eta * w_norm / (g_norm + weight_decay * w_norm), 1.0)
      return ratio * (g + weight_decay * w)

    return jax.tree.map(one, updates, params, mask(params)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


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


def scale_by_fused_trust_ratio(
  eta: float, weight_decay: float, mask: Callable, form: str
) -> optax.GradientTransformation:
  """LARS's weight decay and trust ratio, as ``optax.lars`` (``form="optax"``: eta ||w|| / ||g + wd w||) or
  ``scale_by_mlperf_trust_ratio`` (``"mlperf"``: eta ||w|| / (||g|| + wd ||w||)) compute them, with the
  norms of all selected tensors from ``tensor_norms``. A zero norm gives a ratio of 1."""

  def update_fn(updates, state, params):
    g, treedef = jax.tree.flatten(updates)
    w = treedef.flatten_up_to(params)
    chosen = [i for i, m in enumerate(treedef.flatten_up_to(mask(params))) if m]
    decayed = {i: g[i] + weight_decay * w[i] for i in chosen}
    w_norms = tensor_norms([w[i] for i in chosen])
    other = tensor_norms([(decayed if form == "optax" else dict(enumerate(g)))[i] for i in chosen])
    if form == "optax":
      ratios = jnp.where((w_norms > 0) & (other > 0), eta * w_norms / other, 1.0)
    else:
      ratios = jnp.where((w_norms > 0) & (other > 0), eta * w_norms / (other + weight_decay * w_norms), 1.0)
    out = list(g)
    for r, i in enumerate(chosen):
      out[i] = ratios[r] * decayed[i]
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def cross_entropy(logits, labels, num_classes: int, label_smoothing: float):
  """Mean softmax cross-entropy against (optionally smoothed) one-hot labels; logits float32."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()
