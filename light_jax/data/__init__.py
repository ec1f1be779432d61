"""Input: dataset sources, the grain pipeline and prefetching onto the mesh.

``load_dataset(config.data)`` returns (train source, eval source, info) for ``data.dataset``; a new
dataset (the ImageNet pipeline of issue #4) slots in here with its own source and transforms.
"""

from __future__ import annotations

import ml_collections

from light_jax.data import fashion_mnist
from light_jax.data.pipeline import EvalBatches, TrainBatches
from light_jax.data.prefetch import DevicePrefetcher
from light_jax.data.source import ArraySource, DataError, DatasetInfo

__all__ = ["ArraySource", "DataError", "DatasetInfo", "DevicePrefetcher", "EvalBatches", "TrainBatches",
           "load_dataset"]


def load_dataset(data_config: ml_collections.ConfigDict) -> tuple[ArraySource, ArraySource, DatasetInfo]:
  if data_config.dataset == "fashion_mnist":
    train = fashion_mnist.load(data_config.data_dir, "train").take(data_config.train_subset)
    test = fashion_mnist.load(data_config.data_dir, "test").take(data_config.eval_subset)
    info = DatasetInfo(num_classes=fashion_mnist.NUM_CLASSES, image_shape=train.images.shape[1:],
                       mean=fashion_mnist.MEAN, std=fashion_mnist.STD)
    return train, test, info
  if data_config.dataset == "imagenet2012":
    raise DataError(
        "data.dataset='imagenet2012': the ImageNet input pipeline (TFDS ArrayRecord, JPEG decoding, "
        "caches) is not built yet; it is the subject of issue #4. Until then train on "
        "configs/fashion_mnist.py.")
  raise DataError(f"unknown data.dataset {data_config.dataset!r}")
