"""Optimizers for large-batch training: SGD (momentum, Nesterov), LARS and LAMB, from optax.

- Peak learning rate scales linearly with the global batch: ``lr = base_lr * batch / 256`` (Goyal et al.),
  per phase when the resolution schedule changes the batch size.
- Schedule: linear warm-up from 0 to the peak over ``warmup_epochs``, then polynomial (power 2, MLPerf)
  or cosine decay to ``peak * end_lr_factor`` at the last step.
- Biases and BatchNorm parameters (every parameter with ndim <= 1) get no weight decay and, for LARS,
  no trust ratio: the MLPerf ResNet-50 convention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from light_jax.data.epochs import EpochPlan


def peak_learning_rate(config: ml_collections.ConfigDict, global_batch_size: int | None = None) -> float:
  return config.optimizer.base_lr * (global_batch_size or config.global_batch_size) / 256


def learning_rate_schedule(config: ml_collections.ConfigDict, plan: EpochPlan) -> optax.Schedule:
  """Warm-up then decay as a function of the step; evaluated on the host for logging as well.

  The shape is laid out in epochs (``plan.epochs_done``), so phases with different batch sizes, hence
  different steps per epoch, keep the warm-up and decay where the config puts them; the height
  follows the linear scaling rule with each step's batch size. With one batch size throughout this is
  the usual step schedule, except that the warm-up ends at exactly ``warmup_epochs`` (a step schedule
  rounds it to a whole step).
  """
  opt = config.optimizer
  warmup, total = min(opt.warmup_epochs, plan.num_epochs), plan.num_epochs
  first_steps = jnp.asarray(plan.first_steps, jnp.float32)
  epoch_marks = jnp.arange(plan.num_epochs + 1, dtype=jnp.float32)
  peaks = jnp.asarray([peak_learning_rate(config, b) for b in plan.batch_sizes], jnp.float32)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    epochs = jnp.interp(step, first_steps, epoch_marks)   # plan.epochs_done, piecewise linear
    epoch = jnp.clip(jnp.searchsorted(first_steps, step, side="right") - 1, 0, plan.num_epochs - 1)
    progress = jnp.clip((epochs - warmup) / max(total - warmup, 1e-9), 0.0, 1.0)
    if opt.decay == "poly":
      decay = opt.end_lr_factor + (1 - opt.end_lr_factor) * (1 - progress) ** 2
    else:
      decay = opt.end_lr_factor + (1 - opt.end_lr_factor) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    shape = jnp.where(epochs < warmup, epochs / max(warmup, 1e-9), decay)
    return peaks[epoch] * shape

  return schedule


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
