"""The JPEG input path: image-folder conversion, transforms, bad files, decoded caches, determinism."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from light_jax.data import DataError, EvalBatches, ImageSource, TrainBatches, load_dataset, records, transforms
from tests.helpers import ROOT, file_locked, flip_bytes, tmpfs, train_py
from tests.image_folder_fixture import DECODABLE, bad_files, class_image, jpeg_bytes, make_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  root = tmp_path_factory.mktemp("folder")
  written = make_image_folder(str(root / "raw"), num_classes=4, train_per_class=12, val_per_class=4)
  info = records.convert_image_folder(str(root / "raw"), str(root / "converted"))
  return {"root": root, "written": written, "info": info, "dir": str(root / "converted")}


def test_image_folder_conversion_keeps_labels_and_reports_bad_files(folder):
  info, written = folder["info"], folder["written"]
  assert info["classes"] == ["class_00", "class_01", "class_02", "class_03", "class_zz_empty"]
  for split in ("train", "val"):
    good = [(path, label) for path, label, kind in written[split] if kind in DECODABLE]
    assert info["splits"][split]["examples"] == len(good)
    assert sorted(info["splits"][split]["skipped"]) == ["class_01/bad_corrupt.JPEG", "class_01/bad_truncated.JPEG"]
    assert info["splits"][split]["empty_classes"] == ["class_zz_empty"]
    source = records.FolderRecords(folder["dir"], split)
    assert sorted((source[i][2], source[i][1]) for i in range(len(source))) == sorted(good)  # never a wrong label


def test_image_folder_conversion_names_what_it_does_not_read(tmp_path, caplog):
  """A sub-folder of a class, a .tif, an image beside the class folders: not read, and said so (they were dropped in
  silence); a hidden folder is not a class (.ipynb_checkpoints was one); a link to nothing and an empty file are
  skipped, saying what they are (not "not image files", nor "cannot identify image file <_io.BytesIO ...>")."""
  raw = tmp_path / "raw"
  for split in ("train", "val"):
    os.makedirs(raw / split / "cat" / "nested")
    os.makedirs(raw / split / ".ipynb_checkpoints")
    _add_cat(raw / split, 0)
    (raw / split / "cat" / "nested" / "deep.jpg").write_bytes(b"x")
    (raw / split / "cat" / "scan.tif").write_bytes(b"x")
    (raw / split / "stray.jpg").write_bytes(b"x")
    (raw / split / "cat" / "empty.jpg").write_bytes(b"")
    os.symlink(tmp_path / "gone.jpg", raw / split / "cat" / "dangling.jpg")
  with caplog.at_level("WARNING"):
    info = records.convert_image_folder(str(raw), str(tmp_path / "converted"))
  assert info["classes"] == ["cat"]
  train = info["splits"]["train"]
  assert train["ignored"] == [".ipynb_checkpoints", "stray.jpg", "cat/nested", "cat/scan.tif"]
  assert train["skipped"] == ["cat/dangling.jpg", "cat/empty.jpg"] and train["examples"] == 1
  assert "4 entries are not" in caplog.text
  assert "skipping cat/dangling.jpg: a link to a file that is not there" in caplog.text
  assert "skipping cat/empty.jpg: an empty file (0 bytes)" in caplog.text


def _one_cat_converted(tmp_path):
  """(raw, converted): a folder whose train/ and val/ hold one image of one class "cat", converted."""
  raw, converted = tmp_path / "raw", tmp_path / "converted"
  for split in ("train", "val"):
    os.makedirs(raw / split / "cat")
    _add_cat(raw / split, 0)
  records.convert_image_folder(str(raw), str(converted))
  return raw, converted


def _add_cat(split_dir, seed):
  (split_dir / "cat" / f"{seed}.jpg").write_bytes(jpeg_bytes(class_image(0, np.random.default_rng(seed), 32, 32)))


def test_a_conversion_that_fails_leaves_the_earlier_one_as_it_was(tmp_path):
  raw, converted = _one_cat_converted(tmp_path)
  before = {name: (converted / name).read_bytes() for name in os.listdir(converted)}
  _add_cat(raw / "train", 1)
  os.makedirs(raw / "val" / "dog")  # found once train is written: a class that train lacks
  os.makedirs(converted / ".converting_killed")  # what a conversion killed with SIGKILL leaves
  with pytest.raises(DataError, match="class folders that .* lacks: \\['dog'\\]"):
    records.convert_image_folder(str(raw), str(converted))
  assert {name: (converted / name).read_bytes() for name in os.listdir(converted)} == before
  assert sorted(before) == ["info.json", "train.array_record", "val.array_record"]


def test_a_second_conversion_into_the_same_folder_is_refused_and_keeps_the_first_ones_work(tmp_path):
  """`--splits val` beside a `--splits train` of hours: it removed the first's staging folder, which then failed."""
  raw, converted = _one_cat_converted(tmp_path)
  os.makedirs(converted / ".converting_live")  # the first conversion's work in progress
  with (
    file_locked(converted / ".conversion.lock"),
    pytest.raises(DataError, match=rf"^{converted} is being written by another conversion; wait for it to end"),
  ):
    records.convert_image_folder(str(raw), str(converted), ("val",))
  assert (converted / ".converting_live").is_dir()
  records.convert_image_folder(str(raw), str(converted), ("val",))  # the first one over: its leftovers go
  assert not (converted / ".converting_live").exists()


def test_converting_one_split_keeps_the_others_only_if_their_classes_are_the_same(tmp_path):
  raw, converted = _one_cat_converted(tmp_path)
  val = (converted / "val.array_record").read_bytes()
  os.makedirs(raw / "train" / "bird")  # sorts first: every label of val would be one too low
  with pytest.raises(
    DataError, match=r"holds val converted with other classes than train/ has now: .* \(--splits train,val\)"
  ):
    records.convert_image_folder(str(raw), str(converted), ("train",))
  assert json.loads((converted / "info.json").read_text())["classes"] == ["cat"]  # nothing changed
  os.rmdir(raw / "train" / "bird")
  (converted / "decoded_32px_0123.array_record").write_bytes(b"")  # a decoded cache kept here: not a split
  _add_cat(raw / "train", 1)
  info = records.convert_image_folder(str(raw), str(converted), ("train", "train"))  # a split named twice: once
  assert info["splits"]["train"]["examples"] == 2 and info["splits"]["val"]["examples"] == 1
  assert json.loads((converted / "info.json").read_text()) == info
  assert (converted / "val.array_record").read_bytes() == val and len(records.FolderRecords(str(converted), "val")) == 1
  (converted / "info.json").write_text("{")  # damaged: which classes val's labels index is unknown
  with pytest.raises(DataError, match=r"info.json is damaged and .* holds train.array_record, val.array_record"):
    records.convert_image_folder(str(raw), str(converted), ("train",))
  records.convert_image_folder(str(raw), str(converted))  # every split: nothing to keep
  # A split left with no decodable image: refused before the moves, the earlier conversion kept whole.
  before = (converted / "info.json").read_text()
  for path in (raw / "val").rglob("*.*"):
    path.write_bytes(b"not an image")
  with pytest.raises(DataError, match=r"raw/val: no image decodes \(1 skipped, named in the log above\)"):
    records.convert_image_folder(str(raw), str(converted), ("val",))
  assert (converted / "info.json").read_text() == before


def _folder_config(data_dir, cache_dir, **overrides):
  from configs import imagenet_resnet50

  config = imagenet_resnet50.get_config("tiny").data
  config.update(dataset="image_folder", data_dir=str(data_dir), cache_dir=str(cache_dir), **overrides)
  return config


def test_a_subset_of_a_converted_folder_samples_every_class(folder, tmp_path):
  """data.train_subset / eval_subset keep the first N records; the conversion shuffles them (with a fixed
  seed), so those are not the first classes' images only."""
  config = _folder_config(folder["dir"], tmp_path, train_subset=8, eval_subset=8, cache="none")
  for subset in load_dataset(config)[:2]:
    assert len(subset) == 8
    assert len({subset.records[i][1] for i in range(8)}) >= 3, [subset.records[i][2] for i in range(8)]
  again = tmp_path / "again"
  records.convert_image_folder(str(folder["root"] / "raw"), str(again))
  for split in ("train", "val"):  # the same order every time
    first, second = records.FolderRecords(folder["dir"], split), records.FolderRecords(str(again), split)
    assert [first[i][2] for i in range(len(first))] == [second[i][2] for i in range(len(second))]


def test_a_folder_converted_again_gets_a_new_decoded_cache(tmp_path):
  """Converted again with other labels, the folder's record file can keep its size and count (an image moved
  between classes of equal name length; a new class sorting first, which shifts every label): the decoded
  cache notices (it holds the fingerprint of the records it was built from) and is built again, instead of
  training on the old labels."""
  raw, converted = tmp_path / "raw", tmp_path / "converted"
  rng = np.random.default_rng(0)
  for split in ("train", "val"):
    for label, name in enumerate(("cat_a", "cat_b")):
      os.makedirs(raw / split / name)
      for i in range(3):
        (raw / split / name / f"{name}_{i}.jpg").write_bytes(jpeg_bytes(class_image(label, rng, 32, 32)))
  config = _folder_config(converted, tmp_path / "cache", cache="disk")

  def convert_and_load():
    records.convert_image_folder(str(raw), str(converted))
    train = load_dataset(config)[0].records
    assert isinstance(train, records.DecodedCache)
    labels = [train[i][1] for i in range(len(train))]
    fresh = records.FolderRecords(str(converted), "train")
    assert labels == [fresh[i][1] for i in range(len(fresh))]  # the new conversion's labels
    return labels, os.path.getsize(converted / "train.array_record")

  first, size = convert_and_load()
  shutil.move(raw / "train" / "cat_a" / "cat_a_0.jpg", raw / "train" / "cat_b" / "cat_a_0.jpg")
  moved, moved_size = convert_and_load()
  assert sorted(moved) == [0, 0, 1, 1, 1, 1] != sorted(first) and moved_size == size
  for split in ("train", "val"):
    os.makedirs(raw / split / "aaa")  # an empty class sorting first: every label one higher
  shifted, shifted_size = convert_and_load()
  assert sorted(shifted) == [1, 1, 2, 2, 2, 2] and shifted_size == size
  assert len(os.listdir(tmp_path / "cache")) == 1  # each replaced the last, none left beside it
  # A cache named by its records' fingerprint, as caches were before they kept it inside, is read where it is.
  [name] = os.listdir(tmp_path / "cache")
  fingerprint = records.FolderRecords(str(converted), "train").fingerprint
  legacy = records.cache_path(str(tmp_path / "cache"), fingerprint, config.cache_size)
  os.rename(tmp_path / "cache" / name, legacy)
  assert load_dataset(config)[0].records.path == legacy and os.listdir(tmp_path / "cache") == [os.path.basename(legacy)]
  # A budget below the cache that is there: the JPEGs, as where there is no cache yet (not the cache's pixels).
  config.cache_budget_gb = 1e-9
  assert isinstance(load_dataset(config)[0].records, records.FolderRecords)


def test_a_budget_the_built_cache_exceeds_but_its_estimate_fits_reads_the_cache_every_time(folder, tmp_path):
  """The budget is checked against the same estimate before and after the build: the file, a little larger than
  the estimate, must not turn a resumed run of the same config to the JPEGs' pixels."""
  config = _folder_config(folder["dir"], tmp_path / "cache", cache="disk", train_subset=0)
  estimate = records.estimate_cache_bytes(records.FolderRecords(folder["dir"], "train"), config.cache_size)
  config.cache_budget_gb = estimate * 1.001 / 1e9
  assert isinstance(load_dataset(config)[0].records, records.DecodedCache)  # built
  [name] = os.listdir(tmp_path / "cache")
  assert os.path.getsize(tmp_path / "cache" / name) > config.cache_budget_gb * 1e9  # the file is over the budget
  assert isinstance(load_dataset(config)[0].records, records.DecodedCache)  # and still read


def test_missing_converted_folder_says_how_to_make_it(tmp_path):
  with pytest.raises(DataError, match="prepare_image_folder.py"):
    records.FolderRecords(str(tmp_path), "train")


def test_damaged_converted_folder_or_cache_says_how_to_fix_it(folder, tmp_path):
  damaged = str(tmp_path / "converted")
  shutil.copytree(folder["dir"], damaged)
  path = os.path.join(damaged, "train.array_record")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(DataError, match="train.array_record is truncated or damaged.*prepare_image_folder.py"):
    records.FolderRecords(damaged, "train")
  shutil.copy(path, tmp_path / "cache.array_record")
  with pytest.raises(DataError, match="cache.array_record is truncated or damaged.*delete that file"):
    records.DecodedCache(str(tmp_path / "cache.array_record"))
  with open(os.path.join(damaged, "info.json"), "w") as f:
    f.write('{"classes": ["class_00", ')
  with pytest.raises(DataError, match="info.json is damaged.*prepare_image_folder.py"):
    records.FolderRecords(damaged, "val")
  # No classes, or fewer than the records' labels index: a ZeroDivisionError in the model's set-up, or a run that
  # trained without a word on labels naming no class.
  with open(os.path.join(folder["dir"], "info.json")) as f:
    info = json.load(f)
  for classes in ([], "abc"):
    with open(os.path.join(damaged, "info.json"), "w") as f:
      json.dump({**info, "classes": classes}, f)
    with pytest.raises(DataError, match="info.json is damaged .*not a list of class names.*prepare_image_folder.py"):
      records.FolderRecords(damaged, "val")
  with open(os.path.join(damaged, "info.json"), "w") as f:
    json.dump({**info, "classes": info["classes"][:1]}, f)
  val = records.FolderRecords(damaged, "val")
  with pytest.raises(
    DataError,
    match=r"val.array_record: record \d+ has label [1-9]\d*, but the dataset.s labels are 0-0, one per class;",
  ):
    for i in range(len(val)):
      val[i]


def test_imagenet2012_pointed_at_a_converted_folder_says_to_train_on_it_as_an_image_folder(folder):
  """It said "TFDS dataset 'imagenet2012' not found" and how to prepare ImageNet, not what the folder holds."""
  with pytest.raises(
    DataError,
    match=r"holds a converted image folder \(info.json\): train on it with --config.data.dataset=image_folder$",
  ):
    records.TfdsRecords("imagenet2012", "train", folder["dir"])


def test_a_label_naming_no_class_is_refused_whatever_holds_the_records():
  """The records' own check (a converted folder, TFDS) does not see a decoded cache built before it: the image
  source checks each label it hands on."""
  image = jpeg_bytes(class_image(0, np.random.default_rng(0), 16, 16))
  source = ImageSource(records.ListRecords([(image, 1, "a.jpg"), (image, 2, "b.jpg")]), 2, "train")
  assert source.eval_example(0, 8)[1] == 1
  with pytest.raises(DataError, match=r"^train: b.jpg has label 2, but the dataset's labels are 0-1: its files"):
    source.eval_example(1, 8)


def test_a_record_damaged_after_opening_is_a_data_error_naming_the_file(folder, tmp_path):
  """riegeli's RuntimeError ("chunk data hash mismatch") comes at the read, after a whole epoch maybe: it names no
  file and was a traceback."""
  damaged = str(tmp_path / "converted")
  shutil.copytree(folder["dir"], damaged)
  path = os.path.join(damaged, "train.array_record")
  cache = str(tmp_path / "cache.array_record")
  records.build_disk_cache(records.FolderRecords(damaged, "train"), cache, 16, workers=1)
  flip_bytes(path)
  train = records.FolderRecords(damaged, "train")  # the footer is intact: it opens
  with pytest.raises(DataError, match=r"train.array_record is damaged or unreadable \(.*hash.*prepare_image_folder.py"):
    for i in range(len(train)):
      train[i]
  flip_bytes(cache)
  on_disk = records.DecodedCache(cache)
  with pytest.raises(DataError, match=r"cache.array_record is damaged or unreadable \(.*hash.*delete that file"):
    for i in range(len(on_disk)):
      on_disk[i]
  with pytest.raises(DataError, match=r"cache.array_record is damaged or unreadable \(.*delete that file"):
    records.DecodedCache(cache, in_memory=True)


def test_an_empty_eval_split_is_refused_when_loaded(tmp_path):
  for split in ("train", "val"):
    os.makedirs(tmp_path / "raw" / split / "cat")
  (tmp_path / "raw" / "val" / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
  # A file name that is not UTF-8 is kept (as its bytes), not a UnicodeEncodeError.
  name = os.fsdecode(b"caf\xe9.jpg")
  (tmp_path / "raw" / "train" / "cat" / name).write_bytes(jpeg_bytes(class_image(0, np.random.default_rng(0), 32, 32)))
  # Refused by the conversion (it wrote the empty split, refused only when loaded), nothing left behind.
  with pytest.raises(DataError, match=r"raw/val: no image decodes \(1 skipped, named in the log above\)"):
    records.convert_image_folder(str(tmp_path / "raw"), str(tmp_path / "converted"))
  assert os.listdir(tmp_path / "converted") == []
  # A split with no image files at all: refused before any decoding.
  os.remove(tmp_path / "raw" / "val" / "cat" / "broken.jpg")
  with pytest.raises(DataError, match=r"raw/val has no .*jpg.* files in its class folders; put images in"):
    records.convert_image_folder(str(tmp_path / "raw"), str(tmp_path / "converted"))
  records.convert_image_folder(str(tmp_path / "raw"), str(tmp_path / "converted"), ("train",))
  assert sorted(os.listdir(tmp_path / "converted")) == ["info.json", "train.array_record"]
  assert records.FolderRecords(str(tmp_path / "converted"), "train")[0][1:] == (0, "cat/caf\ufffd.jpg")
  # An empty split file (an earlier conversion's): refused when loaded.
  with records._writer(str(tmp_path / "converted" / "val.array_record")):
    pass
  with pytest.raises(DataError, match="val.array_record holds no images.*FOLDER/val/CLASS_NAME"):
    records.FolderRecords(str(tmp_path / "converted"), "val")


def test_every_kind_of_image_decodes_to_rgb_or_is_refused():
  rng = np.random.default_rng(0)
  for kind, data in bad_files(rng, 3).items():
    if kind in DECODABLE:
      out = transforms.decode_crop_resize(data, 24, np.random.default_rng(1), flip=True)
      assert out.shape == (24, 24, 3) and out.dtype == np.uint8
    else:
      with pytest.raises(transforms.BadImage):
        transforms.decode_crop_resize(data, 24, np.random.default_rng(1))


def test_junk_before_the_end_marker_leaves_the_image_whole_on_every_path():
  """libjpeg warns "N extraneous bytes before marker 0xd9" for bytes after the last scan: the pixels are all there
  (Pillow decodes them; the region decoder stops before those bytes). The whole-image decoder took the warning
  for damage, so the image folder dropped such a file and the decoded cache trained on other examples."""
  good = jpeg_bytes(class_image(0, np.random.default_rng(0), 120, 90))
  junk = good[:-2] + b"\0\0\0\xff\xd9"
  for region_decode in (False, True):
    for rng in (None, np.random.default_rng(1)):  # evaluation's centre crop, and a training crop
      same_rng = None if rng is None else np.random.default_rng(1)
      np.testing.assert_array_equal(
        transforms.decode_crop_resize(junk, 32, rng, region_decode=region_decode),
        transforms.decode_crop_resize(good, 32, same_rng, region_decode=region_decode),
      )
  np.testing.assert_array_equal(
    np.asarray(transforms.decode_shorter_side(junk, 48)), np.asarray(transforms.decode_shorter_side(good, 48))
  )


def test_reduced_size_decoding_matches_full_decoding():
  """A box much larger than the output is decoded at 1/4 size: close to, not equal to, full decoding."""
  y, x = np.mgrid[0:375, 0:500].astype(np.float32)
  smooth = np.stack([120 + 100 * np.sin(x / 40), 120 + 100 * np.cos(y / 30), 0.4 * (x + y) % 255], -1)
  data = jpeg_bytes(Image.fromarray(smooth.astype(np.uint8)))
  # The centre box is 328 px; for 64 px out, 1/4 scale (82 px) is the smallest that keeps it >= 64.
  assert transforms._turbo_decode(data, (500, 375), 82, 82).shape == (94, 125, 3)
  reduced = transforms.decode_crop_resize(data, 64, reduced_decode=True).astype(np.float32)
  full = transforms.decode_crop_resize(data, 64, reduced_decode=False).astype(np.float32)
  difference = np.abs(reduced - full).mean()
  assert 0 < difference < 4.0
  # Without reduced decoding the JPEG is decoded at full size: close to Pillow's own full decode
  # (a 1/8-size decode of this noisy picture is 7 levels off on average).
  noisy = jpeg_bytes(class_image(5, np.random.default_rng(2), 500, 375))
  pillow = transforms.crop_resize(transforms.decode(noisy), transforms.center_crop_box(500, 375), 64)
  ours = transforms.decode_crop_resize(noisy, 64, reduced_decode=False)
  assert np.abs(ours.astype(np.float32) - pillow).mean() < 1.5


def test_the_jpeg_region_decoder_was_built():
  assert transforms.region_decoding_available(), (
    "light_jax/data/_jpeg_region.c was not compiled: install gcc and libjpeg-dev, then pip install -e . "
    "(make does both)"
  )


def _region_test_jpegs():
  """JPEGs the region decoder must handle like whole-image decoding: 4:2:0 (the usual), 4:4:4, 4:2:2,
  greyscale, progressive, odd sizes, portrait (Pillow's pass order depends on the height), tiny."""
  rng = np.random.default_rng(7)

  def encode(image, **options):
    buffer = __import__("io").BytesIO()
    image.save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()

  picture = class_image(3, rng, 333, 251)
  return {
    "420": encode(picture),
    "444": encode(picture, subsampling=0),
    "422": encode(picture, subsampling=1),
    "grey": encode(picture.convert("L")),
    "progressive": encode(picture, progressive=True),
    "wide": encode(class_image(1, rng, 640, 97)),
    "portrait": encode(class_image(5, rng, 375, 500)),
    "tiny": encode(class_image(2, rng, 17, 9)),
  }


@pytest.mark.parametrize("kind", ["420", "444", "422", "grey", "progressive", "wide", "portrait", "tiny"])
def test_region_decoding_gives_the_pixels_of_whole_image_decoding(kind):
  """Decoding only the rows (and columns) a training box needs changes no pixel of the output, at every DCT scale
  and at full size (evaluation decodes to the last row: test_evaluation_decodes_whole_...)."""
  data = _region_test_jpegs()[kind]
  cases = [(size, seed, reduced) for size in (16, 48, 112, 128, 224) for seed in range(6) for reduced in (True, False)]

  def outputs(region_decode):  # False: the whole image through simplejpeg
    return [
      transforms.decode_crop_resize(
        data, size, np.random.default_rng(seed), seed % 2 == 0, reduced_decode=reduced, region_decode=region_decode
      )
      for size, seed, reduced in cases
    ]

  for region, whole in zip(outputs(True), outputs(False), strict=True):
    np.testing.assert_array_equal(region, whole)


def test_region_decoder_rows_are_the_rows_of_a_full_decode():
  import simplejpeg

  from light_jax.data import _jpeg_region

  data = _region_test_jpegs()["420"]
  for denominator in (1, 2, 4, 8):
    full = simplejpeg.decode_jpeg(
      data, "RGB", fastdct=True, fastupsample=True, min_width=-(-333 // denominator), min_height=-(-251 // denominator)
    )
    height, width = full.shape[:2]
    for left, top, right, bottom in [
      (0, 0, width, height),
      (3, 5, width // 2, height // 2),
      (width // 3, 1, width, 7),
      (width - 2, height - 1, width, height),
    ]:
      rows = np.frombuffer(_jpeg_region.decode_region(data, denominator, left, top, right, bottom), np.uint8)
      rows = rows.reshape(bottom - top, width, 3)
      np.testing.assert_array_equal(rows[:, left:right], full[top:bottom, left:right])
  with pytest.raises(ValueError, match="not inside"):
    _jpeg_region.decode_region(data, 2, 0, 0, 168, 10)  # 333 / 2 rounds up to 167 columns
  with pytest.raises(ValueError, match="denominator must be 1, 2, 4 or 8, not 3"):
    _jpeg_region.decode_region(data, 3, 0, 0, 8, 8)
  for kind, bad in bad_files(np.random.default_rng(5), 0).items():
    if kind in ("cmyk", "truncated", "corrupt", "png"):  # Pillow decides these, or they are refused
      with pytest.raises(ValueError, match="libjpeg"):
        _jpeg_region.decode_region(bad, 1, 0, 0, 8, 8)


def test_a_cut_off_jpeg_is_refused_even_when_the_box_lies_above_the_cut():
  """Damage below a box would go unseen by a decoder that stops at the box: a file is bad for every box."""
  data = jpeg_bytes(class_image(4, np.random.default_rng(6), 256, 768))
  cut = data[: len(data) // 2]  # about the top 384 rows remain
  boxes_above_the_cut = 0
  for seed in range(20):
    box = transforms.random_resized_crop_box(256, 768, np.random.default_rng(seed), (0.01, 0.03))
    boxes_above_the_cut += box[3] < 300
    with pytest.raises(transforms.BadImage):
      transforms.decode_crop_resize(cut, 16, np.random.default_rng(seed), scale=(0.01, 0.03))
  assert boxes_above_the_cut >= 5


def test_bad_records_are_replaced_by_the_next_good_one_with_its_own_label():
  rng = np.random.default_rng(3)
  bad = bad_files(rng, 0)
  items = [
    (jpeg_bytes(class_image(0, rng, 50, 40)), 0, "a.JPEG"),
    (bad["truncated"], 1, "truncated.JPEG"),
    (bad["corrupt"], 2, "corrupt.JPEG"),
    (bad["cmyk"], 3, "cmyk.JPEG"),
    (bad["png"], 4, "png.JPEG"),
  ]
  source = ImageSource(records.ListRecords(items), 5, "test")
  labels = [source.train_example(i, np.random.default_rng(i), 16)[1] for i in range(5)]
  assert labels == [0, 3, 3, 3, 4]  # 1 and 2 are bad: record 3 stands in, with label 3
  assert source.bad_records == {"truncated.JPEG", "corrupt.JPEG"}
  assert source.eval_example(2, 16)[1:] == (3, False)  # a stand-in: evaluation does not count it
  assert source.eval_example(3, 16)[1:] == (3, True)
  # Evaluation: records 1 and 2 are bad, so record 3 counts once, with its label, and the split has 3 to count.
  batch = EvalBatches(source, 8, image_size=16).load(0)
  assert batch["labels"][:5].tolist() == [0, 3, 3, 3, 4] and batch["mask"].tolist() == [1, 0, 0, 1, 1, 0, 0, 0]
  all_bad = ImageSource(records.ListRecords([(bad["corrupt"], 0, "x")] * 3), 1, "test")
  with pytest.raises(DataError, match="cannot be decoded"):
    all_bad.eval_example(0, 16)


def test_a_decoded_cache_build_starts_worker_processes_only_where_they_finish_sooner():
  """Starting them takes seconds (each imports light_jax.data): the first chunk's time per image decides."""
  assert not records._pool_pays(0.001, 6, workers=2)  # a test folder: decoded before a pool would have started
  assert records._pool_pays(0.001, 1_280_000, workers=2)  # ImageNet
  assert records._pool_pays(0.1, 4_000, workers=64)  # a few thousand large photos on many cores
  assert not records._pool_pays(0.1, 1_000_000, workers=1)


def test_decoded_cache_gives_the_jpeg_paths_pixels(folder, tmp_path, capfd):
  source = records.FolderRecords(folder["dir"], "train")
  # A record list with a bad file in it: the cache keeps the slot empty, so indices stay aligned.
  items = [source[i] for i in range(len(source))]
  items.insert(3, (bad_files(np.random.default_rng(4), 0)["truncated"], 0, "truncated.JPEG"))
  jpegs = records.ListRecords(items)
  path = str(tmp_path / "cache.array_record")
  records.build_disk_cache(jpegs, path, shorter=40, workers=2)
  # Named as it is built: training knows it only as the cache's record 3.
  assert "decoded cache: skipping bad image truncated.JPEG (" in capfd.readouterr().err
  disk, memory = records.DecodedCache(path), records.DecodedCache(path, in_memory=True)
  assert len(disk) == len(memory) == len(jpegs)  # the last record, the records' fingerprint, is not an image
  assert disk.source_fingerprint == memory.source_fingerprint == jpegs.fingerprint
  for i in range(len(jpegs)):
    data, label, _ = jpegs[i]
    pixels, cached_label, _ = disk[i]
    assert cached_label == label
    assert (memory[i][0] is None) if pixels is None else np.array_equal(memory[i][0], pixels)
    if i == 3:
      assert pixels is None
      continue
    reference = transforms.decode_shorter_side(data, 40)
    assert np.array_equal(pixels, np.asarray(reference))
    assert min(pixels.shape[:2]) == min(40, min(Image.open(__import__("io").BytesIO(data)).size))
    # ImageSource's cache path gives the crop of the freshly decoded and scaled JPEG.
    np.testing.assert_array_equal(
      ImageSource(disk, 5, "cache").eval_example(i, 24)[0],
      transforms.crop_resize(reference, transforms.center_crop_box(*reference.size), 24),
    )
  # Through ImageSource: same labels as the JPEG path, bad slot replaced the same way.
  cached, direct = ImageSource(disk, 5, "cache"), ImageSource(jpegs, 5, "jpeg")
  assert [cached.eval_example(i, 16)[1] for i in range(8)] == [direct.eval_example(i, 16)[1] for i in range(8)]


def _batches(source, process_index=0, process_count=1):
  """Epoch 0: 16 px images in global batches of 16; epoch 1: 24 px in batches of 8."""
  return TrainBatches(
    source,
    16,
    2,
    seed=7,
    process_index=process_index,
    process_count=process_count,
    random_flip=True,
    resolution_schedule=((0, 16), (1, 24, 8)),
  )


def test_batches_are_deterministic_across_threads_workers_and_processes(folder):
  source = ImageSource(records.FolderRecords(folder["dir"], "train"), 5, "train")
  one = _batches(source)
  first_epoch_steps = len(source) // 16
  assert one.plan.steps_per_epoch == [first_epoch_steps, len(source) // 8]
  assert one.num_steps == first_epoch_steps + len(source) // 8 and one.image_size_at(0) == 16
  assert one.image_size_at(first_epoch_steps) == 24  # progressive resizing: epoch 1 -> 24 px, batch 8
  steps = [0, 1, first_epoch_steps, one.num_steps - 1]
  reference = [one.load(s) for s in steps]
  assert reference[0]["images"].shape == (16, 16, 16, 3) and reference[2]["images"].shape == (8, 24, 24, 3)
  assert reference[0]["images"].dtype == np.uint8
  threaded = list(one.iterator(0, read_threads=3))
  assert len(threaded) == one.num_steps
  for s, batch in zip(steps, reference):
    for key in batch:
      np.testing.assert_array_equal(threaded[s][key], batch[key])
  # Two processes: each its half of every global batch, the two halves are the one-process batch.
  halves = [_batches(source, p, 2) for p in range(2)]
  for s, batch in zip(steps, reference):
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([h.load(s)[key] for h in halves]), batch[key])
  # Each epoch's rows are disjoint between the processes and cover one permutation of the split.
  for epoch, (first, last) in enumerate([(0, first_epoch_steps), (first_epoch_steps, one.num_steps)]):
    shards = [np.concatenate([h.indices(s)[0] for s in range(first, last)]) for h in halves]
    assert not set(shards[0].tolist()) & set(shards[1].tolist())
    covered = (last - first) * one.plan.batch_sizes[epoch]
    assert len(set(np.concatenate(shards).tolist())) == covered and len(source) - covered < one.plan.batch_sizes[epoch]


def test_worker_processes_give_the_same_batches(folder):
  from absl import flags

  if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; train.py parses them in app.run
    flags.FLAGS.mark_as_parsed()
  source = ImageSource(records.FolderRecords(folder["dir"], "train"), 5, "train")
  batches = _batches(source)
  in_process = [batches.load(s) for s in range(3)]
  iterator = batches.iterator(0, workers=2)
  try:
    for expected in in_process:
      got = next(iterator)
      np.testing.assert_array_equal(got["images"], expected["images"])
      np.testing.assert_array_equal(got["labels"], expected["labels"])
  finally:
    iterator.close()


def test_eval_batches_cover_the_split_once(folder):
  """Two processes' unmasked rows of the padded batches are every record once, in order, each with the
  label of its file."""
  source = ImageSource(records.FolderRecords(folder["dir"], "val"), 5, "val")
  halves = [EvalBatches(source, 8, process_index=p, process_count=2, image_size=20) for p in range(2)]
  assert halves[0].num_batches == 3 and len(source) == 19  # 5 padding rows
  images, labels = [], []
  for b in range(halves[0].num_batches):
    for half in halves:
      batch = half.load(b)
      assert batch["images"].shape == (4, 20, 20, 3)
      valid = batch["mask"] == 1
      images.extend(batch["images"][valid])
      labels.extend(batch["labels"][valid].tolist())
  expected = [source.eval_example(i, 20) for i in range(len(source))]
  assert labels == [label for _, label, _ in expected]
  for image, (expected_image, _, _) in zip(images, expected, strict=True):
    np.testing.assert_array_equal(image, expected_image)
  written = {name: label for name, label, _ in folder["written"]["val"]}
  assert labels == [written[source.records[i][2]] for i in range(len(source))]


def test_train_py_on_an_image_folder_with_a_disk_cache(folder, tmp_path):
  """The CLI end to end: converted folder, decoded disk cache built on first use, two resolutions with
  a batch size each."""
  workdir = tmp_path / "run"
  result = train_py(
    "--config",
    "configs/imagenet_resnet50.py:tiny",
    "--workdir",
    str(workdir),
    "--config.data.dataset=image_folder",
    f"--config.data.data_dir={folder['dir']}",
    f"--config.data.cache_dir={tmp_path / 'cache'}",
    "--config.data.resolution_schedule=0:16,1:24:8",
    "--config.data.image_size=24",
    "--config.global_batch_size=16",
    "--config.data.num_workers=-1",
    "--config.data.host_prefetch=-1",
    "--config.comm.fusion=adaptive",
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert "decoded cache: building" in result.stderr
  assert "every one of the 51 training images is read from" in result.stderr  # 48 + cmyk, grey, png
  assert re.search(r"input autotune: using \d+ worker process\(es\)", result.stderr)  # both measured
  assert "input autotune: using prefetch depth" in result.stderr
  assert "batch 16x16x16x3" in result.stderr and "batch 8x24x24x3" in result.stderr  # one compile per phase
  # MG-WFBP buckets planned for each phase's batch shape (backward time scales with batch and pixels).
  assert "adaptive fusion (MG-WFBP, v100_nvlink_25gbe) for batch 16x16x16x3" in result.stderr
  assert "adaptive fusion (MG-WFBP, v100_nvlink_25gbe) for batch 8x24x24x3" in result.stderr
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [(m["epoch"], m["step"]) for m in metrics] == [(1.0, 51 // 16), (2.0, 51 // 16 + 51 // 8)]
  assert metrics[-1]["eval_examples"] == 4 * 4 + 3  # val: 4 classes x 4 + the 3 decodable bad kinds
  assert 0 <= metrics[-1]["input_wait_fraction"] < 1


def test_a_16_bit_greyscale_png_keeps_its_range():
  """Pillow converts a 16-bit greyscale image to RGB by clipping at 255: a mid-grey X-ray came out white."""
  import io

  from PIL import Image

  for value, expected in ((30_000, 30_000 // 257), (65_535, 255), (0, 0)):
    buffer = io.BytesIO()
    Image.fromarray(np.full((20, 30), value, np.uint16)).save(buffer, format="PNG")
    out = transforms.decode_crop_resize(buffer.getvalue(), 8)
    assert out.shape == (8, 8, 3) and out.dtype == np.uint8 and np.all(out == expected), (value, out.mean())


def test_an_image_too_long_for_the_cache_is_a_bad_record_not_a_failed_build():
  """The cache stores sides as uint16: a 70,000 px strip raised struct.error and ended the whole build."""
  import io

  from PIL import Image

  buffer = io.BytesIO()
  Image.fromarray(np.zeros((10, 70_000, 3), np.uint8)).save(buffer, format="PNG")
  assert records._parse_cache_record(records._decode_for_cache((buffer.getvalue(), 3, "strip.png"), 16)) == (None, 3)


def test_a_child_whose_parent_ended_before_it_was_bound_to_it_ends():
  """The check that the parent is still there compared the parent's pid with 1: under a subreaper (a container's
  init, systemd --user) an orphan's parent is the subreaper, and the orphan went on."""
  code = "import sys; from light_jax import child_process; child_process.die_with_parent(int(sys.argv[1])); print('on')"
  for parent, expected in ((os.getpid(), "on\n"), (os.getpid() + 1, "")):  # this test's process; another one
    result = subprocess.run([sys.executable, "-c", code, str(parent)], cwd=ROOT, capture_output=True, text=True)
    assert result.stdout == expected and result.returncode == (0 if expected else 1), result.stderr


ORPHANS = """
import concurrent.futures, multiprocessing, os, sys, time
from light_jax import child_process

def pid_and_sleep(_):
  time.sleep(1)
  return os.getpid()

if __name__ == "__main__":
  bound = child_process.bound_to_this_process()
  pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=bound)
  print(" ".join(str(pid) for pid in set(pool.map(pid_and_sleep, range(4)))), flush=True)
  pool.submit(time.sleep, 60)
  time.sleep(60)
"""


def test_the_cache_builders_workers_end_with_the_build_and_its_leftovers_go(tmp_path):
  """A build killed with SIGKILL left its spawned workers decoding on, and its partial file on disk."""
  import signal
  import time

  script = tmp_path / "orphans.py"
  script.write_text(ORPHANS)
  build = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  workers = [int(pid) for pid in build.stdout.readline().split()]
  assert len(workers) == 2
  build.send_signal(signal.SIGKILL)
  build.wait()
  deadline = time.time() + 10
  while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in workers):
    time.sleep(0.1)
  alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
  for pid in alive:
    os.kill(pid, signal.SIGKILL)
  assert not alive
  # The partial files of killed builds: removed once nothing has written to them for an hour.
  # Another cache's too: a build killed, then run at another size (it stayed, a second copy's worth of disk).
  path = tmp_path / "decoded_160px_x.array_record"
  old, live = tmp_path / (path.name + ".tmp-old"), tmp_path / (path.name + ".tmp-live")
  other = tmp_path / "decoded_128px_x.array_record.tmp-old"
  for leftover in (old, live, other):
    leftover.write_bytes(b"partial")
  for stale in (old, other):
    os.utime(stale, (time.time() - 2 * records.STALE_PARTIAL_SECONDS,) * 2)
  records._remove_stale_partial_files(str(path))
  assert not old.exists() and not other.exists() and live.exists()


def test_a_jpeg_damaged_mid_file_is_a_bad_image_on_the_whole_image_path():
  """Damaged entropy-coded data: the region decoder refused it, but the whole-image path fell back to Pillow, which
  decoded the damage into the pixels, so the conversion kept the file and crops differed by path."""
  import io

  from PIL import Image

  rng = np.random.default_rng(0)
  buffer = io.BytesIO()
  Image.fromarray((rng.random((256, 256, 3)) * 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
  for fraction in (0.3, 0.5, 0.7):  # some of these Pillow decoded without a word
    damaged = bytearray(buffer.getvalue())
    at = int(len(damaged) * fraction)
    damaged[at : at + 50] = rng.integers(0, 256, 50, dtype=np.uint8).tobytes()
    with pytest.raises(transforms.BadImage):
      transforms.decode_crop_resize(bytes(damaged), 8, region_decode=False)
  assert transforms.decode_crop_resize(buffer.getvalue(), 8, region_decode=False).shape == (8, 8, 3)


def test_evaluation_decodes_whole_so_a_jpeg_damaged_below_its_centre_box_counts_on_no_path():
  """Damage near the bottom of a file that still ends with its end marker: the region decoder stops above it.
  Evaluation decodes whole with or without the decoder built, so the image is bad (masked) either way."""
  import io

  from PIL import Image

  buffer = io.BytesIO()
  pixels = (np.random.default_rng(0).random((768, 256, 3)) * 255).astype(np.uint8)
  Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
  damaged = bytearray(buffer.getvalue())
  at = int(len(damaged) * 0.8)
  damaged[at : at + 50] = np.random.default_rng(1).integers(0, 256, 50, dtype=np.uint8).tobytes()
  assert damaged.endswith(b"\xff\xd9")
  for region_decode in (True, False):
    with pytest.raises(transforms.BadImage):
      transforms.decode_crop_resize(bytes(damaged), 32, region_decode=region_decode)


def test_a_disk_that_fills_up_while_a_record_file_is_written_is_one_error(tmp_path):
  """The converted folder or the decoded cache: the writer raises from write() once it has ~16 MB buffered (a
  RuntimeError traceback), not only at its close; the partial file goes."""
  with tmpfs(tmp_path / "disk", "size=1m") as disk:
    with pytest.raises(DataError) as failed, records._writer(str(disk / "train.array_record")) as writer:
      for _ in range(40):
        writer.write(np.random.default_rng(0).bytes(1 << 20))
    assert os.listdir(disk) == []
  assert str(failed.value).startswith(f"writing {disk / 'train.array_record'} failed (")
  assert str(failed.value).endswith("); check the free space there and run again")


def test_a_program_that_leaves_at_a_signal_through_its_exit_handlers_removes_its_partial_record_file(tmp_path):
  """The benchmarks leave at a signal through exit_codes.exit_now(exit_handlers=True), past _writer's own clean-up:
  benchmarks/input_pipeline.py --workdir kept its caches' partial files."""
  code = (
    "import sys\nfrom light_jax.data import records\nfrom light_jax.exit_codes import exit_now\n"
    "with records._writer(sys.argv[1]) as writer:\n  writer.write(b'x' * 1000)\n"
    "  exit_now('stopped by SIGTERM while measuring', 143, exit_handlers=True)\n"
  )
  result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache.array_record")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
  assert result.returncode == 143 and result.stderr.strip().endswith("stopped by SIGTERM while measuring"), result
  assert os.listdir(tmp_path) == []
