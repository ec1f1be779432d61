"""Optimizers for large-batch training: SGD (momentum, Nesterov), LARS and LAMB, from optax.

- The learning rate is a schedule from ``light_jax/schedules.py`` (warm-up, decay, linear scaling).
- Biases and BatchNorm parameters (every parameter with ndim <= 1) get no weight decay and, for LARS,
  no trust ratio: the MLPerf ResNet-50 convention.
"""

from __future__ import annotations

import jax
import ml_collections
import optax


def decay_mask(params):
  """True for parameters that get weight decay (and LARS trust ratios): conv and dense kernels."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def build_optimizer(opt: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer named by ``opt.name`` (``config.optimizer``), applied to the reduced mean gradient."""
  if opt.name == "sgd":
    return optax.chain(
      optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
      optax.sgd(schedule, momentum=opt.momentum, nesterov=opt.nesterov),
    )
  if opt.name == "lars":
    return optax.lars(
      schedule,
      weight_decay=opt.weight_decay,
      weight_decay_mask=decay_mask,
      trust_coefficient=opt.lars_eta,
      trust_ratio_mask=decay_mask,
      momentum=opt.momentum,
      nesterov=opt.nesterov,
    )
  if opt.name == "lamb":
    return optax.lamb(schedule, weight_decay=opt.weight_decay, mask=decay_mask)
  raise ValueError(f"unknown optimizer {opt.name!r}")  # config.validate refuses it first


def cross_entropy(logits, labels, num_classes: int, label_smoothing: float):
  """Mean softmax cross-entropy against (optionally smoothed) one-hot labels; logits float32."""
  targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()
