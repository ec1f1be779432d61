"""Input: dataset sources, the grain pipeline and prefetching onto the mesh.

``load_dataset(config.data)`` returns (train source, eval source, info) for ``data.dataset``; a new
dataset slots in here with its own source. Fashion-MNIST is held as arrays (``ArraySource``);
ImageNet (TFDS ``imagenet2012``) and converted image folders are JPEG records read by index, decoded
and cropped per example (``ImageSource``), optionally from a decoded cache on local disk or in memory.
"""

from __future__ import annotations

import os

import ml_collections
from absl import logging

from light_jax.data import fashion_mnist, records, transforms
from light_jax.data.image_source import ImageSource
from light_jax.data.pipeline import EvalBatches, TrainBatches
from light_jax.data.prefetch import DevicePrefetcher, InputFailed
from light_jax.data.source import ArraySource, DataError, DatasetInfo

__all__ = [
  "ArraySource",
  "DataError",
  "DatasetInfo",
  "DevicePrefetcher",
  "EvalBatches",
  "ImageSource",
  "InputFailed",
  "TrainBatches",
  "load_dataset",
]

# ImageNet's per-channel pixel statistics (0-255), for on-device normalisation.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def load_dataset(data_config: ml_collections.ConfigDict) -> tuple[ArraySource, ArraySource, DatasetInfo]:
  if data_config.dataset == "fashion_mnist":
    data_dir = os.path.expanduser(data_config.data_dir)
    train, test = fashion_mnist.load(data_dir, "train"), fashion_mnist.load(data_dir, "test")
    _check_subsets(data_config, len(train), len(test))
    train, test = train.take(data_config.train_subset), test.take(data_config.eval_subset)
    info = DatasetInfo(
      num_classes=fashion_mnist.NUM_CLASSES,
      image_shape=train.images.shape[1:],
      mean=fashion_mnist.MEAN,
      std=fashion_mnist.STD,
    )
    return train, test, info
  if data_config.dataset in ("imagenet2012", "image_folder"):
    return _load_jpeg_dataset(data_config)
  raise DataError(f"unknown data.dataset {data_config.dataset!r}")


def _check_subsets(data_config: ml_collections.ConfigDict, train: int, test: int) -> None:
  """Warns of a ``data.train_subset`` or ``data.eval_subset`` larger than its split, which then runs whole."""
  for field, size in (("train_subset", train), ("eval_subset", test)):
    if data_config[field] > size:
      logging.warning("data.%s=%d is more than the split's %d examples: all %d are used", field, data_config[field],
                      size, size)  # fmt: skip


class _Subset:
  """The first ``n`` records (smoke tests, ``data.train_subset``)."""

  def __init__(self, records, n: int):
    self._records, self._n = records, min(n, len(records))
    self.identity = f"{records.identity}:first{self._n}"
    self.fingerprint = f"{records.fingerprint}:first{self._n}"
    self.earlier_names = tuple((i + f":first{self._n}", f + f":first{self._n}") for i, f in records.earlier_names)

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, index: int):
    if not 0 <= index < self._n:
      raise IndexError(index)
    return self._records[index]


def _load_jpeg_dataset(data_config) -> tuple[ImageSource, ImageSource, DatasetInfo]:
  data_dir = os.path.expanduser(data_config.data_dir)
  if data_config.dataset == "imagenet2012":
    train = records.TfdsRecords("imagenet2012", "train", data_dir)
    test = records.TfdsRecords("imagenet2012", "validation", data_dir)
  else:
    train, test = records.FolderRecords(data_dir, "train"), records.FolderRecords(data_dir, "val")
  num_classes = train.num_classes
  _check_subsets(data_config, len(train), len(test))
  if data_config.train_subset:
    train = _Subset(train, data_config.train_subset)
  if data_config.eval_subset:
    test = _Subset(test, data_config.eval_subset)
  if data_config.cache in ("disk", "memory"):
    train = _decoded_cache(train, data_config)
  if not transforms.region_decoding_available():
    logging.warning(
      "light_jax was installed without its JPEG region decoder (no C compiler, libjpeg or Python headers "
      "then), so whole JPEGs are decoded: about 10-20%% slower at 128 px. Fix: apt-get install gcc "
      "libjpeg-dev python3-dev, then pip install -e . again (or rm .venv/.installed; make .venv)."
    )
  scale = (data_config.random_scale_min, 1.0)
  info = DatasetInfo(
    num_classes=num_classes,
    image_shape=(data_config.image_size, data_config.image_size, 3),
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
  )
  return (
    ImageSource(train, num_classes, f"{data_config.dataset}/train", scale, data_config.reduced_decode),
    ImageSource(test, num_classes, f"{data_config.dataset}/eval", scale, data_config.reduced_decode),
    info,
  )


def _decoded_cache(source, data_config):
  """The decoded cache of ``source`` (built on first use, or again when built from other records, if it
  fits the budget), or ``source`` itself."""
  cache_dir = os.path.expanduser(data_config.cache_dir)
  current = path = records.cache_path(cache_dir, source.identity, data_config.cache_size)
  built_from = records.DecodedCache(path).source_fingerprint if os.path.exists(path) else None
  # Caches named otherwise before are still their records' cache: read as they are rather than decode the split
  # again, which takes hours for ImageNet. Named by a TFDS split's data_dir as typed (``earlier_names``), or by
  # the records' fingerprint with none kept inside (a TFDS split's fingerprint then has not changed; an image
  # folder's has).
  names = ((source.identity, source.fingerprint), *source.earlier_names)
  if not os.path.exists(path):
    for identity, fingerprint in names:
      earlier = records.cache_path(cache_dir, identity, data_config.cache_size)
      legacy = records.cache_path(cache_dir, fingerprint, data_config.cache_size)
      if os.path.exists(earlier):
        path, built_from = earlier, records.DecodedCache(earlier).source_fingerprint
        break
      if os.path.exists(legacy):
        path, built_from = legacy, fingerprint
        break
  fresh = built_from in {fingerprint for _, fingerprint in names}
  # The budget holds for a cache already there too, against the same estimate as before it was built: the same
  # config must not train on the cache's pixels in one place or run and on the JPEGs in another (the file is a
  # little larger than the estimate, so a budget between the two would read the JPEGs once the cache exists).
  size = records.estimate_cache_bytes(source, data_config.cache_size)
  if size > data_config.cache_budget_gb * 1e9:
    logging.warning(
      "decoded cache: %d images at %d px %s %.1f GB, over data.cache_budget_gb=%g; reading the JPEGs instead "
      "(raise the budget or lower data.cache_size)",
      len(source),
      data_config.cache_size,
      "take" if fresh else "would take",
      size / 1e9,
      data_config.cache_budget_gb,
    )
    return source
  if not fresh:
    if os.path.exists(path):  # e.g. the image folder was converted again: its labels may have changed
      logging.warning(
        "decoded cache %s was built from other records than %s holds now (converted or prepared again since); "
        "building it again",
        path,
        source.identity,
      )
      if path != current:  # a stale cache under an earlier name: the new one takes the current name
        try:
          os.remove(path)
        except FileNotFoundError:  # another process of the run (on this machine) removed it first
          pass
        except OSError as e:  # another user's, in a shared /tmp, say: left there
          logging.warning("decoded cache: cannot remove the stale %s (%s); it is left there", path, e.strerror)
        path = current
    try:
      os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
      raise DataError(
        f"data.cache_dir={cache_dir}: cannot make it ({e.strerror}); give a writable folder, or data.cache=none"
      ) from None
    if not os.access(cache_dir, os.W_OK | os.X_OK):
      raise DataError(
        f"data.cache_dir={cache_dir}: cannot write there (permissions, or a read-only file system); give a "
        "writable folder, or data.cache=none"
      )
    logging.info("decoded cache: building %s (%d images, about %.2f GB), once", path, len(source), size / 1e9)
    records.build_disk_cache(source, path, data_config.cache_size)
  cache = records.DecodedCache(path, in_memory=data_config.cache == "memory")
  if len(cache) != len(source):
    raise DataError(
      f"decoded cache {path} holds {len(cache)} images but the dataset has {len(source)}; "
      f"delete the file to rebuild it."
    )
  logging.info(
    "decoded cache: every one of the %d training images is read from %s (%.1f MB%s) instead of its JPEG",
    len(cache),
    path,
    cache.nbytes() / 1e6,
    ", held in memory" if cache.in_memory else "",
  )
  return cache
