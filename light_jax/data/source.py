"""What every dataset hands to the pipeline: random-access images and labels, plus facts about them."""

from __future__ import annotations

import dataclasses

import numpy as np


class DataError(RuntimeError):
  """A dataset is missing, corrupt or not supported yet; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """A split held in host memory: uint8 images (N, H, W, C) and int32 labels (N,)."""

  images: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, n: int) -> ArraySource:
    """The first ``n`` examples (all of them when n is 0)."""
    return self if n <= 0 else ArraySource(self.images[:n], self.labels[:n])


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  num_classes: int
  image_shape: tuple[int, int, int]
  mean: tuple[float, ...]  # per channel, 0-255 scale: images are normalised on the device
  std: tuple[float, ...]
