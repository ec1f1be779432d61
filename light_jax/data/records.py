"""Encoded image records with random access, and the decoded caches built from them.

Three kinds of record files, all read by index without TensorFlow:

- ``TfdsRecords``: the TFDS ``imagenet2012`` dataset prepared in ArrayRecord format
  (``scripts/prepare_imagenet.py``), read with ``tfds.data_source`` and the JPEG bytes left encoded.
- ``FolderRecords``: an image folder (``split/class_name/*.jpg``) converted by ``convert_image_folder``
  into one ArrayRecord file per split, in a fixed random order; each record is ``label, file name,
  encoded bytes``.
- ``DecodedCache``: pixels already decoded and scaled to a shorter side of ``cache_size`` px, uint8,
  one record per source record in the same order (an empty record where the source image is bad), on
  local disk (ArrayRecord) or in memory. Built once, then read instead of the JPEGs: no decode at all.
  Its last record holds the fingerprint of the records it was built from, so a cache of records since
  converted again (other labels, say) is told apart from a current one.

Each records class has an ``identity`` (which split of which dataset, where: names the cache file) and a
``fingerprint`` (that, and what distinguishes one conversion of it from another).

Each ``__getitem__`` returns ``(payload, label, file_name)``; the payload is encoded bytes, or for the
cache a uint8 (h, w, 3) array (``None`` for a bad record).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import struct
import tempfile
import time
import types
import uuid
from collections.abc import Callable

import numpy as np
from absl import logging

from light_jax import child_process
from light_jax.data import transforms
from light_jax.data.source import DataError

_FOLDER_HEADER = struct.Struct("<iI")  # label, file-name length
_CACHE_HEADER = struct.Struct("<iHH")  # label, height, width (0 x 0: bad source image)
_CACHE_TRAILER = b"light_jax decoded cache of "  # + the source's fingerprint: the cache's last record
_CONVERSION_SEED = 0  # the record order of a converted image folder
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")


@contextlib.contextmanager
def _writer(path: str):
  """An ArrayRecord writer to a temporary file renamed to ``path`` at the end; on error it is closed and
  removed (no stray ``.tmp`` files)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # unique even when hosts sharing a directory have equal pids
  # group_size:1 keeps every record separately addressable (random access reads one record); no
  # compression: decompressing pixels would cost the CPU time the decoded cache exists to save.
  writers = [ArrayRecordWriter(tmp, "group_size:1,uncompressed")]

  def discard():
    with contextlib.suppress(Exception):
      writers[0].close()
    # Dropped too: a close that failed (a full disk) leaves the file open until the writer goes, and with it the
    # space of the removed file, which the error's traceback would otherwise hold on to.
    writers.clear()
    with contextlib.suppress(OSError):
      os.remove(tmp)

  def failed(e: RuntimeError) -> DataError:
    return DataError(f"writing {path} failed ({_reason(e)}); check the free space there and run again")

  def write(record: bytes) -> None:  # a full disk shows here once ~16 MB are buffered, else at the close
    try:
      writers[0].write(record)
    except RuntimeError as e:
      raise failed(e) from None

  # Also at exit: a program that leaves at a signal through its exit handlers (the benchmarks) never gets to the
  # except below.
  atexit.register(discard)
  try:
    yield types.SimpleNamespace(write=write)
  except BaseException:
    discard()
    raise
  finally:
    atexit.unregister(discard)
  try:
    writers[0].close()
  except RuntimeError as e:
    discard()
    raise failed(e) from None
  os.replace(tmp, path)


def _read(source, index: int, path: str | Callable[[int], str], fix: str):
  """Record ``index`` of ``source``; a file damaged or gone since it was opened (riegeli's RuntimeError: "chunk data
  hash mismatch", "open() failed") is a DataError naming ``path`` (or ``path(index)``, worked out only then) and
  ``fix``, not a traceback after an epoch."""
  try:
    return source[index]
  except RuntimeError as e:
    raise DataError(
      f"{path(index) if callable(path) else path} is damaged or unreadable ({_reason(e)}); {fix}."
    ) from None


def _reason(error: RuntimeError) -> str:
  """The first line of riegeli's error, or its type where the message is empty (riegeli's often are)."""
  text = str(error).strip()
  return text.splitlines()[0][:200] if text else type(error).__name__


def _reader(path: str, fix: str):
  import grain

  try:
    return grain.sources.ArrayRecordDataSource([path])
  except RuntimeError as e:  # riegeli's, often with an empty message
    reason = f": {str(e).splitlines()[0][:200]}" if str(e).strip() else ""
    raise DataError(f"{path} is truncated or damaged (not a readable ArrayRecord file{reason}); {fix}.") from None


class TfdsRecords:
  """A split of a TFDS dataset prepared as ArrayRecord, images left as JPEG bytes."""

  def __init__(self, name: str, split: str, data_dir: str):
    import tensorflow_datasets as tfds

    prepare = (
      f"Prepare it once from the ILSVRC tar files with `python scripts/prepare_imagenet.py --manual_dir "
      f"DIR_WITH_TARS --data_dir {data_dir}` (needs `pip install -e '.[prepare]'`), or point --config.data.data_dir "
      "at it."
    )
    if os.path.isfile(os.path.join(os.path.expanduser(data_dir), "info.json")):  # prepare_image_folder.py's output
      prepare = (
        f"{data_dir} holds a converted image folder (info.json): train on it with --config.data.dataset=image_folder"
      )
    if not os.path.isdir(os.path.join(os.path.expanduser(data_dir), name)):  # TFDS's own error names a file format
      raise DataError(f"TFDS dataset {name!r} not found: {os.path.join(data_dir, name)} does not exist. {prepare}")
    try:
      self._source = tfds.data_source(
        name, split=split, data_dir=data_dir, decoders={"image": tfds.decode.SkipDecoding()}, download=False
      )
    except NotImplementedError:  # prepared in a format without random access: TFRecord, TFDS's default
      raise DataError(_not_array_record(name, data_dir)) from None
    except Exception as e:  # AssertionError / DatasetNotFoundError / FileNotFoundError
      raise DataError(
        f"TFDS dataset {name!r} ({split}) not found in {data_dir} as ArrayRecord ({type(e).__name__}: "
        f"{str(e).splitlines()[0][:200]}). {prepare}"
      ) from None
    self.num_classes = self._source.dataset_info.features["label"].num_classes
    # TFDS opens a shard at its first read: a missing one would be found after a whole epoch, by the evaluation.
    version_dir = os.path.join(data_dir, name, str(self._source.dataset_info.version))
    self._fix = (
      f"remove {version_dir} and prepare it again with `python scripts/prepare_imagenet.py --manual_dir "
      f"DIR_WITH_TARS --data_dir {data_dir}`"
    )
    instructions = self._source.dataset_info.splits[split].file_instructions
    self._shards = [os.fspath(i.filename) for i in instructions]
    self._shard_ends = np.cumsum([i.take for i in instructions])
    for path in self._shards:
      try:
        open(path, "rb").close()
      except OSError as e:
        raise DataError(
          f"{path}, a shard of TFDS {name!r} ({split}), cannot be read ({e.strerror}); {self._fix}"
        ) from None
    # The folder's absolute path: a trailing slash or a relative path is the same split, and the same cache.
    self.identity = f"tfds:{name}:{split}:{os.path.abspath(data_dir)}"
    self.fingerprint = f"{self.identity}:{len(self._source)}"
    # Until then caches were named by data_dir as typed. Such a cache is still this split's where the typed path
    # was absolute (a relative one may have named another folder, from another directory).
    self.earlier_names = ()
    if os.path.isabs(data_dir) and data_dir != os.path.abspath(data_dir):
      earlier = f"tfds:{name}:{split}:{data_dir}"
      self.earlier_names = ((earlier, f"{earlier}:{len(self._source)}"),)

  def __len__(self) -> int:
    return len(self._source)

  def _shard_of(self, index: int) -> str:
    """The shard holding record ``index``: riegeli's read error does not name the file."""
    return self._shards[min(int(np.searchsorted(self._shard_ends, index, "right")), len(self._shards) - 1)]

  def __getitem__(self, index: int) -> tuple[bytes, int, str]:
    record = _read(self._source, index, self._shard_of, self._fix)
    name = record.get("file_name", b"")
    label = _checked_label(int(record["label"]), self.num_classes, index, self._shard_of, self._fix)
    return record["image"], label, name.decode() if isinstance(name, bytes) else str(name)


def _not_array_record(name: str, data_dir: str) -> str:
  """What to do about TFDS ``name`` in ``data_dir`` prepared in a format that cannot be read by index
  (prepare_imagenet.py there would fail: TFDS does not write a second format beside the first)."""
  version_dirs = sorted(glob.glob(os.path.join(glob.escape(os.path.expanduser(data_dir)), name, "*", "")))
  version_dir = version_dirs[-1].rstrip(os.sep) if version_dirs else os.path.join(data_dir, name, "VERSION")
  try:
    with open(os.path.join(version_dir, "dataset_info.json")) as f:
      file_format = json.load(f).get("fileFormat", "tfrecord")  # TFDS's default
  except (OSError, ValueError, AttributeError):
    file_format = "another"
  return (
    f"TFDS dataset {name!r} in {data_dir} is in {file_format} format, not the array_record format the training "
    f"input reads by index, and TFDS cannot add that beside it: prepare it in another folder (`python "
    f"scripts/prepare_imagenet.py --manual_dir DIR_WITH_TARS --data_dir OTHER_DIR`, then "
    f"--config.data.data_dir=OTHER_DIR), or delete {version_dir} if nothing else reads it and prepare it there."
  )


class FolderRecords:
  """A split of an image folder converted by ``convert_image_folder``."""

  earlier_names = ()  # (identity, fingerprint) its decoded cache had under an earlier naming: none

  def __init__(self, data_dir: str, split: str):
    info_path = os.path.join(data_dir, "info.json")
    path = os.path.join(data_dir, f"{split}.array_record")
    if not os.path.exists(info_path) or not os.path.exists(path):
      raise DataError(
        f"no converted image folder in {data_dir} (missing info.json or {split}.array_record); "
        f"convert it once with `python scripts/prepare_image_folder.py --folder FOLDER "
        f"--out {data_dir}`."
      )
    try:
      with open(info_path, "rb") as f:
        info = f.read()
      self.classes = json.loads(info)["classes"]
      if not self.classes or not isinstance(self.classes, list) or not all(isinstance(c, str) for c in self.classes):
        raise ValueError(f"its classes are {repr(self.classes)[:80]}, not a list of class names")
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
      raise DataError(
        f"{info_path} is damaged ({type(e).__name__}: {e}); convert the folder again with "
        f"`python scripts/prepare_image_folder.py --folder FOLDER --out {data_dir}`."
      ) from None
    self.num_classes = len(self.classes)
    self._fix = (
      f"convert the folder again with `python scripts/prepare_image_folder.py --folder FOLDER --out {data_dir}`"
    )
    self._path = path
    self._source = _reader(path, self._fix)
    if not len(self._source):  # found here, not by the evaluation after a whole epoch of training
      raise DataError(
        f"{path} holds no images: the image folder's {split}/ had none that decode (info.json lists the "
        f"skipped files). Put images in FOLDER/{split}/CLASS_NAME/ and convert it again with "
        f"`python scripts/prepare_image_folder.py --folder FOLDER --out {data_dir}`."
      )
    self.identity = f"folder:{os.path.abspath(path)}"
    # New on every conversion (info.json's classes and conversion id), not only when the size or count
    # changes: moving an image to another class, or a new class shifting the labels, changes neither, and a
    # decoded cache of the old conversion would train on the old labels.
    info_hash = hashlib.sha1(info).hexdigest()[:16]
    self.fingerprint = f"{self.identity}:{os.path.getsize(path)}:{len(self._source)}:{info_hash}"

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> tuple[bytes, int, str]:
    record = _read(self._source, index, self._path, self._fix)
    label, name_length = _FOLDER_HEADER.unpack_from(record)
    label = _checked_label(label, self.num_classes, index, self._path, self._fix)
    start = _FOLDER_HEADER.size
    # "replace": a file name that was not UTF-8 is kept as its bytes (os.fsencode) and only shown.
    return record[start + name_length :], label, record[start : start + name_length].decode(errors="replace")


def _checked_label(label: int, num_classes: int, index: int, path: str | Callable[[int], str], fix: str) -> int:
  """``label`` if it names one of the ``num_classes`` classes; else a DataError naming ``path`` (or ``path(index)``,
  as ``_read``). Such labels trained without a word: a cross-entropy against no class, an accuracy never counted."""
  if not 0 <= label < num_classes:
    raise DataError(
      f"{path(index) if callable(path) else path}: record {index} has label {label}, but the dataset's labels are "
      f"0-{num_classes - 1}, one per class; {fix}."
    )
  return label


class ListRecords:
  """Records held in a Python list of ``(payload, label, file_name)``: small or generated datasets."""

  earlier_names = ()

  def __init__(self, items: list):
    self.items = items
    self.fingerprint = f"list:{len(items)}:{hashlib.sha1(b''.join(i[0][:64] for i in items)).hexdigest()[:16]}"
    self.identity = self.fingerprint

  def __len__(self) -> int:
    return len(self.items)

  def __getitem__(self, index: int):
    return self.items[index]


_STAGING = ".converting_"


def convert_image_folder(folder: str, out_dir: str, splits: tuple[str, ...] = ("train", "val")) -> dict:
  """Writes ``out_dir/{split}.array_record`` and ``out_dir/info.json`` from ``folder/{split}/class/*``.

  Classes are the sorted sub-folder names of the first split (every split uses that list). Files that
  Pillow cannot decode are skipped, counted and named in the log and in info.json; an empty class
  folder keeps its label (so labels follow the folder names) and is reported. Records are written in
  a fixed random order (as TFDS writes ImageNet), not class by class, so the first N records
  (``data.train_subset``, ``data.eval_subset``) sample every class. No TensorFlow needed. Splits already in
  ``out_dir`` and not in ``splits`` are kept, and listed in the new info.json, where their classes are the same
  (else DataError, before any work); their decoded caches are built again (the conversion id changes). A split
  with no image file in its class folders (checked before any decoding), or none that decodes, is a DataError, and
  ``out_dir`` stays as it was.
  """
  splits = tuple(dict.fromkeys(splits))  # each once: a split named twice would be moved twice
  first = os.path.join(folder, splits[0])
  if not os.path.isdir(first):
    raise DataError(
      f"{first} does not exist: the folder must hold " + " and ".join(f"{s}/CLASS_NAME/*.jpg" for s in splits)
    )
  classes = _class_folders(first)
  if not classes:
    raise DataError(f"{first} has no class sub-folders (expected {first}/CLASS_NAME/*.jpg)")
  _splits_kept(out_dir, splits, classes)  # refused before out_dir is made
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:  # before the work, not a traceback
    raise _cannot_write(out_dir, e) from None
  with _only_conversion_into(out_dir):
    kept = _splits_kept(out_dir, splits, classes)  # again: no other conversion changes them from here on
    try:
      for stale in glob.glob(os.path.join(out_dir, _STAGING + "*")):  # left by a conversion that was killed
        shutil.rmtree(stale, ignore_errors=True)
      # Written in a folder inside ``out_dir`` (room for a second copy is needed) and moved over the files there at
      # the end: a conversion that fails (a split's fault found late, a full disk, Ctrl-C before the moves) leaves
      # ``out_dir`` as it found it, a good earlier conversion included.
      staging = tempfile.mkdtemp(prefix=_STAGING, dir=out_dir)
    except OSError as e:
      raise _cannot_write(out_dir, e) from None
    try:
      info = _convert_splits(folder, staging, splits, classes)
      info["splits"].update(kept)
      with open(os.path.join(staging, "info.json"), "w") as f:
        json.dump(info, f, indent=1)
      # info.json last: until it is moved, the records' fingerprint (its conversion_id) is the old one's, so no
      # decoded cache built from a mix of old and new files can pass for the new conversion's.
      for name in (*(f"{split}.array_record" for split in splits), "info.json"):
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
      shutil.rmtree(staging, ignore_errors=True)
  return info


def _cannot_write(out_dir: str, error: OSError) -> DataError:
  return DataError(f"{out_dir}: cannot write there ({error.strerror}); choose another --out")


class OutInUse(DataError):
  """Another conversion is writing the folder: nothing of it is this process's to remove."""


@contextlib.contextmanager
def _only_conversion_into(out_dir: str):
  """Holds ``out_dir`` for one conversion (a lock on its ``.conversion.lock``, removed at the end): a second one into
  it at the same time (``--splits val`` beside a ``--splits train`` of hours) removed the first's staging folder as a
  killed one's, and each would write an info.json without the other's split. A file system without locks is not
  checked."""
  import fcntl

  path = os.path.join(out_dir, ".conversion.lock")
  while True:
    try:
      lock = open(path, "a+")
    except OSError as e:
      raise _cannot_write(out_dir, e) from None
    try:
      fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      lock.close()
      if e.errno in (errno.EACCES, errno.EAGAIN):
        raise OutInUse(
          f"{out_dir} is being written by another conversion; wait for it to end and run this again (it keeps "
          "the other's splits), or give another --out"
        ) from None
      lock = None  # no locks here
      break
    with contextlib.suppress(OSError):
      if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
        break
    lock.close()  # the file a conversion that just ended removed: lock the one there now
  try:
    yield
  finally:
    with contextlib.suppress(OSError):
      os.remove(path)
    if lock:
      lock.close()


def _has_image_files(root: str, classes: list[str]) -> bool:
  """Whether some class folder of ``root`` holds a file with an image's extension (the first one found ends it)."""
  for name in classes:
    with contextlib.suppress(OSError), os.scandir(os.path.join(root, name)) as entries:
      if any(e.name.lower().endswith(IMAGE_EXTENSIONS) and e.is_file() for e in entries):
        return True
  return False


def _convert_splits(folder: str, out_dir: str, splits: tuple[str, ...], classes: list[str]) -> dict:
  """``convert_image_folder``'s files, written in ``out_dir``; returns info.json's dict."""
  first = os.path.join(folder, splits[0])
  # New on every conversion: FolderRecords.fingerprint changes with it, so no decoded cache outlives it.
  info = {"classes": classes, "conversion_id": uuid.uuid4().hex, "splits": {}}
  for split in splits:  # before any decoding (hours on ImageNet's train/): a split with nothing to convert
    root = os.path.join(folder, split)
    if os.path.isdir(root) and not _has_image_files(root, classes):
      raise DataError(
        f"{root} has no {'/'.join(IMAGE_EXTENSIONS)} files in its class folders; put images in "
        f"{root}/CLASS_NAME/, or leave {split} out of --splits"
      )
  for split in splits:
    root = os.path.join(folder, split)
    if not os.path.isdir(root):
      raise DataError(
        f"{root} does not exist: the folder must hold " + " and ".join(f"{s}/CLASS_NAME/*.jpg" for s in splits)
      )
    unknown = sorted(set(_class_folders(root)) - set(classes))
    if unknown:
      raise DataError(f"{root} has class folders that {first} lacks: {unknown[:5]}; every split needs the same classes")
    files, skipped, empty = [], [], []
    # Files beside the class folders, and hidden folders (.ipynb_checkpoints, say: a class of their own, before).
    ignored = []
    for f in sorted(_listdir(root)):
      is_dir = os.path.isdir(os.path.join(root, f))
      if (is_dir and f.startswith(".")) or not (is_dir or f.startswith(".")):
        ignored.append(f)
    for label, name in enumerate(classes):
      class_dir = os.path.join(root, name)
      entries = sorted(_listdir(class_dir)) if os.path.isdir(class_dir) else []
      names = [
        f for f in entries if f.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(class_dir, f))
      ]
      # An image's name on a link to nothing: skipped as a file that cannot be read, and said so.
      broken = [f for f in entries if f.lower().endswith(IMAGE_EXTENSIONS) and not os.path.exists(f"{class_dir}/{f}")]
      for f in broken:
        skipped.append(f"{name}/{f}")
        logging.warning("image folder: skipping %s/%s: a link to a file that is not there", name, f)
      # Sub-folders and files of other kinds are not read: said, not dropped in silence.
      kept = set(names) | set(broken)  # a set: a list here made a class of 40,000 files take 15 s
      ignored += [f"{name}/{f}" for f in entries if f not in kept and not f.startswith(".")]
      if not names:
        empty.append(name)
        logging.warning("image folder: class %r has no images in %s", name, root)
      files.extend((label, name, file_name) for file_name in names)
    # Shuffled once, with a fixed seed: class by class, the first N records would hold the first classes.
    order = np.random.default_rng(_CONVERSION_SEED).permutation(len(files))
    written = 0
    with _writer(os.path.join(out_dir, f"{split}.array_record")) as writer:
      for label, name, file_name in (files[i] for i in order):
        try:
          with open(os.path.join(root, name, file_name), "rb") as f:
            data = f.read()
          if not data:  # Pillow's "cannot identify image file <_io.BytesIO object at 0x...>"
            raise transforms.BadImage("an empty file (0 bytes)")
          # A cheap full check: the whole image at 1/8 scale (the region decoder would stop early).
          transforms.decode_crop_resize(data, 8, region_decode=False)
        except (transforms.BadImage, OSError) as e:  # undecodable, or unreadable (permissions): skipped alike
          reason = f"cannot read it ({e.strerror})" if isinstance(e, OSError) else e
          skipped.append(f"{name}/{file_name}")
          logging.warning("image folder: skipping %s/%s: %s", name, file_name, reason)
          continue
        rel = os.fsencode(f"{name}/{file_name}")  # the name's own bytes, UTF-8 or not
        writer.write(_FOLDER_HEADER.pack(label, len(rel)) + rel + data)
        written += 1
    if not written:  # every image undecodable: nothing to train or evaluate on, and out_dir stays as it was
      raise DataError(f"{root}: no image decodes ({len(skipped)} skipped, named in the log above)")
    if ignored:
      logging.warning(
        "image folder %s: %d entries are not %s image files in a class folder and were not read (sub-folders are "
        "not searched, hidden folders are not classes): %s",
        split,
        len(ignored),
        "/".join(IMAGE_EXTENSIONS),
        ", ".join(ignored[:5]) + (" ..." if ignored[5:] else ""),
      )
    info["splits"][split] = {
      "examples": written,
      "skipped": sorted(skipped),
      "empty_classes": empty,
      "ignored": ignored,
    }
    logging.info(
      "image folder %s: %d images written, %d skipped, %d empty classes", split, written, len(skipped), len(empty)
    )
  return info


def _class_folders(split_dir: str) -> list[str]:
  """The class folders of ``split_dir``, sorted: its sub-folders but hidden ones."""
  return sorted(d for d in _listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)) and not d.startswith("."))


def _listdir(folder: str) -> list[str]:
  try:
    return os.listdir(folder)
  except OSError as e:  # permissions: a folder of the image folder that cannot be read is refused, not skipped
    raise DataError(f"{folder}: cannot read it ({e.strerror}); make it readable, or move it out of --folder") from None


def _splits_kept(out_dir: str, splits: tuple[str, ...], classes: list[str]) -> dict:
  """info.json's entries of the splits an earlier conversion wrote in ``out_dir`` that this one leaves as they
  are (``splits`` is a subset): their labels index the earlier conversion's classes, so those must be
  ``classes``. Raises DataError, before any work, where they are not."""
  info_path = os.path.join(out_dir, "info.json")
  if not os.path.exists(info_path):
    return {}  # no earlier conversion here
  try:
    with open(info_path) as f:
      earlier = json.load(f)
    listed, earlier_classes = dict(earlier["splits"]), earlier["classes"]
  except (OSError, ValueError, KeyError, TypeError):  # damaged: what it wrote and with which classes is unknown
    records = [  # a decoded cache kept here (data.cache_dir) is no split
      name for name in os.listdir(out_dir) if name.endswith(".array_record") and not name.startswith("decoded_")
    ]
    if not {f"{split}.array_record" for split in splits} >= set(records):
      raise DataError(
        f"{info_path} is damaged and {out_dir} holds {', '.join(sorted(records))}: convert every split together "
        f"or choose another --out"
      ) from None
    return {}
  others = sorted(
    split for split in listed if split not in splits and os.path.exists(os.path.join(out_dir, f"{split}.array_record"))
  )
  if others and earlier_classes != classes:
    raise DataError(
      f"{out_dir} holds {', '.join(others)} converted with other classes than {splits[0]}/ has now: their labels "
      f"would be wrong; convert every split together (--splits {','.join([*splits, *others])}) or choose another "
      f"--out"
    )
  return {split: listed[split] for split in others}


# --- Decoded caches ----------------------------------------------------------------------------------


def _decode_for_cache(item: tuple[bytes, int, str], shorter: int) -> bytes:
  data, label, name = item
  try:
    image = transforms.decode_shorter_side(data, shorter)
  except transforms.BadImage as e:  # named here: the cache keeps no name, and training skips it by its index
    logging.warning("decoded cache: skipping bad image %s (%s); a stand-in will replace it", name, e)
    return _CACHE_HEADER.pack(label, 0, 0)
  pixels = np.asarray(image, dtype=np.uint8)
  if max(pixels.shape[:2]) > 65535:  # the header's uint16 sides: such a strip is a bad image, as its stand-in says
    logging.warning("decoded cache: %s is %d x %d px as cached, over the cache's 65,535 px a side; a stand-in will "
                    "replace it", item[2], pixels.shape[1], pixels.shape[0])  # fmt: skip
    return _CACHE_HEADER.pack(label, 0, 0)
  return _CACHE_HEADER.pack(label, pixels.shape[0], pixels.shape[1]) + pixels.tobytes()


def _parse_cache_record(record: bytes) -> tuple[np.ndarray | None, int]:
  label, height, width = _CACHE_HEADER.unpack_from(record)
  if height == 0:
    return None, label
  pixels = np.frombuffer(record, np.uint8, height * width * 3, _CACHE_HEADER.size)
  return pixels.reshape(height, width, 3), label


def cache_path(cache_dir: str, identity: str, shorter: int) -> str:
  # Named by the records' identity, not fingerprint: a cache of records converted again is replaced, not
  # left beside the new one.
  key = hashlib.sha1(identity.encode()).hexdigest()[:16]
  return os.path.join(cache_dir, f"decoded_{shorter}px_{key}.array_record")


def estimate_cache_bytes(records, shorter: int, sample: int = 32) -> int:
  """Expected size of the decoded cache, from the shapes of a few images (headers only)."""
  n = len(records)
  picks = np.linspace(0, n - 1, min(sample, n)).astype(int)
  per_image = []
  for i in picks:
    try:
      width, height = transforms.open_image(records[int(i)][0]).size
    except transforms.BadImage:
      continue
    cached_width, cached_height = transforms.shorter_side_size(width, height, shorter)
    per_image.append(cached_width * cached_height * 3 + _CACHE_HEADER.size)
  return int(np.mean(per_image) * n) if per_image else 0


# A partial cache file that no build has written to for this long is a killed build's: removed at the next build.
STALE_PARTIAL_SECONDS = 3600


def _remove_stale_partial_files(path: str) -> None:
  """Removes the partial files (``_writer``'s ``.tmp-*``) of decoded caches in ``path``'s folder, this one's and any
  other's (a build killed, then run again at another size or on other data), left by builds that were killed: those
  not written to for ``STALE_PARTIAL_SECONDS`` (a live build, another process's too, writes every chunk)."""
  folder, name = os.path.split(path)
  patterns = {glob.escape(name) + ".tmp-*", "decoded_*.array_record.tmp-*"}  # a benchmark's cache is named its own way
  for leftover in {f for pattern in patterns for f in glob.glob(os.path.join(glob.escape(folder), pattern))}:
    with contextlib.suppress(OSError):  # another process removed it first
      if time.time() - os.path.getmtime(leftover) > STALE_PARTIAL_SECONDS:
        os.remove(leftover)
        logging.warning("decoded cache: removed %s, left by a build that was killed", leftover)


# Starting a pool of 2 decoding processes took 3 s on 2 cores (each imports light_jax.data): as long as one process
# decodes 3,000 JPEGs of 500 x 375 px to a 160 px shorter side (1.0-1.4 ms each).
POOL_START_SECONDS = 3.0


def _pool_pays(seconds_per_image: float, images_left: int, workers: int) -> bool:
  """Whether ``workers`` processes decode the rest sooner than this one, their start-up included."""
  return workers > 1 and images_left * seconds_per_image * (1 - 1 / workers) > POOL_START_SECONDS


def build_disk_cache(records, path: str, shorter: int, workers: int | None = None) -> None:
  """Decodes every record once and writes the cache atomically, the records' fingerprint last. ``workers``
  processes; None: the first chunk in this process, then one per core this process may use if the time the first
  chunk took says they finish sooner (a small folder of small images: no pool to start)."""
  start, n = time.time(), len(records)
  chunk = 256
  # spawn, not fork: the caller is multithreaded (JAX), and forking it can deadlock.
  context = multiprocessing.get_context("spawn")
  cores = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroups' cpusets)
  # Given workers: a pool from the start; None: one per core after the first chunk, if the time it took says so.
  pool_from, processes = (0, workers) if workers else (chunk, cores)
  _remove_stale_partial_files(path)
  try:
    with contextlib.ExitStack() as stack:
      writer = stack.enter_context(_writer(path))
      pool = None
      for first in range(0, n, chunk):
        if (
          first == pool_from
          and processes > 1
          and (workers or _pool_pays((time.time() - start) / chunk, n - first, processes))
        ):
          # The workers take a Ctrl-C as this process does (no ignore_signals), and this process stops set-up at a
          # stop signal (preemption.StoppedInSetup): a build can take hours; the interrupted one leaves no file.
          pool = stack.enter_context(
            concurrent.futures.ProcessPoolExecutor(
              processes, mp_context=context, initializer=child_process.bound_to_this_process()
            )
          )
        items = [records[i] for i in range(first, min(first + chunk, n))]
        for record in (pool.map if pool else map)(_decode_for_cache, items, [shorter] * len(items)):
          writer.write(record)
        if first // chunk % 20 == 0:
          logging.info(
            "building the decoded cache %s: %d / %d images (%.0f s)", path, first + len(items), n, time.time() - start
          )
      writer.write(_CACHE_TRAILER + records.fingerprint.encode(errors="surrogateescape"))  # a path's own bytes
  except concurrent.futures.BrokenExecutor:  # BrokenProcessPool
    raise DataError(
      f"building the decoded cache {path} stopped: a worker process died (a Ctrl-C or SIGTERM, or out of "
      "memory); nothing was written, and the next run builds it again"
    ) from None
  logging.info(
    "decoded cache %s built: %d images, %.1f MB, %.0f s", path, n, os.path.getsize(path) / 1e6, time.time() - start
  )


_CACHE_FIX = "delete that file (the decoded cache): the next run builds it again"


class DecodedCache:
  """Decoded, shorter-side-scaled pixels of every record: from a disk file, optionally held in memory.

  The in-memory copy serves the process that loaded it; grain worker processes reopen the file (and
  read it through the OS page cache) rather than receive a pickled copy each.
  """

  def __init__(self, path: str, in_memory: bool = False):
    self.path = path
    self._source = _reader(path, _CACHE_FIX)
    n = len(self._source)
    last = _read(self._source, n - 1, path, _CACHE_FIX) if n else b""
    # The fingerprint of the records it was built from (None: a cache from before it was kept).
    self.source_fingerprint = (
      last[len(_CACHE_TRAILER) :].decode(errors="surrogateescape") if last.startswith(_CACHE_TRAILER) else None
    )
    self._n = n - 1 if self.source_fingerprint is not None else n
    self._memory = [_read(self._source, i, path, _CACHE_FIX) for i in range(self._n)] if in_memory else None
    self.in_memory = in_memory

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, index: int) -> tuple[np.ndarray | None, int, str]:
    if not 0 <= index < self._n:  # not the fingerprint record
      raise IndexError(index)
    record = self._memory[index] if self._memory is not None else _read(self._source, index, self.path, _CACHE_FIX)
    pixels, label = _parse_cache_record(record)
    return pixels, label, f"{self.path}[{index}]"

  def nbytes(self) -> int:
    return os.path.getsize(self.path)

  def __getstate__(self):
    # Worker processes reopen the file instead of receiving a pickled copy of the memory cache.
    return {"path": self.path, "in_memory": False}

  def __setstate__(self, state):
    self.__init__(state["path"], state["in_memory"])
