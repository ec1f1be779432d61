"""Fashion-MNIST from the IDX files of the Debian package ``dataset-fashion-mnist``."""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from light_jax.data.source import ArraySource, DataError

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
  "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
  "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
INSTALL_HINT = (
  "install it with `sudo apt-get install -y dataset-fashion-mnist` (Debian/Ubuntu; `make .venv` "
  "does this when run as root), or point --config.data.data_dir at a folder holding "
  + ", ".join(f for pair in FILES.values() for f in pair)
)
# Per-channel statistics of the training images (0-255 scale), for on-device normalisation.
MEAN, STD = (72.94,), (90.02,)
NUM_CLASSES = 10


def read_idx(path: str) -> np.ndarray:
  """Reads one gzipped IDX file (the MNIST format: magic, dims, big-endian uint8 payload)."""
  if not os.path.isfile(path):  # a folder, or a pipe (whose read would wait for a writer)
    raise DataError(f"{path} is not a regular file; reinstall it ({INSTALL_HINT}).")
  try:
    with gzip.open(path, "rb") as f:
      data = f.read()
  except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # cut off, or not gzip at all
    raise DataError(
      f"{path} is not a complete gzip file ({type(e).__name__}: {e}); the file may be truncated or corrupt: "
      f"reinstall it ({INSTALL_HINT})."
    ) from None
  except OSError as e:  # the disk's read error
    raise DataError(
      f"cannot read {path} ({e.strerror or e}); make it readable or check the disk, or reinstall it ({INSTALL_HINT})."
    ) from None
  if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
    raise DataError(
      f"{path} is not an unsigned-byte IDX file (bad magic number); the file may be corrupt: "
      f"reinstall it ({INSTALL_HINT})."
    )
  ndim = data[3]
  if len(data) < 4 + 4 * ndim:  # the content ends inside the header: no sizes to check the payload against
    raise DataError(
      f"{path} ends inside its IDX header ({len(data)} bytes): the file is truncated or corrupt; reinstall it "
      f"({INSTALL_HINT})."
    )
  shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
  payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
  if payload.size != int(np.prod(shape)):
    raise DataError(
      f"{path} holds {payload.size} bytes of data but its header says {shape}: the file is "
      f"truncated or corrupt; reinstall it ({INSTALL_HINT})."
    )
  return payload.reshape(shape)


def load(data_dir: str, split: str) -> ArraySource:
  """The ``split`` ("train" or "test") as uint8 images (N, 28, 28, 1) and int32 labels."""
  image_file, label_file = (os.path.join(data_dir, f) for f in FILES[split])
  if os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise DataError(
      f"data.data_dir={data_dir} is a file; give the folder that holds "
      f"{', '.join(f for pair in FILES.values() for f in pair)}."
    )
  missing = [p for p in (image_file, label_file) if not os.path.exists(p)]
  if missing:
    raise DataError(f"Fashion-MNIST not found: missing {', '.join(missing)}; {INSTALL_HINT}.")
  images = read_idx(image_file)
  labels = read_idx(label_file).astype(np.int32)
  # What the rest takes for granted, checked here: a file of another shape failed deep inside (a traceback), and
  # labels out of range trained without a word.
  fits = "only 28 x 28 sets of 10 classes fit: Fashion-MNIST, MNIST, KMNIST"
  if images.ndim != 3 or images.shape[1:] != (28, 28):
    raise DataError(
      f"{image_file} holds an array of shape {images.shape}, not N images of 28 x 28 ({fits}); {INSTALL_HINT}."
    )
  if labels.ndim != 1:
    raise DataError(f"{label_file} holds labels of shape {labels.shape}, not one per image; {INSTALL_HINT}.")
  if len(images) != len(labels):
    raise DataError(f"{image_file} has {len(images)} images but {label_file} has {len(labels)} labels.")
  if not len(images):
    raise DataError(f"{image_file} holds no images; {INSTALL_HINT}.")
  if labels.max() >= NUM_CLASSES:  # uint8: none below 0
    raise DataError(
      f"{label_file} holds label {labels.max()}: Fashion-MNIST has {NUM_CLASSES} classes (0-{NUM_CLASSES - 1}); the "
      f"file is corrupt or another dataset's ({fits}): reinstall it ({INSTALL_HINT})."
    )
  return ArraySource(images=images[..., None], labels=labels)
