"""scripts/prepare_imagenet.py on a tiny ILSVRC2012 download: what TFDS writes, and what the reading side gets back.

The preparation runs in a subprocess (it needs TensorFlow, the optional ``prepare`` extra); the records are read back
here with ``tfds.data_source`` and ``SkipDecoding``, the way the training input reads them, which must not import
TensorFlow. The bad files of the real download (truncated, corrupt, CMYK, greyscale, PNG, an empty class) are in the
fixture so the tests pin down what the reading side has to cope with: TFDS stores every file's bytes unchanged,
except the CMYK and PNG train images on its fixed list, which it re-encodes as RGB JPEG.
"""

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from tests.helpers import flip_bytes, load_script, tmpfs, train_py
from tests.ilsvrc_fixture import (
  CMYK_FIX_NAME,
  PNG_FIX_NAME,
  TRAIN_TAR,
  VAL_TAR,
  imagenet_synsets,
  make_ilsvrc_tars,
  val_filename,
  val_synsets,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_imagenet.py")
VAL_COUNT = 6
TRAIN_PER_CLASS = 6
# The CMYK/PNG fix-list classes first, then the classes of validation images 1..6; the last one (n01735189) is the
# empty class: no train images, one validation image.
SYNSETS = list(dict.fromkeys([CMYK_FIX_NAME.split("_")[0], PNG_FIX_NAME.split("_")[0], *val_synsets(VAL_COUNT)]))
HAS_TF = importlib.util.find_spec("tensorflow") is not None


def _run_script(*args, python_prelude=None, timeout=300):
  """Runs the script with this interpreter; ``python_prelude`` is Python run first in the child (see the no-TF test)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  if python_prelude is None:
    cmd = [sys.executable, SCRIPT, *args]
  else:
    launcher = (
      f"{python_prelude}; import runpy, sys; sys.argv = {[SCRIPT, *args]!r}; "
      "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    cmd = [sys.executable, "-c", launcher]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _tar_files(manual_dir):
  """{file name: bytes} of every image in the two tars, read independently of TFDS."""
  files = {}
  with tarfile.open(os.path.join(manual_dir, TRAIN_TAR)) as train:
    for member in train:
      with tarfile.open(fileobj=io.BytesIO(train.extractfile(member).read())) as inner:
        files.update({m.name: inner.extractfile(m).read() for m in inner})
  with tarfile.open(os.path.join(manual_dir, VAL_TAR)) as val:
    files.update({m.name: val.extractfile(m).read() for m in val})
  return files


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """One preparation shared by the read-back tests (it costs a TensorFlow start and a TFDS build)."""
  if not HAS_TF:
    if os.environ.get("CI"):  # make test installs the test extra, which has TensorFlow: never skip there
      pytest.fail("TensorFlow is not installed, but the test extra has it: pip install -e '.[test]'")
    pytest.skip("TensorFlow is not installed (pip install -e '.[prepare]'); preparation needs it")
  manual_dir = tmp_path_factory.mktemp("manual")
  data_dir = tmp_path_factory.mktemp("tfds")
  written = make_ilsvrc_tars(manual_dir, SYNSETS, TRAIN_PER_CLASS, VAL_COUNT, seed=0)
  result = _run_script("--manual_dir", str(manual_dir), "--data_dir", str(data_dir))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
  return {"written": written, "manual_dir": str(manual_dir), "data_dir": str(data_dir), "stdout": result.stdout}


@pytest.fixture(scope="module")
def records(prepared):
  """{split: {file name: record}} read back with SkipDecoding, checking on the way that TensorFlow stays unloaded."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  tf_loaded_before = "tensorflow" in sys.modules
  sources = tfds.data_source(
    "imagenet2012", data_dir=prepared["data_dir"], download=False, decoders={"image": tfds.decode.SkipDecoding()}
  )
  out = {}
  for split, source in sources.items():
    out[split] = {}
    for i in range(len(source)):
      record = source[i]
      out[split][record["file_name"].decode()] = record
  if not tf_loaded_before:
    assert "tensorflow" not in sys.modules, "reading back with SkipDecoding imported TensorFlow"
  return out


def test_splits_and_summary(prepared, records):
  written = prepared["written"]
  assert sorted(records) == ["train", "validation"]  # No test tar, no test split.
  assert f"{TRAIN_TAR}: {len(SYNSETS)} class tars (the full ImageNet has 1000)" in prepared["stdout"]
  assert len(written["train"]) == (len(SYNSETS) - 1) * TRAIN_PER_CLASS + 5  # 5 bad files, one empty class.
  for split in ("train", "validation"):
    assert sorted(records[split]) == sorted(e.filename for e in written[split])
  assert sorted(records["validation"]) == [val_filename(i) for i in range(1, VAL_COUNT + 1)]
  stdout = prepared["stdout"]
  for split in ("train", "validation"):
    assert re.search(rf"{split}\s+{len(written[split])} examples", stdout), stdout
  assert os.path.join(prepared["data_dir"], "imagenet2012", "5.1.0") in stdout
  shards = os.listdir(os.path.join(prepared["data_dir"], "imagenet2012", "5.1.0"))
  assert any(name.startswith("imagenet2012-train.array_record-") for name in shards), shards


def test_labels_match_the_synset_of_each_file(prepared, records):
  """Train labels come from the per-class tar's name, validation labels from TFDS's list by position."""
  names = imagenet_synsets()
  for split in ("train", "validation"):
    for entry in prepared["written"][split]:
      label = records[split][entry.filename]["label"]
      assert names[label] == entry.synset, (split, entry)
  empty = SYNSETS[-1]
  assert not any(names[r["label"]] == empty for r in records["train"].values())
  assert any(names[r["label"]] == empty for r in records["validation"].values())


def test_bad_files_are_kept_raw_except_the_listed_fixes(prepared, records):
  """Truncated, corrupt, greyscale and unlisted CMYK/PNG files reach the reader byte for byte; TFDS re-encodes only
  the train CMYK/PNG images named in its fix lists, to RGB JPEGs of the same picture."""
  raw = _tar_files(prepared["manual_dir"])
  fixed = {CMYK_FIX_NAME: "cmyk", PNG_FIX_NAME: "png"}
  kinds_seen = {"train": set(), "validation": set()}
  for split in ("train", "validation"):
    for entry in prepared["written"][split]:
      image = records[split][entry.filename]["image"]
      assert isinstance(image, bytes)
      kinds_seen[split].add(entry.kind)
      if split == "train" and entry.filename in fixed:
        assert entry.kind == fixed[entry.filename]
        assert image != raw[entry.filename]
        decoded = Image.open(io.BytesIO(image))
        assert (decoded.format, decoded.mode) == ("JPEG", "RGB")
        original = Image.open(io.BytesIO(raw[entry.filename]))
        assert decoded.size == original.size
        diff = np.abs(np.asarray(decoded, np.float32) - np.asarray(original.convert("RGB"), np.float32)).mean()
        assert diff < 12, f"{entry.filename}: re-encoded picture differs from the original by {diff:.1f}/255"
      else:
        assert image == raw[entry.filename], entry
  assert kinds_seen["train"] == {"ok", "truncated", "corrupt", "cmyk", "grey", "png"}
  assert kinds_seen["validation"] >= {"ok", "cmyk", "grey", "png"}
  # What the reader will meet in validation: an unlisted CMYK JPEG and a PNG, untouched.
  formats = {}
  for entry in prepared["written"]["validation"]:
    if entry.kind in ("cmyk", "png", "grey"):
      opened = Image.open(io.BytesIO(records["validation"][entry.filename]["image"]))
      formats[entry.kind] = (opened.format, opened.mode)
  assert formats == {"cmyk": ("JPEG", "CMYK"), "png": ("PNG", "RGB"), "grey": ("JPEG", "L")}


def test_missing_tar_is_named(tmp_path):
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  os.remove(tmp_path / TRAIN_TAR)
  result = _run_script("--manual_dir", str(tmp_path), "--data_dir", str(tmp_path / "out"), timeout=60)
  assert result.returncode != 0
  assert TRAIN_TAR in result.stderr and VAL_TAR in result.stderr, result.stderr
  assert "missing" in result.stderr and "Traceback" not in result.stderr, result.stderr
  assert not (tmp_path / "out").exists()


def test_partial_validation_tar_is_refused(tmp_path):
  """TFDS would pair validation labels with the sorted names by position; a gap would shift every later label."""
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  with tarfile.open(tmp_path / VAL_TAR, "w") as tar:
    info = tarfile.TarInfo(val_filename(2))
    tar.addfile(info, io.BytesIO(b""))
  result = _run_script("--manual_dir", str(tmp_path), "--data_dir", str(tmp_path / "out"), timeout=60)
  assert result.returncode != 0
  assert "00000001" in result.stderr and "by position" in result.stderr, result.stderr


def test_validation_tar_with_a_directory_entry_is_refused(tmp_path):
  """TFDS pairs the labels with every name in the tar (tar.getnames()), directories included: one sorting
  first would shift every label by one."""
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  directory = tarfile.TarInfo("ILSVRC2012_img_val")
  directory.type = tarfile.DIRTYPE
  with tarfile.open(tmp_path / VAL_TAR, "a") as tar:
    tar.addfile(directory)
  result = _run_script("--manual_dir", str(tmp_path), "--data_dir", str(tmp_path / "out"), timeout=60)
  assert result.returncode != 0
  assert "unexpected member 'ILSVRC2012_img_val'" in result.stderr, result.stderr


def test_a_cut_or_foreign_train_tar_is_refused_before_the_preparation(tmp_path):
  """TFDS reads the whole train tar (hours on ImageNet) before a cut inside it fails, as a traceback."""
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  train_tar = tmp_path / TRAIN_TAR
  whole = train_tar.read_bytes()
  with tarfile.open(train_tar) as tar:
    last = tar.getmembers()[-1]
  train_tar.write_bytes(whole[: last.offset_data + last.size // 2])  # cut inside the last class tar
  result = _run_script("--manual_dir", str(tmp_path), "--data_dir", str(tmp_path / "out"), timeout=60)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert f"error: {train_tar} is not a readable tar (unexpected end of data)" in result.stderr, result.stderr
  train_tar.write_bytes(whole)
  with tarfile.open(train_tar, "a") as tar:
    tar.addfile(tarfile.TarInfo("README.txt"), io.BytesIO(b""))
  result = _run_script("--manual_dir", str(tmp_path), "--data_dir", str(tmp_path / "out"), timeout=60)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "unexpected member 'README.txt'; the train tar holds only per-class tars" in result.stderr, result.stderr
  assert not (tmp_path / "out").exists()


def test_a_tar_that_cannot_be_read_is_named_in_one_line(tmp_path):
  """Another user's (mode 600, for a run not as root) or on a failing disk: an OSError traceback."""
  prepare = load_script("scripts/prepare_imagenet.py")
  os.symlink("/proc/self/mem", tmp_path / TRAIN_TAR)  # a file whose reads fail (EIO) even for root
  with pytest.raises(prepare.PrepareError, match=rf"^{tmp_path / TRAIN_TAR} cannot be read \(Input/output error\)"):
    prepare.check_train_tar(str(tmp_path / TRAIN_TAR))


def test_a_class_imagenet_lacks_or_a_damaged_class_tar_is_refused_before_the_preparation(tmp_path):
  """TFDS met both mid-way, as tracebacks (ClassLabel's KeyError, tarfile's ReadError), after the classes before."""
  prepare = load_script("scripts/prepare_imagenet.py")
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  train_tar = tmp_path / TRAIN_TAR
  whole = train_tar.read_bytes()
  empty = io.BytesIO()
  tarfile.open(fileobj=empty, mode="w").close()
  with tarfile.open(train_tar, "a") as tar:
    info = tarfile.TarInfo("n00000001.tar")
    info.size = len(empty.getvalue())
    tar.addfile(info, io.BytesIO(empty.getvalue()))
  with pytest.raises(prepare.PrepareError, match=r"n00000001.tar is not one of ImageNet's 1000 classes \(1 member"):
    prepare.check_train_tar(str(train_tar))
  with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
    first = tar.getmembers()[0]
  damaged = bytearray(whole)
  damaged[first.offset_data : first.offset_data + 512] = b"x" * 512  # the class tar's first header
  train_tar.write_bytes(damaged)
  with pytest.raises(
    prepare.PrepareError, match=rf"its member {first.name} is not a readable tar \(.*\); the download"
  ):
    prepare.check_train_tar(str(train_tar))


def test_a_tar_cut_at_a_members_end_or_inside_a_header_is_refused(tmp_path):
  """tarfile fails on a cut inside a member's data only: cut at a member's end or inside the next header, the
  listing just ends, and a validation tar of 1..N-1 would pass as a smaller split."""
  prepare = load_script("scripts/prepare_imagenet.py")
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  for name, check, count in [(VAL_TAR, prepare.check_val_names, VAL_COUNT), (TRAIN_TAR, prepare.check_train_tar, 7)]:
    path = tmp_path / name
    whole = path.read_bytes()
    assert check(str(path)) == count
    with tarfile.open(path) as tar:
      last = tar.getmembers()[-1]
    for cut in (last.offset, last.offset + 100):  # at the last member's header, inside it
      path.write_bytes(whole[:cut])
      with pytest.raises(prepare.PrepareError, match=f"ends after {count - 1} members without the end-of-archive"):
        check(str(path))
    path.write_bytes(whole)


def test_without_tensorflow_says_how_to_install_it(tmp_path):
  """Blocks ``import tensorflow`` in the child (a None entry in sys.modules is Python's way to make a module
  unimportable), so this runs whether or not the prepare extra is installed."""
  make_ilsvrc_tars(tmp_path, SYNSETS, 1, VAL_COUNT)
  result = _run_script(
    "--manual_dir",
    str(tmp_path),
    "--data_dir",
    str(tmp_path / "out"),
    python_prelude="import sys; sys.modules['tensorflow'] = None",
    timeout=60,
  )
  assert result.returncode != 0
  assert "pip install -e '.[prepare]'" in result.stderr and "TensorFlow" in result.stderr, result.stderr
  assert "Traceback" not in result.stderr, result.stderr


def test_a_data_dir_holding_tfrecord_imagenet_or_a_file_is_refused_in_one_line(tmp_path):
  """TFDS's default format is TFRecord: a --data_dir holding imagenet2012 so (~/tensorflow_datasets, say) made
  TFDS fail with "File format is already set", a traceback; a --data_dir that is a file, with NotADirectoryError.
  The training input's error sends the user here, so both say what to do instead."""
  from light_jax.data import DataError, records

  make_ilsvrc_tars(tmp_path / "manual", SYNSETS, 1, VAL_COUNT)
  version_dir = tmp_path / "tfds" / "imagenet2012" / "5.1.0"
  version_dir.mkdir(parents=True)
  (version_dir / "dataset_info.json").write_text('{"name": "imagenet2012", "fileFormat": "tfrecord"}')
  result = _run_script("--manual_dir", str(tmp_path / "manual"), "--data_dir", str(tmp_path / "tfds"), timeout=60)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert f"{version_dir} already holds imagenet2012 in tfrecord format" in result.stderr, result.stderr
  assert "give another --data_dir" in result.stderr and f"delete {version_dir} if" in result.stderr
  (tmp_path / "afile").write_text("")
  result = _run_script("--manual_dir", str(tmp_path / "manual"), "--data_dir", str(tmp_path / "afile"), timeout=60)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert f"--data_dir {tmp_path / 'afile'} is a file, not a directory" in result.stderr, result.stderr
  with tmpfs(tmp_path / "read_only", "ro,size=1m") as folder:  # an OSError traceback once the tars were checked
    result = _run_script("--manual_dir", str(tmp_path / "manual"), "--data_dir", str(folder / "tfds"), timeout=60)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert f"--data_dir {folder / 'tfds'}: cannot write in {folder} (Read-only file system)" in result.stderr
  # The training input on that folder says the same, not "prepare it there" (which failed).
  if HAS_TF:  # a real TFRecord preparation (TFDS reads its info, features and labels), in a child: TensorFlow
    shutil.rmtree(tmp_path / "tfds")
    prepare = (
      "import sys, tensorflow_datasets as tfds; "
      "tfds.builder('imagenet2012', data_dir=sys.argv[1]).download_and_prepare("
      "download_config=tfds.download.DownloadConfig(manual_dir=sys.argv[2]))"  # TFRecord: TFDS's default
    )
    subprocess.run([sys.executable, "-c", prepare, str(tmp_path / "tfds"), str(tmp_path / "manual")], check=True)
    assert list(version_dir.glob("imagenet2012-train.tfrecord-*"))
    with pytest.raises(DataError, match=r"in tfrecord format, not the array_record.*--data_dir OTHER_DIR"):
      records.TfdsRecords("imagenet2012", "train", str(tmp_path / "tfds"))


# --- The training input on the prepared TFDS data ---------------------------------------------------------------


def _data_config(data_dir, **overrides):
  from configs import imagenet_resnet50

  config = imagenet_resnet50.get_config("tiny").data
  config.update(dataset="imagenet2012", data_dir=data_dir, cache="none", **overrides)
  return config


def test_pipeline_reads_every_record_with_its_label_and_skips_the_broken_ones(prepared):
  from light_jax import data as data_lib

  train, test, info = data_lib.load_dataset(_data_config(prepared["data_dir"]))
  assert info.num_classes == 1000 and len(train) == len(prepared["written"]["train"])
  kinds = {e.filename: e.kind for split in prepared["written"].values() for e in split}
  decodable = ("ok", "cmyk", "grey", "png")
  replaced = 0
  for source in (train, test):
    n = len(source)
    for i in range(n):
      _, record_label, name = source.records[i]
      image, label, own = source.eval_example(i, 32)
      assert image.shape == (32, 32, 3) and image.dtype == np.uint8
      assert own == (kinds[name] in decodable)  # a stand-in: evaluation counts it for nothing
      if own:
        assert label == record_label  # decoded: its own label
        continue
      # Undecodable: the next decodable record stands in, with its own image and label.
      stand_in = next((i + k) % n for k in range(1, n) if kinds[source.records[(i + k) % n][2]] in decodable)
      assert label == source.records[stand_in][1], (name, source.records[stand_in][2])
      np.testing.assert_array_equal(image, source.eval_example(stand_in, 32)[0])
      replaced += 1
  assert replaced == 2 + sum(e.kind in ("truncated", "corrupt") for e in prepared["written"]["validation"])
  # The two undecodable train files were replaced by their successors, counted and named once each.
  broken = {e.filename for e in prepared["written"]["train"] if e.kind in ("truncated", "corrupt")}
  assert train.bad_records == broken


def test_a_data_dir_typed_with_a_trailing_slash_is_the_same_split_and_keeps_its_earlier_cache(prepared, tmp_path):
  """The decoded cache is named by the split's folder, not the text typed: a trailing slash does not decode the
  split again (hours for ImageNet). A cache named before by the text typed is still read, not rebuilt."""
  from light_jax import data as data_lib
  from light_jax.data import records

  plain = records.TfdsRecords("imagenet2012", "train", prepared["data_dir"])
  slashed = records.TfdsRecords("imagenet2012", "train", prepared["data_dir"] + "/")
  assert slashed.identity == plain.identity and slashed.fingerprint == plain.fingerprint
  assert plain.earlier_names == () and slashed.earlier_names[0][0].endswith(prepared["data_dir"] + "/")

  class AsNamedBefore:  # the split as caches were named until now: by data_dir as typed
    identity, fingerprint = slashed.earlier_names[0]
    __len__, __getitem__ = slashed.__len__, slashed.__getitem__

  config = _data_config(prepared["data_dir"] + "/")
  config.update(cache="disk", cache_dir=str(tmp_path), cache_size=40)
  earlier = records.cache_path(str(tmp_path), AsNamedBefore.identity, 40)
  records.build_disk_cache(AsNamedBefore(), earlier, 40)
  built = os.path.getmtime(earlier)
  cache = data_lib._decoded_cache(slashed, config)
  assert len(cache) == len(plain) and os.listdir(tmp_path) == [os.path.basename(earlier)]
  assert os.path.getmtime(earlier) == built  # read as it is
  # A cache named by the folder (a new one, here built for the plain data_dir) is read first, whatever was typed.
  data_lib._decoded_cache(plain, config)
  current = records.cache_path(str(tmp_path), plain.identity, 40)
  assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (earlier, current))
  assert data_lib._decoded_cache(slashed, config).path == current


def test_train_py_on_prepared_imagenet(prepared, tmp_path):
  """train.py end to end on TFDS imagenet2012 (the tiny prepared copy) with the decoded memory cache."""
  import json

  workdir = tmp_path / "run"
  result = train_py(
    "--config",
    "configs/imagenet_resnet50.py:tiny",
    "--workdir",
    str(workdir),
    f"--config.data.data_dir={prepared['data_dir']}",
    "--config.data.cache=memory",
    f"--config.data.cache_dir={tmp_path / 'cache'}",
    "--config.global_batch_size=16",
    "--config.data.eval_batch_size=8",
    "--config.data.resolution_schedule=",
    "--config.data.image_size=24",
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert "held in memory" in result.stderr
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert len(metrics) == 2 and metrics[-1]["eval_examples"] == VAL_COUNT


def test_a_missing_or_damaged_shard_stops_train_py_in_one_line(prepared, tmp_path):
  """TFDS opens a shard at its first read: a missing validation shard was found after the training epoch, and a
  damaged train shard (riegeli's "chunk data hash mismatch", read in a grain worker process here) was a traceback
  (exit 1). Both are one line naming the shard and the fix, exit 2 (BAD_INPUT); the missing one before any step."""
  from light_jax import data as data_lib

  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared["data_dir"], data_dir)
  version_dir = data_dir / "imagenet2012" / "5.1.0"
  (val_shard,) = version_dir.glob("imagenet2012-validation.array_record-*")
  (train_shard,) = version_dir.glob("imagenet2012-train.array_record-*")
  args = [
    "--config",
    "configs/imagenet_resnet50.py:tiny",
    f"--config.data.data_dir={data_dir}",
    "--config.data.cache=none",
    "--config.data.num_workers=1",
    "--config.global_batch_size=16",
    "--config.data.eval_batch_size=8",
    "--config.data.resolution_schedule=",
    "--config.data.image_size=24",
  ]
  moved = tmp_path / "moved"
  val_shard.rename(moved)
  # Refused as the data loads, before any step (in this process; train.py's line and exit 2: the damaged one below).
  with pytest.raises(data_lib.DataError) as missing:
    data_lib.load_dataset(_data_config(str(data_dir)))
  assert f"{val_shard}, a shard of TFDS 'imagenet2012' (validation), cannot be read" in str(missing.value)
  assert f"remove {version_dir} and prepare it again" in str(missing.value)
  moved.rename(val_shard)
  flip_bytes(train_shard)  # its first records, not its footer: the shard opens, its reads fail
  result = train_py(*args, "--workdir", str(tmp_path / "damaged"), timeout=300)
  error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert len(error) == 1 and f"{train_shard} is damaged or unreadable (Corrupted Riegeli" in error[0], error
  assert f"remove {version_dir} and prepare it again" in error[0]
