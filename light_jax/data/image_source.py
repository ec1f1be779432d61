"""Labelled images from record files, transformed on the host, with bad records skipped and counted.

``ImageSource`` is what the pipeline (pipeline.py) asks for one example at a time:
``train_example(index, rng, size)`` (random-resized crop + flip) and ``eval_example(index, size)``
(centre crop). Its records are encoded (JPEG bytes: decoded with reduced-size JPEG decoding) or a
decoded cache (pixels: no decoding at all); the same transforms, with boxes drawn on the cached
(smaller) image in the second case.

Bad records: ImageNet has CMYK and greyscale JPEGs (converted to RGB), PNGs named .JPEG (decoded by
content) and, in users' data, truncated or corrupt files. A record that cannot be decoded is replaced
by the next record that can (index + 1, + 2, ...), with that record's own label, so a batch never holds
a wrong label or a hole, and the choice depends only on the index: the same in every run, process and
worker count. One exception: a JPEG damaged inside that still ends with its end marker is bad only for the
training crops whose rows reach the damage where the region decoder (``_jpeg_region``) is built, and for every
crop where it is not (transforms.decode_crop_resize). Each bad file is logged once, with its name, by the
process or grain worker that meets it; ``bad_records`` holds the names this process has met.
"""

from __future__ import annotations

import numpy as np
from absl import logging

from light_jax.data import transforms
from light_jax.data.source import DataError

MAX_CONSECUTIVE_BAD = 64


class ImageSource:
  """Random-access (image, label) examples from ``records`` (records.py)."""

  def __init__(
    self,
    records,
    num_classes: int,
    name: str,
    random_scale: tuple[float, float] = (0.08, 1.0),
    reduced_decode: bool = True,
  ):
    self.records = records
    self.num_classes = num_classes
    self.name = name
    self.random_scale = tuple(random_scale)
    self.reduced_decode = reduced_decode
    self.bad_records: set[str] = set()

  def __len__(self) -> int:
    return len(self.records)

  def train_example(self, index: int, rng: np.random.Generator, size: int, random_flip: bool = True):
    """uint8 (size, size, 3) random-resized crop (optionally mirrored) of example ``index``, and its label."""

    def make(payload):
      flip = random_flip and rng.random() < 0.5
      if isinstance(payload, bytes):
        return transforms.decode_crop_resize(payload, size, rng, flip, self.random_scale, self.reduced_decode)
      image = _cached_image(payload)
      box = transforms.random_resized_crop_box(*image.size, rng, self.random_scale)
      return transforms.crop_resize(image, box, size, flip)

    return self._first_good(index, make)

  def eval_example(self, index: int, size: int):
    """uint8 (size, size, 3) centre crop of example ``index``, its label, and whether it is that example's own
    (False: the image was bad and the next good record stands in, which evaluation must not count twice)."""

    def make(payload):
      if isinstance(payload, bytes):
        return transforms.decode_crop_resize(payload, size, reduced_decode=self.reduced_decode)
      image = _cached_image(payload)
      return transforms.crop_resize(image, transforms.center_crop_box(*image.size), size)

    image, label, offset = self._first_good(index, make, with_offset=True)
    return image, label, offset == 0

  def _first_good(self, index: int, make, with_offset: bool = False):
    n = len(self.records)
    for offset in range(MAX_CONSECUTIVE_BAD):
      payload, label, file_name = self.records[(index + offset) % n]
      if not 0 <= label < self.num_classes:  # the records' own check, for a decoded cache built before it
        raise DataError(
          f"{self.name}: {file_name} has label {label}, but the dataset's labels are 0-{self.num_classes - 1}: its "
          "files were written with another list of classes, or are damaged. Prepare them again, and delete the "
          "decoded cache (in data.cache_dir) if one was built from them."
        )
      try:
        return (make(payload), label, offset) if with_offset else (make(payload), label)
      except transforms.BadImage as e:
        if file_name not in self.bad_records:
          self.bad_records.add(file_name)
          logging.warning(
            "%s: skipping bad image %s (%s); the next good record stands in for it", self.name, file_name, e
          )
    raise DataError(
      f"{self.name}: {MAX_CONSECUTIVE_BAD} consecutive records from index {index} cannot be "
      f"decoded (last: {file_name}); the dataset files are probably damaged: prepare them again."
    )


def _cached_image(pixels: np.ndarray | None):
  if pixels is None:  # the cache marks records whose source image was bad
    raise transforms.BadImage("the decoded cache holds no pixels for it (bad source image)")
  return transforms.as_image(pixels)
