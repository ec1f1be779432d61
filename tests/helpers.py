"""Small models and data shared by the tests (never a stand-in for the code under test)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import fashion_mnist
from light_jax.data import ArraySource, DatasetInfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_py(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
  """``python train.py ARGS`` from the repository root on CPU; stdout and stderr captured as text."""
  return subprocess.run(
    [sys.executable, "train.py", *args],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def main_refuses(monkeypatch, capsys, script: str, *argv: str) -> str:
  """``main()`` of ``script`` (a path from the repository root) run in this process on ``argv``, refusing it as bad
  input: exit 2, nothing on stdout, no traceback; returns its stderr. For a script's checks made before its work
  (and before it sets a device count): in a subprocess each paid 2-3 s of imports. Every script keeps a
  subprocess test of its own entry point."""
  monkeypatch.setattr(sys, "path", list(sys.path))  # the script's own sys.path.insert, undone afterwards
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys, "argv", [os.path.basename(script), *argv])
  module = load_script(script)
  with pytest.raises(SystemExit) as stopped:
    module.main()
  out, err = capsys.readouterr()
  assert stopped.value.code == 2 and out == "" and "Traceback" not in err, err[-2000:]
  return err


def load_script(script: str):
  """``script`` (a path from the repository root) loaded afresh as a module, for its functions or its ``main()``."""
  name = "_script_" + os.path.splitext(os.path.basename(script))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, script))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@contextlib.contextmanager
def tmpfs(folder, options: str):
  """``folder`` (made empty) as a tmpfs mounted with ``options``: "ro,size=1m" is a read-only file system, where
  even root cannot write; "size=2m" a disk that fills up. Skipped where mount fails (it needs root)."""
  folder.mkdir(parents=True, exist_ok=True)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root)")
  try:
    yield folder
  finally:
    subprocess.run(["umount", str(folder)], check=True)


def fill_disk(path) -> None:
  """Writes ``path`` until its file system is full (ENOSPC), as another program might fill it."""
  fill = os.open(path, os.O_WRONLY | os.O_CREAT)
  with contextlib.suppress(OSError):
    while True:
      os.write(fill, b"x" * 4096)
  os.close(fill)


def file_locked(path):
  """A bare process holding a POSIX lock (lockf) on ``path`` for the duration, as another conversion holds its
  --out's .conversion.lock (light_jax/data/records.py); yields its pid."""
  return _holding("import fcntl; f = open(sys.argv[1], 'a+'); fcntl.lockf(f, fcntl.LOCK_EX)", str(path))


def workdir_held(workdir):
  """A bare process that takes ``workdir``'s lock as train.py's process 0 does, for the duration; yields its pid."""
  return _holding(f"from light_jax import checkpoint; checkpoint.lock_workdir({str(workdir)!r})")


@contextlib.contextmanager
def _holding(take: str, *args: str):
  """A bare process (in ROOT) that runs ``take`` (Python, given ``args`` in sys.argv), then holds on until killed at
  the end of the ``with``; yields its pid."""
  code = f"import sys, time; {take}; print('locked', flush=True); time.sleep(120)"
  holder = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "locked\n"
    yield holder.pid
  finally:
    holder.kill()
    holder.wait()


def override(config: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """Sets dotted fields written with "__" for "." (``comm__strategy="dense"``); returns ``config``."""
  for dotted, value in fields.items():
    *parents, leaf = dotted.split("__")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def init_variables(model: nn.Module, image_shape) -> dict:
  """``model.init`` (key 0, inference mode) on one zero image of ``image_shape``: one jitted program,
  not one per layer."""
  return jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(jnp.zeros((1, *image_shape)))


class TinyCNN(nn.Module):
  """A model without BatchNorm: its gradient over a batch is exactly the mean of per-shard gradients."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x))
    x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def random_source(n: int, shape=(12, 12, 1), num_classes: int = 10, seed: int = 0) -> ArraySource:
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
  labels = rng.integers(0, num_classes, size=n).astype(np.int32)
  return ArraySource(images, labels)


def info_for(source: ArraySource, num_classes: int = 10) -> DatasetInfo:
  return DatasetInfo(num_classes=num_classes, image_shape=source.images.shape[1:], mean=(127.5,), std=(64.0,))


def small_config(variant=None, **fields):
  """fashion_mnist.py[:variant] on 2,048 training images (batch 64: 32 steps per epoch) with resnet8_fast at width
  8 (its own is 32: a small run takes about 60% of the time, the same program otherwise), then ``fields`` (dotted
  names with "__" for ".")."""
  config = fashion_mnist.get_config(variant)
  config.data.update(train_subset=2048, eval_subset=200, eval_batch_size=64)
  config.global_batch_size = 64
  config.num_epochs = 1
  config.model.width = 8
  return override(config, **fields)


def flip_bytes(path):
  """Damages the first records of ``path``, an ArrayRecord file, not its footer and postscript (in its last 64 KiB
  and just before): the file still opens, and the reads of the damaged chunks fail."""
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    for at in range(1000, (len(data) - 65536) // 2, 4999):
      if at % 65536 > 100:  # not a block header
        data[at] ^= 0xFF
    f.seek(0)
    f.write(data)
