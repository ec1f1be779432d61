"""Schedules: what changes with the training step, all computed from the config alone.

- ``EpochPlan``: which epoch, image size and global batch size a step belongs to (progressive resizing);
- ``learning_rate_schedule``: linear warm-up, then polynomial, linear or cosine decay, laid out in epochs;
- ``density_at``: the top-k density of the compressed strategies (warm-up, then a final phase if set);
- ``residual_rescale``: the factor that keeps error-feedback residuals in learning-rate-weighted units.

Everything is a function of the config and the step, so a resumed run finds the same schedules.

Progressive resizing trains in phases, each from a first epoch on, at its own image size and, if
given, its own global batch size (``data.resolution_schedule = "0:128:1024,14:224:512,32:288:256"``:
small images in big batches early, full size in smaller batches at the end, as in the fast ImageNet
recipes). An epoch of batch size B has ``len(split) // B`` steps, so with per-phase batches the steps
per epoch change between phases; ``EpochPlan`` is the one place that maps a global step to its epoch,
batch size and image size (and back), for the input pipeline, the learning-rate schedule, the top-k
density warm-up and the trainer's epoch ends.

The formulas and their sources: docs/techniques.md section 6.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax


class ScheduleError(ValueError):
  """A schedule cannot be laid out (a malformed resolution schedule, a batch larger than the split)."""


class Phase(NamedTuple):
  first_epoch: int
  image_size: int | None  # None: the source's own size (array datasets)
  global_batch_size: int | None = None  # None: the config's global_batch_size


def parse_resolution_schedule(text: str, default_size: int | None) -> tuple[Phase, ...]:
  """ "0:128,14:224:512" -> (Phase(0, 128, None), Phase(14, 224, 512)); "" -> (Phase(0, default_size),)."""
  if not text.strip():
    return (Phase(0, default_size),)
  try:
    phases = []
    for item in text.split(","):
      fields = [int(f) for f in item.split(":")]
      if len(fields) not in (2, 3):
        raise ValueError
      phases.append(Phase(*fields))
  except ValueError:
    raise ScheduleError(
      f"data.resolution_schedule={text!r} is not 'first_epoch:size[:global_batch],...' "
      f"(e.g. '0:128,14:224' or '0:128:1024,14:224:512')"
    ) from None
  phases.sort(key=lambda p: p.first_epoch)
  if phases[0].first_epoch != 0 or any(p.image_size < 8 for p in phases):
    raise ScheduleError(f"data.resolution_schedule={text!r}: the first phase must start at epoch 0 and sizes be >= 8")
  if len({p.first_epoch for p in phases}) != len(phases):
    raise ScheduleError(f"data.resolution_schedule={text!r}: two phases start at the same epoch")
  if any(p.global_batch_size is not None and p.global_batch_size <= 0 for p in phases):
    raise ScheduleError(f"data.resolution_schedule={text!r}: batch sizes must be positive")
  return tuple(phases)


class EpochPlan:
  """Epoch by epoch: global batch size, image size and first step, for ``num_epochs`` epochs of
  ``num_examples`` examples (the last partial batch of each epoch is dropped)."""

  def __init__(self, num_examples: int, num_epochs: int, phases: tuple[Phase, ...], default_batch_size: int):
    phases = tuple(sorted((Phase(*p) for p in phases), key=lambda p: p.first_epoch)) or (Phase(0, None),)
    first_epochs = [p.first_epoch for p in phases]
    self.phases, self.num_epochs = phases, num_epochs  # phases from num_epochs on are not in the plan
    self.batch_sizes, self.image_sizes = [], []
    for epoch in range(num_epochs):
      phase = phases[bisect.bisect_right(first_epochs, epoch) - 1]
      batch = phase.global_batch_size or default_batch_size
      if batch > num_examples:
        raise ScheduleError(
          f"the training split has {num_examples} examples, fewer than one global batch ({batch}) "
          f"of epoch {epoch}; lower the batch size."
        )
      self.batch_sizes.append(batch)
      self.image_sizes.append(phase.image_size)
    self.steps_per_epoch = [num_examples // b for b in self.batch_sizes]
    self.first_steps = [0]  # first step of each epoch, then the total
    for steps in self.steps_per_epoch:
      self.first_steps.append(self.first_steps[-1] + steps)
    self.num_steps = self.first_steps[-1]

  def epoch_at(self, step: int) -> int:
    """The epoch that ``step`` (0-based) belongs to (the last one for steps past the end)."""
    return min(bisect.bisect_right(self.first_steps, step) - 1, self.num_epochs - 1)

  def batch_in_epoch(self, step: int) -> tuple[int, int]:
    epoch = self.epoch_at(step)
    return epoch, step - self.first_steps[epoch]

  def batch_size_at(self, step: int) -> int:
    return self.batch_sizes[self.epoch_at(step)]

  def images(self, first: int, last: int) -> int:
    """The examples that steps ``first`` to ``last`` - 1 train on."""
    return sum(self.batch_size_at(s) for s in range(first, last))

  def image_size_at(self, step: int) -> int | None:
    return self.image_sizes[self.epoch_at(step)]

  def batch_shape_at(self, step: int, image_shape: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """Global (batch, height, width, channels) of ``step``, for images of ``image_shape`` (the dataset's,
    which progressive resizing's image size replaces)."""
    size = self.image_size_at(step)
    height, width, channels = image_shape
    return (self.batch_size_at(step), *((size, size) if size else (height, width)), channels)

  def leanest_step(self, image_shape: tuple[int, int, int]) -> int:
    """The first step of the plan's phase with the least compute per step (batch x pixels; the first of equals):
    where the step has the least backward pass to hide its communication behind, so a plan of buckets made there
    holds in the other phases too. Over the whole plan, whatever max_steps (safe to change on resume) reaches."""
    firsts = [s for s in self.first_steps if s < self.num_steps] or [0]  # first_steps ends with num_steps
    return min(firsts, key=lambda s: (math.prod(self.batch_shape_at(s, image_shape)[:3]), s))

  def epochs_done(self, step: int) -> float:
    """Epochs completed after ``step`` steps, fractional: 2.5 is halfway through the third epoch."""
    epoch, batch = self.batch_in_epoch(step)
    return epoch + batch / self.steps_per_epoch[epoch]

  def step_at(self, epochs: float) -> int:
    """The step at which ``epochs`` epochs are completed, rounded down (the inverse of ``epochs_done``)."""
    if epochs >= self.num_epochs:
      return self.num_steps
    epoch = int(epochs)
    # Rounded before the floor: in floats 0.3 x 100 is 29.999..., which would make 2.3 epochs step 229, and
    # epochs_done(136) is 1.3599999999999999, which would map back to step 135.
    return self.first_steps[epoch] + math.floor(round((epochs - epoch) * self.steps_per_epoch[epoch], 6))

  def ends_epoch(self, step: int) -> bool:
    """Whether ``step`` steps complete an epoch."""
    return step > 0 and self.first_steps[self.epoch_at(step - 1) + 1] == step

  @property
  def uniform(self) -> bool:
    return len(set(self.batch_sizes)) == 1


def total_steps(max_steps: int, plan: EpochPlan) -> int:
  """The steps a run takes: the plan's, or ``max_steps`` (the config's; 0: no limit) if fewer."""
  return min(max_steps, plan.num_steps) if max_steps else plan.num_steps


def peak_learning_rate(optimizer: ml_collections.ConfigDict, global_batch_size: int) -> float:
  """The linear scaling rule: ``base_lr * global_batch_size / 256`` (Goyal et al. 2017)."""
  return optimizer.base_lr * global_batch_size / 256


def learning_rate_schedule(optimizer: ml_collections.ConfigDict, plan: EpochPlan) -> optax.Schedule:
  """Warm-up then decay as a function of the step; evaluated on the host for logging as well.

  ``optimizer`` is ``config.optimizer`` (base_lr, warmup_epochs, decay, end_lr_factor). The shape is laid
  out in epochs (``plan.epochs_done``), so phases with different batch sizes, hence different steps per
  epoch, keep the warm-up and decay where the config puts them; the height follows the linear scaling
  rule with each step's batch size. With one batch size throughout this is the usual step schedule,
  except that the warm-up ends at exactly ``warmup_epochs`` (a step schedule rounds it to a whole step).
  """
  shape, peak = _schedule_shape(optimizer, plan)
  return lambda step: peak(step) * shape(step)


def momentum_schedule(optimizer: ml_collections.ConfigDict, plan: EpochPlan) -> float | optax.Schedule:
  """``optimizer.momentum``, or with ``momentum_schedule="cycle"`` a momentum that mirrors the learning
  rate's shape (one-cycle, Smith 2018; the DAWNBench ResNet-50 records cycle it): ``momentum`` where the
  learning rate is 0, ``min_momentum`` at its peak, so it falls during warm-up and rises during decay."""
  if optimizer.momentum_schedule == "constant":
    return optimizer.momentum
  shape, _ = _schedule_shape(optimizer, plan)
  high, low = optimizer.momentum, optimizer.min_momentum
  return lambda step: high - (high - low) * shape(step)


def _schedule_shape(optimizer: ml_collections.ConfigDict, plan: EpochPlan):
  """(shape in [0, 1] of the step, peak learning rate of the step's phase), both jittable."""
  warmup, total = min(optimizer.warmup_epochs, plan.num_epochs), plan.num_epochs
  first_steps = jnp.asarray(plan.first_steps, jnp.float32)
  epoch_marks = jnp.arange(plan.num_epochs + 1, dtype=jnp.float32)
  peaks = jnp.asarray([peak_learning_rate(optimizer, b) for b in plan.batch_sizes], jnp.float32)
  end = optimizer.end_lr_factor

  def epochs(step):
    return jnp.interp(jnp.asarray(step, jnp.float32), first_steps, epoch_marks)  # plan.epochs_done

  def peak(step):
    epoch = jnp.clip(jnp.searchsorted(first_steps, jnp.asarray(step, jnp.float32), side="right") - 1, 0, total - 1)
    return peaks[epoch]

  def shape(step):
    done = epochs(step)
    progress = jnp.clip((done - warmup) / max(total - warmup, 1e-9), 0.0, 1.0)
    if optimizer.decay == "poly":
      decay = end + (1 - end) * (1 - progress) ** 2
    elif optimizer.decay == "linear":
      decay = end + (1 - end) * (1 - progress)
    else:
      decay = end + (1 - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(done < warmup, done / max(warmup, 1e-9), decay)

  return shape, peak


def residual_rescale(schedule: optax.Schedule) -> Callable[[jax.Array], jax.Array]:
  """``step -> lr(step - 1) / lr(step)``: what turns residuals kept in units of the last step's learning
  rate into units of this step's (``comm.residual_units="update"``; 1 at step 0 and wherever lr(step) is 0,
  where nothing is applied)."""

  def factor(step):
    now, before = schedule(step), schedule(jnp.maximum(step - 1, 0))
    return jnp.where(now > 0, before / jnp.where(now > 0, now, 1.0), 1.0).astype(jnp.float32)

  return factor


def density_steps(comm: ml_collections.ConfigDict, plan: EpochPlan) -> tuple[int, tuple[int, float] | None]:
  """(the density warm-up's steps, (first step, density) of the last ``comm.final_density_epochs`` epochs or
  None): ``density_at``'s ``warmup_steps`` and ``final`` for the run's ``comm`` settings."""
  final = None
  if comm.final_density_epochs > 0:
    final = (plan.step_at(plan.num_epochs - comm.final_density_epochs), comm.final_density)
  return plan.step_at(comm.density_warmup_epochs), final


def density_at(
  step: int,
  target: float,
  warmup_steps: int,
  start: float = 0.25,
  phases: int = 4,
  final: tuple[int, float] | None = None,
) -> float:
  """The top-k density of ``step``: DGC-style warm-up, ``target``, then an optional final phase.

  The warm-up takes ``phases`` exponential steps from ``start`` down to ``target`` over ``warmup_steps``;
  with ``warmup_steps`` = 0, or ``target >= start``, the density is ``target`` from the first step.
  ``final`` = (first step, density) sends at another density from that step to the end (measured on
  Fashion-MNIST: moving a run's entries between the middle and the end gains nothing, docs/techniques.md
  section 11).
  Each phase keeps one density (k is a static shape, so each phase compiles once).
  """
  if final is not None and step >= final[0]:
    return final[1]
  if warmup_steps <= 0 or target >= start or step >= warmup_steps:
    return target
  phase = step * phases // warmup_steps
  return start * (target / start) ** (phase / phases)
