"""Optimizers for large-batch training: SGD (momentum, Nesterov), LARS and LAMB, from optax.

- Peak learning rate scales linearly with the global batch: ``lr = base_lr * batch / 256`` (Goyal et al.).
- Schedule: linear warm-up from 0 to the peak, then polynomial (power 2, MLPerf) or cosine decay to
  ``peak * end_lr_factor`` at the last step.
- Biases and BatchNorm parameters (every parameter with ndim <= 1) get no weight decay and, for LARS,
  no trust ratio: the MLPerf ResNet-50 convention.
"""

from __future__ import annotations

import jax
import ml_collections
import optax


def peak_learning_rate(config: ml_collections.ConfigDict) -> float:
  return config.optimizer.base_lr * config.global_batch_size / 256


def learning_rate_schedule(config: ml_collections.ConfigDict, steps_per_epoch: int, total_steps: int) -> optax.Schedule:
  """Warm-up then decay, as a function of the step; evaluated on the host for logging as well."""
  opt = config.optimizer
  peak = peak_learning_rate(config)
  warmup_steps = min(int(round(opt.warmup_epochs * steps_per_epoch)), total_steps)
  decay_steps = max(total_steps - warmup_steps, 1)
  end = peak * opt.end_lr_factor
  if opt.decay == "poly":
    decay = optax.polynomial_schedule(peak, end, power=2, transition_steps=decay_steps)
  else:
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=opt.end_lr_factor)
  if warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak, warmup_steps)
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params):
  """True for parameters that get weight decay (and LARS trust ratios): conv and dense kernels."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def build_optimizer(config: ml_collections.ConfigDict, schedule: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer named by ``config.optimizer.name``, applied to the (already reduced) mean gradient."""
  opt = config.optimizer
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
