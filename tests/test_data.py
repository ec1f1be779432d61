import errno
import gzip
import logging
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from PIL import Image

from light_jax.data import DataError, EvalBatches, TrainBatches, fashion_mnist, load_dataset
from light_jax.data.pipeline import pad_crop_flip
from light_jax.data.transforms import resize_images
from tests.helpers import ROOT, random_source


def test_pad_crop_flip_matches_a_per_image_loop():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(6, 5, 7, 2), dtype=np.uint8)
  offsets = rng.integers(0, 5, size=(6, 2))
  flips = rng.random(6) < 0.5
  out = pad_crop_flip(images, offsets, flips, padding=2)
  for i in range(6):
    padded = np.pad(images[i], ((2, 2), (2, 2), (0, 0)))
    crop = padded[offsets[i, 0] : offsets[i, 0] + 5, offsets[i, 1] : offsets[i, 1] + 7]
    np.testing.assert_array_equal(out[i], crop[:, ::-1] if flips[i] else crop)


def _all_batches(batches, start=0):
  return list(batches.iterator(start))


def test_train_batches_are_the_same_for_any_process_count():
  source = random_source(200)
  one = TrainBatches(source, 32, num_epochs=2, seed=3, crop_padding=2, random_flip=True)
  halves = [
    TrainBatches(source, 32, num_epochs=2, seed=3, process_index=p, process_count=2, crop_padding=2, random_flip=True)
    for p in range(2)
  ]
  assert one.num_steps == 12 == halves[0].num_steps
  for step, (whole, a, b) in enumerate(zip(_all_batches(one), _all_batches(halves[0]), _all_batches(halves[1]))):
    for key in ("images", "labels"):
      np.testing.assert_array_equal(whole[key], np.concatenate([a[key], b[key]]), err_msg=f"step {step}")


def test_progressive_resizing_of_an_array_dataset_resizes_each_phase_with_its_batch():
  """data.resolution_schedule on arrays: each phase's images are the augmented ones resized by Pillow
  (bilinear), in the phase's batch size, the same on any process count; a phase at the source's own size is
  left as it is."""
  source = random_source(200)  # 12 x 12 images
  plan = ((0, 8, 40), (1, 12))  # epoch 0: 8 px in batches of 40 (5 steps); epoch 1: 12 px in batches of 32 (6)
  one = TrainBatches(source, 32, num_epochs=2, seed=3, resolution_schedule=plan)
  plain = TrainBatches(source, 32, num_epochs=2, seed=3)  # no augmentation, so its epoch 1 is the same
  assert one.num_steps == 11 and [one.plan.batch_size_at(s) for s in (4, 5)] == [40, 32]
  batches = _all_batches(one)
  assert [b["images"].shape for b in (batches[0], batches[5])] == [(40, 8, 8, 1), (32, 12, 12, 1)]
  indices, _ = one.indices(0)
  for image, i in zip(batches[0]["images"], indices):
    expected = Image.fromarray(source.images[i][..., 0]).resize((8, 8), Image.Resampling.BILINEAR)
    np.testing.assert_array_equal(image[..., 0], np.asarray(expected))
  np.testing.assert_array_equal(batches[5]["images"], _all_batches(plain, start=6)[0]["images"])  # epoch 1 at 12 px
  halves = [TrainBatches(source, 32, 2, 3, process_index=p, process_count=2, resolution_schedule=plan) for p in (0, 1)]
  for whole, a, b in zip(batches, _all_batches(halves[0]), _all_batches(halves[1])):
    np.testing.assert_array_equal(whole["images"], np.concatenate([a["images"], b["images"]]))
  # Augmented first, at the source's size (4 px of padding of a 12 px image), then resized.
  augment = dict(crop_padding=4, random_flip=True)
  small = TrainBatches(source, 32, 1, seed=3, resolution_schedule=((0, 8),), **augment)
  full = TrainBatches(source, 32, 1, seed=3, **augment)
  for resized, augmented in zip(_all_batches(small), _all_batches(full)):
    np.testing.assert_array_equal(resized["images"], resize_images(augmented["images"], 8))


def test_resize_images_resizes_every_channel_on_its_own():
  """Any channel count: each channel as Pillow resizes a greyscale image (2 or 4 channels are not colour and
  alpha), and RGB as Pillow resizes RGB."""
  images = np.random.default_rng(0).integers(0, 256, size=(3, 12, 12, 4), dtype=np.uint8)
  for channels in (1, 2, 3, 4):
    out = resize_images(images[..., :channels], 7)
    assert out.shape == (3, 7, 7, channels) and out.dtype == np.uint8
    for c in range(channels):
      expected = Image.fromarray(images[1, ..., c]).resize((7, 7), Image.Resampling.BILINEAR)
      np.testing.assert_array_equal(out[1, ..., c], np.asarray(expected))


def test_each_epoch_is_a_new_permutation_without_repeats():
  n = 64
  source = random_source(n)
  source = type(source)(source.images, np.arange(n, dtype=np.int32))  # label = example index
  batches = _all_batches(TrainBatches(source, 16, num_epochs=3, seed=0))
  epochs = [np.concatenate([b["labels"] for b in batches[e * 4 : (e + 1) * 4]]) for e in range(3)]
  for e in epochs:
    assert sorted(e) == list(range(n))
  assert not np.array_equal(epochs[0], epochs[1])


def test_neighbouring_seeds_do_not_share_epoch_orders():
  """grain seeds epoch e of its shuffle with seed + e; the run seed is hashed first, so seed 1's epoch 0 is
  not seed 0's epoch 1."""
  source = random_source(64)
  orders = {}
  for seed in range(3):
    batches = TrainBatches(source, 16, num_epochs=3, seed=seed)
    for epoch in range(3):
      orders[seed, epoch] = np.concatenate([batches.indices(s)[0] for s in range(epoch * 4, (epoch + 1) * 4)])
  assert not np.array_equal(orders[0, 1], orders[1, 0]) and not np.array_equal(orders[0, 2], orders[2, 0])
  distinct = {tuple(order) for order in orders.values()}
  assert len(distinct) == len(orders)


def test_same_seed_same_batches_and_resume_mid_run():
  source = random_source(100)
  a = _all_batches(TrainBatches(source, 20, num_epochs=2, seed=7, crop_padding=1))
  b = _all_batches(TrainBatches(source, 20, num_epochs=2, seed=7, crop_padding=1), start=3)
  c = _all_batches(TrainBatches(source, 20, num_epochs=2, seed=8, crop_padding=1))
  assert len(a) == 10 and len(b) == 7
  for x, y in zip(a[3:], b):
    np.testing.assert_array_equal(x["images"], y["images"])
  assert not np.array_equal(a[0]["labels"], c[0]["labels"])


def test_eval_counts_every_example_exactly_once_with_padding():
  n = 103
  source = random_source(n)
  source = type(source)(source.images, np.arange(n, dtype=np.int32))
  seen = []
  for p in range(2):
    for batch in EvalBatches(source, 40, process_index=p, process_count=2).iterator():
      assert batch["images"].shape[0] == 20
      seen.extend(batch["labels"][batch["mask"] == 1].tolist())
  assert sorted(seen) == list(range(n))


def test_eval_padding_and_the_batch_that_pads_less():
  batches = EvalBatches(random_source(50_000), 16_384)
  assert (batches.num_batches, batches.padded_examples) == (4, 65_536)
  # The same 4 batches, each a multiple of 128 devices: 4 x 12,544 = 50,176 rows, 176 of them padding.
  assert batches.better_batch_size(128) == 12_544
  assert batches.padding_advice(128) == (
    "evaluation pads 50,000 examples to 65,536 rows in batches of 16,384 (24% of its compute is padding): "
    "--config.data.eval_batch_size=12544 evaluates in 4 batches with 176 padding rows"
  )
  # On 1,024 devices 4 batches pad at least 3,248 rows (6.5%): 5 of 10,240 pad 1,200. Then nothing to say.
  assert batches.better_batch_size(1024) == 10_240
  assert EvalBatches(random_source(50_000), 10_240).padding_advice(1024) is None
  assert EvalBatches(random_source(50_000), 7_168).padding_advice(1024) is None
  # Where no batch pads within 5% (103 examples on 100 devices), the least padding, and never the same batch.
  assert EvalBatches(random_source(103), 400).better_batch_size(100) == 200  # 1 batch of 200, not 400
  assert EvalBatches(random_source(103), 200).padding_advice(100) is None
  assert EvalBatches(random_source(103), 40).better_batch_size(2) == 36  # 3 batches: 108 rows, not 120


def test_fashion_mnist_missing_gives_the_install_command(tmp_path):
  with pytest.raises(DataError, match="apt-get install -y dataset-fashion-mnist"):
    fashion_mnist.load(str(tmp_path), "train")


def test_corrupt_idx_file_is_reported(tmp_path):
  path = tmp_path / "bad.gz"
  with gzip.open(path, "wb") as f:
    f.write(b"\x00\x00\x08\x03" + (10).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\x00" * 100)
  with pytest.raises(DataError, match="truncated or corrupt"):
    fashion_mnist.read_idx(str(path))
  with gzip.open(path, "wb") as f:
    f.write(b"PK\x03\x04 not an idx file")
  with pytest.raises(DataError, match="bad magic number"):
    fashion_mnist.read_idx(str(path))
  whole = gzip.compress(b"\x00\x00\x08\x01" + (1000).to_bytes(4, "big") + bytes(range(250)) * 4)
  path.write_bytes(whole[: len(whole) // 2])  # cut off
  with pytest.raises(DataError, match="not a complete gzip file.*reinstall"):
    fashion_mnist.read_idx(str(path))
  path.write_bytes(b"not gzip at all")
  with pytest.raises(DataError, match="not a complete gzip file.*reinstall"):
    fashion_mnist.read_idx(str(path))
  # An intact gzip whose content ends inside the header (3 dimensions, one size given): was a ValueError.
  path.write_bytes(gzip.compress(b"\x00\x00\x08\x03\x00\x00"))
  with pytest.raises(DataError, match="ends inside its IDX header.*truncated or corrupt; reinstall"):
    fashion_mnist.read_idx(str(path))


def _idx(path, array) -> None:
  """``array`` (uint8) as a gzipped IDX file at ``path``."""
  header = b"\x00\x00\x08" + bytes([array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
  path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


@pytest.mark.timeout(60)  # the pipe's read, if it came back, would wait for ever
def test_fashion_mnist_files_the_trainer_cannot_use_are_refused_naming_the_file(tmp_path, monkeypatch):
  """Labels out of range trained without a word (exit 0); images of another shape, labels with two dimensions, a
  folder or a read error in a file's place were tracebacks, an empty split "fewer than one global batch", and a
  pipe in a file's place waited for ever."""
  images, labels = np.zeros((4, 28, 28)), np.array([0, 3, 9, 1])
  images_file, labels_file = (tmp_path / name for name in fashion_mnist.FILES["train"])

  def refused(match):
    with pytest.raises(DataError, match=match):
      fashion_mnist.load(str(tmp_path), "train")

  _idx(images_file, images)
  _idx(labels_file, labels)
  assert fashion_mnist.load(str(tmp_path), "train").images.shape == (4, 28, 28, 1)
  _idx(labels_file, np.array([0, 3, 200, 1]))
  refused(rf"^{labels_file} holds label 200: Fashion-MNIST has 10 classes \(0-9\); the file is corrupt")
  _idx(labels_file, labels[:, None])
  refused(rf"^{labels_file} holds labels of shape \(4, 1\), not one per image")
  _idx(labels_file, labels)
  for shape in ((4, 784), (3136,)):
    _idx(images_file, np.zeros(shape))
    refused(rf"^{images_file} holds an array of shape \({shape[0]},( {shape[-1]})?\), not N images of 28 x 28")
  _idx(images_file, np.zeros((0, 28, 28)))
  _idx(labels_file, np.zeros(0))
  refused(rf"^{images_file} holds no images")
  images_file.unlink()
  images_file.mkdir()
  refused(rf"^{images_file} is not a regular file")
  images_file.rmdir()
  os.mkfifo(images_file)
  refused(rf"^{images_file} is not a regular file")
  with pytest.raises(DataError, match=rf"^data.data_dir={labels_file} is a file; give the folder that holds"):
    fashion_mnist.load(str(labels_file), "train")
  images_file.unlink()
  _idx(images_file, images)

  def read_error(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")

  monkeypatch.setattr(gzip, "open", read_error)
  refused(rf"^cannot read {images_file} \(Input/output error\); make it readable or check the disk")


def test_a_subset_larger_than_its_split_is_said(caplog):
  """It ran the whole split with an INFO line at most."""
  config = ml_collections.ConfigDict(
    {"dataset": "fashion_mnist", "data_dir": fashion_mnist.DEFAULT_DIR, "train_subset": 0, "eval_subset": 20_000}
  )
  with caplog.at_level(logging.WARNING):
    _, test, _ = load_dataset(config)
  assert len(test) == 10_000 and "data.eval_subset=20000 is more than the split's 10000 examples" in caplog.text


def test_fashion_mnist_data_dir_expands_the_home_directory(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  config = ml_collections.ConfigDict({"dataset": "fashion_mnist", "data_dir": "~/fmnist", "train_subset": 0})
  with pytest.raises(DataError, match=f"missing {tmp_path}/fmnist/train-images"):
    load_dataset(config)


_SIGNALS_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import grain
from absl import flags
from light_jax.data import pipeline

if __name__ == "__main__":
  flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags
  received = []
  for sig in (signal.SIGINT, signal.SIGTERM):  # the PreemptionGuard's part: note it, carry on
    signal.signal(sig, lambda signum, frame: received.append(signum))
  iterator = pipeline._iterate(grain.MapDataset.range(100_000).map(lambda i: i), 1, 4, workers=1)
  assert next(iterator) == 0  # the worker is up
  os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C, then a scheduler's SIGTERM: to the whole group
  os.killpg(0, signal.SIGTERM)
  time.sleep(0.5)
  assert [next(iterator) for _ in range(1000)] == list(range(1, 1001))
  iterator.close()
  assert len(received) == 2
  print("workers survived")
"""


def test_input_worker_processes_survive_signals_to_the_process_group(tmp_path):
  """A Ctrl-C or a process-group SIGTERM reaches grain's workers too; they must leave it to the main
  process (which finishes the step and saves) instead of dying under it."""
  script = tmp_path / "signals.py"
  script.write_text(_SIGNALS_SCRIPT)
  result = subprocess.run(
    [sys.executable, str(script), ROOT],
    capture_output=True,
    text=True,
    timeout=120,
    start_new_session=True,  # its own process group: the signals reach it and its workers only
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert result.returncode == 0 and "workers survived" in result.stdout, result.stderr[-3000:]


def test_real_fashion_mnist_loads():
  """The Debian package's files (installed by `make test`)."""
  train = fashion_mnist.load(fashion_mnist.DEFAULT_DIR, "train")
  test = fashion_mnist.load(fashion_mnist.DEFAULT_DIR, "test")
  assert train.images.shape == (60000, 28, 28, 1) and train.images.dtype == np.uint8
  assert len(test) == 10000 and sorted(set(test.labels.tolist())) == list(range(10))
  assert abs(train.images.mean() - fashion_mnist.MEAN[0]) < 0.5 and abs(train.images.std() - fashion_mnist.STD[0]) < 0.5


def test_autotune_finds_the_prefetch_depth_that_keeps_the_read_threads_busy():
  """grain keeps at most min(read_threads, depth) batches in flight: with 4 threads on batches that
  take 20 ms each (sleeping, like I/O), depths 1 and 2 are 4x and 2x slower than 4."""
  import time as time_lib

  import grain

  from light_jax.data import autotune, pipeline

  def slow_batch(i):
    time_lib.sleep(0.02)
    return {"x": np.full((2,), i)}

  dataset = grain.MapDataset.range(100_000).map(slow_batch)
  assert autotune.prefetch_candidates(4) == [1, 2, 4, 8]
  workers, depth = autotune.best_input_settings(
    lambda w, d: pipeline._iterate(dataset, read_threads=4, buffer=d, workers=w),
    workers=0,
    prefetch=-1,
    read_threads=4,
    seconds_each=0.6,
  )
  assert workers == 0 and depth in (4, 8)  # 8 may measure a hair faster: threads never wait for work
  # A memory budget of two batches caps the depth at 2.
  _, capped = autotune.best_input_settings(
    lambda w, d: pipeline._iterate(dataset, read_threads=4, buffer=d, workers=w),
    workers=0,
    prefetch=-1,
    read_threads=4,
    seconds_each=0.6,
    batch_bytes=1000,
    memory_budget=2000,
  )
  assert capped == 2
  # Pinned values are kept without measuring.
  assert autotune.best_input_settings(lambda w, d: iter(()), workers=3, prefetch=5, read_threads=4) == (3, 5)


def test_a_closed_prefetcher_s_thread_has_left_and_an_error_reaches_the_consumer():
  """A daemon thread still inside a transfer when the interpreter exits is cut in C++ code, which aborts the process:
  a run that had saved and stopped on a SIGTERM exited 134 ("FATAL: exception not rethrown")."""
  import threading

  import jax

  from light_jax.data import DevicePrefetcher
  from light_jax.parallel import mesh as mesh_lib

  sharding = mesh_lib.batch_sharding(mesh_lib.make_mesh(2, 4))

  def endless():
    while True:
      yield {"images": np.ones((16, 28, 28, 1), np.float32)}

  before = set(threading.enumerate())
  prefetcher = DevicePrefetcher(endless(), sharding, size=2)
  assert next(prefetcher)["images"].shape == (16, 28, 28, 1)
  prefetcher.close()
  assert set(threading.enumerate()) <= before  # the prefetcher's gone (others may end meanwhile)

  def failing():
    yield {"images": np.ones((16, 28, 28, 1), np.float32)}
    raise DataError("a corrupt image")

  prefetcher = DevicePrefetcher(failing(), sharding, size=2)
  assert isinstance(next(prefetcher)["images"], jax.Array)
  with pytest.raises(DataError, match="a corrupt image"):
    next(prefetcher)
  prefetcher.close()
  assert set(threading.enumerate()) <= before  # the prefetcher's gone (others may end meanwhile)
