"""Host batches through grain: deterministic, per-process, augmented on the host as uint8.

Determinism contract: the *global* batch of step ``s`` is a function of (seed, s) only. The example
order is grain's seeded shuffle, reshuffled every epoch; process ``p`` of ``P`` takes rows
``[p * B/P, (p+1) * B/P)`` of every global batch; crop offsets and flips are drawn per global batch
from (seed, s). So a run on 2 processes sees exactly the batches of a run on 1, and a run resumed at
step ``s`` sees exactly what the uninterrupted run saw from ``s`` on.

Images leave the host as uint8 (4x less host-to-device traffic than float32); normalisation happens on
the device.

Two kinds of source: an ``ArraySource`` (small datasets held as arrays: pad-crop-flip per batch) and an
``ImageSource`` (JPEG records or a decoded cache: random-resized crop + flip per example, each example
drawing from its own generator seeded by (seed, step, global row), so the pixels do not depend on the
process or worker count either). Progressive resizing: ``resolution_schedule`` gives the training
image size (and optionally the global batch size) by epoch; the trainer compiles one step per shape.
JPEGs are decoded at that size; an array dataset's augmented images are resized to it (bilinear).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import grain
import numpy as np

from light_jax.data.image_source import ImageSource
from light_jax.data.source import ArraySource
from light_jax.data.transforms import resize_images
from light_jax.schedules import EpochPlan


def pad_crop_flip(images: np.ndarray, offsets: np.ndarray, flips: np.ndarray, padding: int) -> np.ndarray:
  """Random crop of the zero-padded images back to their size, then horizontal flip, in one gather.

  Args:
    images: uint8 (B, H, W, C).
    offsets: int (B, 2): top-left corner of each crop in the padded image, each in [0, 2 * padding].
    flips: bool (B,): flip this image left-right.
  """
  b, h, w, _ = images.shape
  padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
  rows = offsets[:, 0, None] + np.arange(h)  # (B, H)
  cols = offsets[:, 1, None] + np.arange(w)  # (B, W)
  cols = np.where(flips[:, None], cols[:, ::-1], cols)
  return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def shuffle_seed(seed: int) -> int:
  """grain's shuffle seed for run seed ``seed``: unrelated for neighbouring seeds."""
  return int(np.random.SeedSequence([seed, 0x5EED]).generate_state(1)[0])


class TrainBatches:
  """Process-local training batches, one per global step, for ``num_epochs`` epochs.

  ``resolution_schedule`` phases (``schedules.Phase``: first epoch, image size, optional global batch size)
  give each epoch its image size and batch size; ``plan`` (``schedules.EpochPlan``) maps steps to epochs.
  An epoch of batch size B is ``len(source) // B`` steps (the last partial batch is dropped; the
  reshuffle gives those examples a place in later epochs).
  """

  def __init__(
    self,
    source: ArraySource | ImageSource,
    global_batch_size: int,
    num_epochs: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    crop_padding: int = 0,
    random_flip: bool = False,
    resolution_schedule: tuple[tuple[int, ...], ...] = (),
  ):
    if isinstance(source, ImageSource) and not resolution_schedule:
      raise ValueError("an ImageSource needs a resolution_schedule ((first epoch, image size), ...)")
    self.plan = EpochPlan(len(source), num_epochs, resolution_schedule, global_batch_size)
    for batch in set(self.plan.batch_sizes):
      if batch % process_count:
        raise ValueError(f"global batch {batch} does not split over {process_count} processes")
    self.source = source
    self.num_steps = self.plan.num_steps
    self.seed = seed
    self.process_index, self.process_count = process_index, process_count
    self.crop_padding = crop_padding
    self.random_flip = random_flip
    # grain's index shuffle: a new permutation of the split every epoch, from one seed. grain seeds epoch e
    # with seed + e, so the run seed is hashed first: else seed 1's epoch 0 would be seed 0's epoch 1.
    self._order = grain.MapDataset.range(len(source)).shuffle(seed=shuffle_seed(seed)).repeat()
    self.dataset = grain.MapDataset.range(self.num_steps).map(self.load)

  def indices(self, step: int) -> tuple[np.ndarray, slice]:
    """(source indices of this process's examples in global batch ``step``, their rows in that batch)."""
    epoch, batch_in_epoch = self.plan.batch_in_epoch(step)
    global_batch = self.plan.batch_sizes[epoch]
    local_batch = global_batch // self.process_count
    first = epoch * len(self.source) + batch_in_epoch * global_batch
    rows = slice(self.process_index * local_batch, (self.process_index + 1) * local_batch)
    start = first + rows.start
    indices = np.fromiter((self._order[start + j] for j in range(local_batch)), np.int64, local_batch)
    return indices, rows

  def load(self, step: int) -> dict[str, np.ndarray]:
    """The process-local part of global batch ``step``: {"images": uint8 (b, H, W, C), "labels": int32 (b,)}."""
    indices, rows = self.indices(step)
    if isinstance(self.source, ImageSource):
      size = self.image_size_at(step)
      return _stack(
        [
          self.source.train_example(int(i), np.random.default_rng((self.seed, step, row)), size, self.random_flip)
          for i, row in zip(indices, range(rows.start, rows.stop))
        ]
      )
    images, labels = self.source.images[indices], self.source.labels[indices]
    rng = np.random.default_rng((self.seed, step))
    # Drawn for the whole global batch, then sliced: independent of the process count.
    global_batch = self.plan.batch_size_at(step)
    offsets = rng.integers(0, 2 * self.crop_padding + 1, size=(global_batch, 2))[rows]
    flips = (rng.random(global_batch) < 0.5)[rows] & self.random_flip
    if self.crop_padding or self.random_flip:
      images = pad_crop_flip(images, offsets, flips, self.crop_padding)
    size = self.image_size_at(step)
    if size is not None and images.shape[1:3] != (size, size):  # progressive resizing of an array dataset
      images = resize_images(images, size)
    return {"images": images, "labels": labels}

  def image_size_at(self, step: int) -> int | None:
    """Training image size of ``step`` under the resolution schedule (None: the source's own size)."""
    return self.plan.image_size_at(step)

  def iterator(self, start_step: int = 0, read_threads: int = 1, buffer: int = 4, workers: int = 0):
    """Batches from ``start_step`` on, assembled ahead of use by ``read_threads`` grain threads in each of
    ``workers`` worker processes (0: in this process)."""
    return _iterate(self.dataset[start_step:], read_threads, buffer, workers)


MAX_EVAL_PADDING = 0.05  # padding rows, as a share of the split, above which the trainer suggests another batch


def padded_eval_examples(examples: int, global_batch_size: int) -> int:
  """Examples an evaluation runs, padding rows included: every batch is whole, so the last one is padded."""
  return math.ceil(examples / global_batch_size) * global_batch_size


class EvalBatches:
  """Every example of a split exactly once, in order, in padded global batches with a 0/1 ``mask``."""

  def __init__(
    self,
    source: ArraySource | ImageSource,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    image_size: int | None = None,
  ):
    if isinstance(source, ImageSource) and not image_size:
      raise ValueError("an ImageSource needs the eval image_size")
    self.image_size = image_size
    self.source = source
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.process_index = process_index
    self.num_batches = math.ceil(len(source) / global_batch_size)
    self.dataset = grain.MapDataset.range(self.num_batches).map(self.load)

  @property
  def padded_examples(self) -> int:
    return padded_eval_examples(len(self.source), self.global_batch_size)

  def better_batch_size(self, multiple: int) -> int | None:
    """A global batch, a multiple of ``multiple`` (the device count) and no larger than the current one, whose
    padding is at most ``MAX_EVAL_PADDING`` of the split: the one with the fewest batches (the least padding where
    none is that close); None where it would be the current batch."""
    examples = len(self.source)
    candidates = []
    for count in range(self.num_batches, max(math.ceil(examples / multiple), self.num_batches) + 1):
      batch = math.ceil(examples / count / multiple) * multiple
      padded = math.ceil(examples / batch) * batch
      if padded <= (1 + MAX_EVAL_PADDING) * examples:
        candidates = [(padded, batch)]
        break
      candidates.append((padded, batch))
    best = min(candidates, key=lambda c: (c[0], -c[1]))[1]
    return None if best >= self.global_batch_size else best

  def padding_advice(self, multiple: int) -> str | None:
    """Where padding is over ``MAX_EVAL_PADDING`` of the split (computed at every evaluation, then thrown away):
    what it costs, and a batch that pads less (``better_batch_size``)."""
    examples, padded = len(self.source), self.padded_examples
    better = self.better_batch_size(multiple) if padded > (1 + MAX_EVAL_PADDING) * examples else None
    if better is None:
      return None
    rows = math.ceil(examples / better) * better
    batches = f"{rows // better} batch{'es' if rows // better > 1 else ''}"
    return (
      f"evaluation pads {examples:,} examples to {padded:,} rows in batches of {self.global_batch_size:,} "
      f"({(padded - examples) / padded:.0%} of its compute is padding): --config.data.eval_batch_size={better} "
      f"evaluates in {batches} with {rows - examples:,} padding rows"
    )

  def load(self, batch: int) -> dict[str, np.ndarray]:
    start = batch * self.global_batch_size + self.process_index * self.local_batch_size
    positions = np.arange(start, start + self.local_batch_size)
    valid = positions < len(self.source)
    indices = np.where(valid, positions, 0)  # padding rows repeat example 0 and are masked out
    if isinstance(self.source, ImageSource):
      examples = [self.source.eval_example(int(i), self.image_size) for i in indices]
      # A bad image's stand-in (the next good record) would count that record twice: it counts for nothing.
      own = np.array([is_own for _, _, is_own in examples])
      return {**_stack([example[:2] for example in examples]), "mask": (valid & own).astype(np.float32)}
    return {
      "images": self.source.images[indices],
      "labels": self.source.labels[indices],
      "mask": valid.astype(np.float32),
    }

  def iterator(self, read_threads: int = 1, buffer: int = 4, workers: int = 0):
    return _iterate(self.dataset, read_threads, buffer, workers)


def _stack(examples: list[tuple[np.ndarray, int]]) -> dict[str, np.ndarray]:
  """(image, label) pairs of an ImageSource as a batch."""
  return {
    "images": np.stack([image for image, _ in examples]),
    "labels": np.array([label for _, label in examples], np.int32),
  }


def _iterate(dataset: grain.MapDataset, read_threads: int, buffer: int, workers: int):
  """Iterates ``dataset`` with ``read_threads`` grain threads, in ``workers`` worker processes (0: here)."""
  dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=buffer))
  if workers > 0:
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers), worker_init_fn=ignore_signals)
  return iter(dataset)


def ignore_signals(*_) -> None:
  """Initializer of grain's input worker processes: they ignore SIGINT and SIGTERM.

  A terminal Ctrl-C or a process-group SIGTERM reaches the workers too; the main process's
  PreemptionGuard finishes the step and saves, which needs them alive, and stops them when it exits.
  Should the main process die without stopping them (a second signal exits at once), they exit too.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  parent = os.getppid()

  def exit_with_parent():
    while os.getppid() == parent:
      time.sleep(1)
    os._exit(1)

  threading.Thread(target=exit_with_parent, daemon=True).start()
