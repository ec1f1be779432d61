"""Prepares TFDS ``imagenet2012`` in ArrayRecord format from the two ILSVRC2012 tars.

  python scripts/prepare_imagenet.py --manual_dir ~/ilsvrc --data_dir ~/tensorflow_datasets

``--manual_dir`` must hold ``ILSVRC2012_img_train.tar`` and ``ILSVRC2012_img_val.tar`` as downloaded from
image-net.org (registration needed); ``ILSVRC2012_img_test.tar``, if there, becomes an unlabelled ``test`` split.
The result is ``DATA_DIR/imagenet2012/5.1.0/*.array_record-*``, which the training input reads with
``tfds.data_source(..., decoders={"image": tfds.decode.SkipDecoding()})`` and no TensorFlow.

TFDS's builder needs TensorFlow to write the dataset (tf.io.gfile and its JPEG fixes), so TensorFlow is an optional
dependency used by this script only: ``pip install -e '.[prepare]'`` (TensorFlow and ``importlib_resources``). The
records keep each file's bytes as they were in the tar (TFDS only re-encodes the CMYK and PNG files on its fixed list
of known train images), so the reading side must cope with greyscale, CMYK, PNG and broken JPEGs.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import sys
import tarfile
import tempfile
import time

DATASET = "imagenet2012"
TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
TEST_TAR = "ILSVRC2012_img_test.tar"
_VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})\.JPEG")
_CLASS_TAR = re.compile(r"n\d{8}\.tar")


class PrepareError(Exception):
  """A problem with the inputs or the environment, reported as one message without a traceback."""


def check_manual_dir(manual_dir: str) -> None:
  """Fails early, naming every missing tar: TFDS itself would only log a warning and write a dataset without it."""
  if not os.path.isdir(manual_dir):
    raise PrepareError(
      f"--manual_dir {manual_dir} is not a directory. It must hold {TRAIN_TAR} and {VAL_TAR} "
      "(the ILSVRC2012 train and validation tars from image-net.org, unextracted)."
    )
  missing = [name for name in (TRAIN_TAR, VAL_TAR) if not os.path.isfile(os.path.join(manual_dir, name))]
  if missing:
    raise PrepareError(
      f"missing in --manual_dir {manual_dir}: {', '.join(missing)}. It must hold {TRAIN_TAR} "
      f"(a tar of 1000 per-class tars nXXXXXXXX.tar) and {VAL_TAR} (50000 flat "
      "ILSVRC2012_val_*.JPEG), as downloaded from image-net.org, unextracted."
    )


def _member_names(path: str) -> list[str]:
  """The names of the tar's members, from their headers (seconds, not a read of the whole tar). A tar cut inside a
  member fails in tarfile; one cut at a member's end or inside the next header ends the listing without a word,
  so the end-of-archive blocks (1,024 zero bytes after the last member) must be there too."""
  try:
    with tarfile.open(path, mode="r:") as tar:
      names = tar.getnames()  # seeks from header to header
      end = tar.offset
  except tarfile.TarError as e:
    raise PrepareError(f"{path} is not a readable tar ({e}); is the download complete?") from e
  except OSError as e:  # another user's, or a failing disk
    raise PrepareError(f"{path} cannot be read ({e.strerror}); check its permissions and the disk") from None
  with open(path, "rb") as f:
    f.seek(end)
    marker = f.read(1024)
  if len(marker) < 1024 or any(marker):
    raise PrepareError(
      f"{path} ends after {len(names)} members without the end-of-archive blocks: it was cut short; is the "
      "download complete?"
    )
  return names


def check_train_tar(train_tar: str) -> int:
  """Checks that the train tar is whole and holds only per-class tars, and returns how many: TFDS would find a cut
  only at its end, after reading the whole tar (hours), as a traceback. Reads the member headers only (seconds)."""
  names = _member_names(train_tar)
  unexpected = [name for name in names if not _CLASS_TAR.fullmatch(name)]
  if unexpected:
    raise PrepareError(
      f"{train_tar}: unexpected member {unexpected[0]!r}; the train tar holds only per-class tars nXXXXXXXX.tar "
      "(the ILSVRC2012 train tar from image-net.org, unextracted)"
    )
  if not names:
    raise PrepareError(f"{train_tar}: holds no class tars")
  known = imagenet_classes()
  unknown = [name for name in names if name.removesuffix(".tar") not in known]
  if unknown:  # TFDS's ClassLabel raised a KeyError traceback on it, mid-way
    raise PrepareError(
      f"{train_tar}: {unknown[0]} is not one of ImageNet's 1000 classes ({len(unknown)} member(s) such); the train "
      "tar must be image-net.org's ILSVRC2012 one (for a folder of your own images: scripts/prepare_image_folder.py)"
    )
  _check_class_tars(train_tar)
  return len(names)


def imagenet_classes() -> set[str]:
  """ImageNet's 1000 synsets (n01440764, ...): the labels file TFDS's imagenet2012 builder names its classes from."""
  package = importlib.util.find_spec("tensorflow_datasets").submodule_search_locations[0]
  with open(os.path.join(package, "datasets", DATASET, "labels.txt")) as f:
    return set(f.read().split())


def _check_class_tars(train_tar: str) -> None:
  """Each class tar inside the train tar starts with a tar header (its first 512 bytes read: seconds for 1000):
  TFDS met a damaged one as a ReadError traceback, after the classes before it."""
  with tarfile.open(train_tar, mode="r:") as tar:
    for member in tar.getmembers():
      head = tar.extractfile(member).read(tarfile.BLOCKSIZE)
      if not head:  # nothing: a class with no image
        continue
      try:
        tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape")
      except tarfile.EOFHeaderError:  # an empty tar (its end-of-archive blocks): a class with no image
        continue
      except tarfile.HeaderError as e:
        raise PrepareError(
          f"{train_tar}: its member {member.name} is not a readable tar ({e}); the download is damaged: download "
          f"{TRAIN_TAR} again"
        ) from None


def check_data_dir(data_dir: str) -> None:
  """Fails before the work where TFDS would: a --data_dir that is a file (NotADirectoryError), or one holding
  imagenet2012 in another format than ArrayRecord, TFRecord say, TFDS's default ("File format is already set")."""
  if os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise PrepareError(f"--data_dir {data_dir} is a file, not a directory; give a directory (made if missing)")
  existing = data_dir
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise PrepareError(f"--data_dir {data_dir}: {existing} is a file; give a directory")
  try:  # by writing (os.access says yes to root, who may still meet a read-only file system): else after the tars
    with tempfile.NamedTemporaryFile(dir=existing):
      pass
  except OSError as e:
    raise PrepareError(
      f"--data_dir {data_dir}: cannot write in {existing} ({e.strerror}); give a writable directory"
    ) from None
  for info_path in sorted(glob.glob(os.path.join(glob.escape(data_dir), DATASET, "*", "dataset_info.json"))):
    try:
      with open(info_path) as f:
        info = json.load(f)
    except (OSError, ValueError):
      continue  # TFDS says what is wrong with it
    # TFDS's default. Its own builder ignores alternativeFileFormats (`tfds convert_format` in place, TFDS 4.9.10),
    # and that command with --out_dir writes no dataset_info.json there: neither is a way out to give.
    file_format = info.get("fileFormat", "tfrecord")
    if file_format != "array_record":
      version_dir = os.path.dirname(info_path)
      raise PrepareError(
        f"{version_dir} already holds {DATASET} in {file_format} format, and TFDS cannot write the array_record "
        "format the training input reads beside it; give another --data_dir (then --config.data.data_dir=it), or "
        f"delete {version_dir} if nothing else reads it"
      )


def check_val_names(val_tar: str) -> int:
  """Checks that the val tar holds validation images 1..N exactly, and returns N.

  TFDS pairs the *sorted names in the tar* with its list of 50000 validation labels by position, so a tar missing
  any image (a partial download, a subset) would silently shift every later label. The full tar passes.
  """
  # Every member's name, as TFDS takes them (tar.getnames()): a directory entry shifts its labels too.
  names = sorted(_member_names(val_tar))
  numbers = []
  for name in names:
    match = _VAL_NAME.fullmatch(name)
    if not match:
      raise PrepareError(
        f"{val_tar}: unexpected member {name!r}; the validation tar holds only flat ILSVRC2012_val_NNNNNNNN.JPEG files"
      )
    numbers.append(int(match.group(1)))
  if not numbers:
    raise PrepareError(f"{val_tar}: holds no images")
  if numbers != list(range(1, len(numbers) + 1)):
    gap = next(i + 1 for i, n in enumerate(numbers) if n != i + 1)
    raise PrepareError(
      f"{val_tar}: holds {len(numbers)} images but not "
      f"ILSVRC2012_val_00000001..{len(numbers):08d} (first missing or repeated: {gap:08d}). "
      "TFDS assigns validation labels by position in the sorted names, so the labels would be "
      "wrong; use the complete validation tar."
    )
  return len(numbers)


def check_prepare_deps() -> None:
  """TensorFlow is an optional extra; say how to get it instead of failing deep inside TFDS.

  ``importlib_resources`` is in the same extra: TFDS 4.9.10's builder imports it on Python >= 3.9 without declaring
  it (tensorflow/datasets#11212), and only the preparation path reaches that import.
  """
  hint = (
    "TensorFlow is only needed to prepare the dataset (TFDS's imagenet2012 builder writes with it), not to "
    "train on it. Install the preparation extra: pip install -e '.[prepare]'"
  )
  for module in ("tensorflow", "importlib_resources"):
    if importlib.util.find_spec(module) is None:
      raise PrepareError(f"{module} is not installed. {hint}")
  try:
    import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise PrepareError(f"TensorFlow is installed but does not import ({e}). {hint}") from e


def prepare(manual_dir: str, data_dir: str):
  """Runs TFDS's builder; returns it for the summary. Reuses a dataset already prepared in ``data_dir``."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  builder = tfds.builder(DATASET, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare(
    download_dir=os.path.join(data_dir, "downloads"),
    download_config=tfds.download.DownloadConfig(
      manual_dir=manual_dir,
      try_download_gcs=False,  # imagenet2012 is not on the public GCS mirror; don't reach for it.
    ),
  )
  return builder


def summary(builder, data_dir: str, seconds: float) -> str:
  lines = [f"{DATASET} {builder.version} prepared in {seconds:.0f}s: {builder.data_dir}"]
  for name, split in sorted(builder.info.splits.items()):
    lines.append(
      f"  {name:<10} {split.num_examples:>9,d} examples in {split.num_shards} shard(s), "
      f"{split.num_bytes / 2**20:,.1f} MiB"
    )
  lines.append(
    f"  format: {builder.info.file_format.value}; read with tfds.data_source({DATASET!r}, "
    f"split=..., data_dir={data_dir!r}, download=False, decoders={{'image': tfds.decode.SkipDecoding()}})"
  )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--manual_dir", required=True, help=f"directory holding {TRAIN_TAR} and {VAL_TAR}")
  parser.add_argument("--data_dir", required=True, help="TFDS data dir to write imagenet2012/<version>/ into")
  args = parser.parse_args(argv)
  manual_dir = os.path.abspath(os.path.expanduser(args.manual_dir))
  data_dir = os.path.abspath(os.path.expanduser(args.data_dir))
  try:
    check_data_dir(data_dir)
    check_manual_dir(manual_dir)
    classes = check_train_tar(os.path.join(manual_dir, TRAIN_TAR))
    # Not refused: a subset of the classes is a valid dataset (the tests' has 7); a cut tar is (_member_names).
    print(f"{TRAIN_TAR}: {classes} class tars (the full ImageNet has 1000)", flush=True)
    images = check_val_names(os.path.join(manual_dir, VAL_TAR))
    print(f"{VAL_TAR}: {images} validation images (the full ImageNet has 50000)", flush=True)
    check_prepare_deps()
    start = time.time()
    builder = prepare(manual_dir, data_dir)
  except PrepareError as e:  # the inputs or a missing extra: the message says what to fix
    print(f"error: {e}", file=sys.stderr)
    return 2  # ExitCode.BAD_INPUT, as every script's bad input
  except OSError as e:  # a file it may not read or write (the tars are checked above), a full disk: one line
    where = f"{e.filename}: " if e.filename else ""
    print(f"error: {where}{e.strerror or e}; check the permissions and the free space, then run this again",
          file=sys.stderr)  # fmt: skip
    return 2
  print(summary(builder, data_dir, time.time() - start))
  return 0


if __name__ == "__main__":
  sys.exit(main())
