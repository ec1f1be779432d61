"""Small models and data shared by the tests (never a stand-in for the code under test)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from light_jax.data import ArraySource, DatasetInfo


class TinyCNN(nn.Module):
  """A model without BatchNorm: its gradient over a batch is exactly the mean of per-shard gradients."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x))
    x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def random_source(n: int, shape=(12, 12, 1), num_classes: int = 10, seed: int = 0) -> ArraySource:
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
  labels = rng.integers(0, num_classes, size=n).astype(np.int32)
  return ArraySource(images, labels)


def info_for(source: ArraySource, num_classes: int = 10) -> DatasetInfo:
  return DatasetInfo(num_classes=num_classes, image_shape=source.images.shape[1:], mean=(127.5,), std=(64.0,))
