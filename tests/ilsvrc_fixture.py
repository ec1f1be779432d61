"""A tiny ILSVRC2012 download, laid out byte for byte like the real tars, for testing the TFDS preparation path.

The real ``ILSVRC2012_img_train.tar`` is a tar of 1000 per-class tars (``n01440764.tar`` holding
``n01440764_10026.JPEG``, ...) and ``ILSVRC2012_img_val.tar`` is a flat tar of ``ILSVRC2012_val_00000001.JPEG`` to
``..._00050000.JPEG``. TFDS's ``imagenet2012`` builder reads exactly that, so the fixture writes the same layout with
small generated JPEGs, plus the bad files the real download has (a truncated JPEG, a corrupt one, CMYK and greyscale
JPEGs, a PNG named .JPEG, an empty class), so the tests see what TFDS does with each of them.

Two facts of the TFDS builder shape the choices here:

* Validation labels come from TFDS's ``validation_labels.txt``, one synset per line, and the builder zips them with the
  *sorted names found in the val tar*. Labels are therefore only right when the tar holds the first N validation
  images, ``..._00000001`` to ``..._0000000N``; the fixture always writes that prefix and requires its synsets to
  cover their labels (``val_synsets(n)`` lists them).
* The builder repairs CMYK and PNG files only when their name is on its fixed lists (``CMYK_IMAGES``,
  ``PNG_IMAGES``, taken from the real train set). A class of ``CMYK_FIX_NAME`` or ``PNG_FIX_NAME`` that is among the
  synsets gets its bad file under that real name, so the repair runs; elsewhere bad files get ordinary names.
"""

from __future__ import annotations

import io
import os
import tarfile
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

# Paths inside the tensorflow_datasets package; the builder reads the same two files (imagenet_common.py).
_LABELS_FILE = "datasets/imagenet2012/labels.txt"
_VALIDATION_LABELS_FILE = "datasets/imagenet2012/validation_labels.txt"

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"

# One name from each of the builder's fix lists (CMYK_IMAGES, PNG_IMAGES in imagenet2012_dataset_builder.py).
CMYK_FIX_NAME = "n01739381_1309.JPEG"
PNG_FIX_NAME = "n02105855_2933.JPEG"

KINDS = ("ok", "truncated", "corrupt", "cmyk", "grey", "png")
# Bad kinds placed in the train tar (each once, in some non-empty class) and in the val tar (at every other index).
TRAIN_BAD_KINDS = ("truncated", "corrupt", "cmyk", "grey", "png")
VAL_BAD_KINDS = ("cmyk", "grey", "png", "truncated")


class Entry(NamedTuple):
  filename: str
  synset: str
  kind: str


def _read_tfds_text(relative_path: str) -> list[str]:
  """Lines of a text file shipped in tensorflow_datasets (imported lazily: it is only needed to pick names)."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  return tfds.core.tfds_path(relative_path).read_text().split()


def imagenet_synsets() -> list[str]:
  """The 1000 ILSVRC2012 synsets in TFDS's label order (label i is synsets[i])."""
  return _read_tfds_text(_LABELS_FILE)


def validation_synsets() -> list[str]:
  """True synset of each of the 50000 validation images, in filename order."""
  return _read_tfds_text(_VALIDATION_LABELS_FILE)


def val_filename(index: int) -> str:
  """Name of the validation image with 1-based ``index``, as in the real tar."""
  return f"ILSVRC2012_val_{index:08d}.JPEG"


def val_synsets(val_count: int) -> list[str]:
  """Distinct synsets of the first ``val_count`` validation images, in order: the synsets a fixture must include."""
  return list(dict.fromkeys(validation_synsets()[:val_count]))


def _class_colour(synset: str) -> np.ndarray:
  """A fixed RGB colour per synset, so the classes look different."""
  rng = np.random.default_rng(int(synset[1:]))
  return rng.integers(40, 216, size=3)


def _render(synset: str, rng: np.random.Generator) -> Image.Image:
  """A random-sized RGB picture: a gradient of the class colour with a class-dependent shape on it."""
  width, height = (int(s) for s in rng.integers(40, 91, size=2))
  colour = _class_colour(synset)
  ramp = np.linspace(0.5, 1.0, width)[None, :, None] * np.linspace(0.7, 1.0, height)[:, None, None]
  pixels = (ramp * colour[None, None, :]).astype(np.uint8)
  pixels = np.clip(pixels.astype(np.int16) + rng.integers(-8, 9, size=pixels.shape), 0, 255).astype(np.uint8)
  image = Image.fromarray(pixels, "RGB")
  draw = ImageDraw.Draw(image)
  x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
  box = (x0, y0, x0 + width // 3, y0 + height // 3)
  fill = tuple(int(255 - c) for c in colour)
  if int(synset[1:]) % 2:
    draw.ellipse(box, fill=fill)
  else:
    draw.rectangle(box, fill=fill)
  return image


def _encode(image: Image.Image, fmt: str) -> bytes:
  buffer = io.BytesIO()
  if fmt == "JPEG":
    image.save(buffer, format="JPEG", quality=90)
  else:
    image.save(buffer, format=fmt)
  return buffer.getvalue()


def _image_bytes(kind: str, synset: str, rng: np.random.Generator) -> bytes:
  """File content for one image of ``kind``; the bad kinds mimic the broken files of the real download."""
  return encode_as(kind, _render(synset, rng), rng)


def encode_as(kind: str, image: Image.Image, rng: np.random.Generator) -> bytes:
  """``image`` as a file of ``kind`` (one of ``KINDS``): a good JPEG or one of the download's bad files."""
  if kind == "ok":
    return _encode(image, "JPEG")
  if kind == "truncated":  # A valid header and the first half of the scan, as from an interrupted download.
    data = _encode(image, "JPEG")
    return data[: len(data) // 2]
  if kind == "corrupt":  # Not an image at all, under a .JPEG name.
    return rng.integers(0, 256, size=int(rng.integers(500, 2000)), dtype=np.uint8).tobytes()
  if kind == "cmyk":  # 4-component JPEG (PIL writes Adobe-inverted CMYK, as Photoshop does).
    return _encode(image.convert("CMYK"), "JPEG")
  if kind == "grey":  # 1-component JPEG.
    return _encode(image.convert("L"), "JPEG")
  if kind == "png":  # A PNG stream under a .JPEG name.
    return _encode(image, "PNG")
  raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
  """An uncompressed tar holding ``members`` (name, content) in order; an empty list gives an empty archive."""
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      info.mode = 0o644
      info.mtime = 1_338_000_000
      tar.addfile(info, io.BytesIO(data))
  return buffer.getvalue()


def make_ilsvrc_tars(
  manual_dir: str | os.PathLike, synsets: list[str], train_per_class: int, val_count: int, seed: int = 0
) -> dict[str, list[Entry]]:
  """Writes ``ILSVRC2012_img_train.tar`` and ``ILSVRC2012_img_val.tar`` into ``manual_dir``.

  Train: one per-class tar per synset, in the order given; the last synset's tar is empty (an empty class folder);
  every other class holds ``train_per_class`` good JPEGs, and the bad kinds of ``TRAIN_BAD_KINDS`` are added once
  each, round-robin over the non-empty classes (the CMYK/PNG one goes to its real class when that class is here).
  Validation: ``ILSVRC2012_val_00000001.JPEG`` .. ``val_count`` in shuffled tar order, with the bad kinds of
  ``VAL_BAD_KINDS`` at indices 2, 4, 6, 8 (1-based); their synsets (``val_synsets(val_count)``) must all be in
  ``synsets``.

  Returns {"train": [Entry], "validation": [Entry]}: (filename, synset, kind) of every file written, in tar order.
  """
  known = set(imagenet_synsets())
  unknown = [s for s in synsets if s not in known]
  if unknown:
    raise ValueError(f"not ILSVRC2012 synsets: {unknown}")
  if len(set(synsets)) != len(synsets) or len(synsets) < 2:
    raise ValueError(f"need at least 2 distinct synsets (the last one is the empty class), got {synsets}")
  missing = [s for s in val_synsets(val_count) if s not in synsets]
  if missing:
    raise ValueError(
      f"the first {val_count} validation images have synsets {missing} that are not in `synsets`; "
      f"TFDS labels validation images by position, so the val tar must hold images 1..{val_count} "
      f"and `synsets` must include val_synsets({val_count})"
    )
  rng = np.random.default_rng(seed)
  manual_dir = os.fspath(manual_dir)
  os.makedirs(manual_dir, exist_ok=True)

  filled = synsets[:-1]
  per_class: dict[str, list[tuple[Entry, bytes]]] = {s: [] for s in synsets}
  for synset in filled:
    numbers = rng.choice(np.arange(10, 40_000), size=train_per_class, replace=False)
    for number in sorted(int(n) for n in numbers):
      per_class[synset].append((Entry(f"{synset}_{number}.JPEG", synset, "ok"), b""))
  for i, kind in enumerate(TRAIN_BAD_KINDS):
    special = {"cmyk": CMYK_FIX_NAME, "png": PNG_FIX_NAME}.get(kind)
    if special and special.split("_")[0] in filled:
      synset, name = special.split("_")[0], special
    else:
      synset = filled[i % len(filled)]
      name = f"{synset}_{40_000 + i}.JPEG"  # Above the range of the good files, so names never collide.
    per_class[synset].append((Entry(name, synset, kind), b""))

  written: dict[str, list[Entry]] = {"train": [], "validation": []}
  class_tars = []
  for synset in synsets:
    members = []
    for entry, _ in per_class[synset]:
      members.append((entry.filename, _image_bytes(entry.kind, synset, rng)))
      written["train"].append(entry)
    class_tars.append((f"{synset}.tar", _tar_bytes(members)))
  with open(os.path.join(manual_dir, TRAIN_TAR), "wb") as f:
    f.write(_tar_bytes(class_tars))

  labels = validation_synsets()
  val_members = []
  # The real val tar is not in name order either; the builder sorts the names before pairing them with labels.
  for index in (int(i) for i in rng.permutation(np.arange(1, val_count + 1))):
    slot = index // 2 - 1
    kind = VAL_BAD_KINDS[slot] if index % 2 == 0 and slot < len(VAL_BAD_KINDS) else "ok"
    entry = Entry(val_filename(index), labels[index - 1], kind)
    val_members.append((entry.filename, _image_bytes(kind, entry.synset, rng)))
    written["validation"].append(entry)
  with open(os.path.join(manual_dir, VAL_TAR), "wb") as f:
    f.write(_tar_bytes(val_members))
  return written
