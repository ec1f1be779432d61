"""Small image folders of generated JPEGs (class-dependent content), with ImageNet's kinds of bad files."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from tests.ilsvrc_fixture import TRAIN_BAD_KINDS, encode_as


def class_image(label: int, rng: np.random.Generator, width: int, height: int) -> Image.Image:
  """A picture whose colours and stripes depend on the class, with noise: learnable, not trivial."""
  y, x = np.mgrid[0:height, 0:width].astype(np.float32)
  hue = np.array([(label * 67) % 256, (label * 151 + 80) % 256, (label * 29 + 160) % 256], np.float32)
  stripes = 0.5 + 0.5 * np.sin((x * np.cos(label) + y * np.sin(label)) / (3 + label % 5))
  pixels = hue * stripes[..., None] + rng.normal(0, 25, (height, width, 3))
  return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def jpeg_bytes(image: Image.Image) -> bytes:
  return encode_as("ok", image, None)


def bad_files(rng: np.random.Generator, label: int) -> dict[str, bytes]:
  """One of each kind of problem file ImageNet (or a user's folder) has, by kind."""
  good = class_image(label, rng, 64, 48)
  return {kind: encode_as(kind, good, rng) for kind in TRAIN_BAD_KINDS}


DECODABLE = ("ok", "cmyk", "grey", "png")


def make_image_folder(
  root: str,
  num_classes: int = 4,
  train_per_class: int = 12,
  val_per_class: int = 4,
  seed: int = 0,
  bad: bool = True,
  empty_class: bool = True,
) -> dict:
  """Writes ``root/{train,val}/class_NN/*.JPEG``; returns {split: [(relative path, label, kind)]}, classes
  sorted, files sorted (the converter writes them in a fixed random order of its own)."""
  rng = np.random.default_rng(seed)
  written = {"train": [], "val": []}
  names = [f"class_{c:02d}" for c in range(num_classes)] + (["class_zz_empty"] if empty_class else [])
  for split, per_class in (("train", train_per_class), ("val", val_per_class)):
    for label, name in enumerate(names):
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      files = {}
      if name.endswith("_empty"):
        continue
      for i in range(per_class):
        size = (int(rng.integers(40, 90)), int(rng.integers(40, 90)))
        files[f"img_{i:03d}.JPEG"] = ("ok", jpeg_bytes(class_image(label, rng, *size)))
      if bad and label == 1:
        for kind, data in bad_files(rng, label).items():
          files[f"bad_{kind}.JPEG"] = (kind, data)
      for file_name in sorted(files):
        kind, data = files[file_name]
        with open(os.path.join(folder, file_name), "wb") as f:
          f.write(data)
        written[split].append((f"{name}/{file_name}", label, kind))
  return written
