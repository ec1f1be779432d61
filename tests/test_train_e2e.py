"""A short end-to-end `train.py` run on real Fashion-MNIST writes sane metrics, summary and plot, in a workdir that a
killed run left its `.lock` file in; the same command again reads its compiled programs from the compilation cache.

The loop's other behaviours are tested in-process: tests/test_train_loop.py."""

import json
import os
import subprocess
import sys

from tests.helpers import ROOT, train_py

RUN = [
  "--config",
  "configs/fashion_mnist.py",
  "--config.data.train_subset=4096",
  "--config.data.eval_subset=1000",
  "--config.num_epochs=2",
  "--config.global_batch_size=128",
  "--config.data.eval_batch_size=96",
  "--config.log_every_steps=8",
  "--config.model.width=8",  # resnet8_fast's own is 32: twice the time, and nothing here depends on it
]


def test_train_py_short_run_writes_metrics_and_summary(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / ".lock").write_text("process 1 on gone-host, since 2026-01-01 00:00:00\n")  # a killed run's: no lock
  cache = f"--compilation_cache_dir={tmp_path}/cache"  # its own, not the tests' shared one: this run fills it
  result = train_py(*RUN, "--workdir", str(workdir), cache)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "mesh node x local = 2 x 4 (8 cpu devices" in result.stderr
  assert "resolved config" in result.stderr
  assert (
    f"compilation cache: {tmp_path}/cache" in result.stderr and "read from the compilation cache" not in result.stderr
  )
  assert any(name.startswith("jit_device_step-") for name in os.listdir(tmp_path / "cache"))

  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [32, 64]
  assert [r["epoch"] for r in records] == [1.0, 2.0]
  required = {
    "step",
    "epoch",
    "train_loss",
    "eval_top1",
    "eval_top5",
    "images_per_sec",
    "inter_node_bytes_per_step",
    "intra_node_bytes_per_step",
  }
  for r in records:
    assert required <= r.keys()
    assert r["eval_examples"] == 1000  # 1000 = 10 batches of 96 + a padded one: each counted once
    assert 0.0 <= r["eval_top1"] <= r["eval_top5"] <= 1.0
    assert r["images_per_sec"] > 0
    assert r["inter_node_bytes_per_step"] > 0 and r["intra_node_bytes_per_step"] > r["inter_node_bytes_per_step"]
  # It learns: 2 short epochs on 4k images clear 60% on a 10-class problem (chance is 10%).
  assert records[-1]["train_loss"] < records[0]["train_loss"] < 2.3
  assert records[-1]["eval_top1"] > 0.45 and records[-1]["final"] is True  # 0.514 measured (chance: 0.1)

  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 64
  assert summary["final_eval_top1"] == records[-1]["eval_top1"]
  assert summary["config"]["comm"]["strategy"] == "hierarchical"
  assert 0 < summary["wall_seconds"] < 600
  assert (workdir / "curves.png").stat().st_size > 10_000
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tensorboard"))
  assert (workdir / ".lock").read_text().startswith("process ") and "gone-host" not in (workdir / ".lock").read_text()

  # scripts/kernel_norms.py: the trained kernels beside the same model at initialisation.
  norms = subprocess.run(
    [sys.executable, "scripts/kernel_norms.py", str(workdir)], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert norms.returncode == 0, norms.stderr[-3000:]
  columns = json.loads(norms.stdout.splitlines()[-1])
  assert list(columns) == ["init", "run"] and columns["init"].keys() == columns["run"].keys()
  assert "Dense_0/kernel" in columns["init"] and "conv_init/kernel" in columns["init"]
  changed = [k for k in columns["init"] if abs(columns["run"][k] / columns["init"][k] - 1) > 0.01]
  assert len(changed) >= len(columns["init"]) // 2  # two epochs moved most kernels' norms by more than 1%

  # The same command again (as a resumed run would) reads the train step from the cache, and trains the same.
  again = train_py(*RUN, "--workdir", str(tmp_path / "again"), cache)
  assert again.returncode == 0, again.stderr[-4000:]
  assert "read from the compilation cache" in again.stderr
  assert [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()][-1][
    "eval_top1"
  ] == records[-1]["eval_top1"]


def test_a_step_larger_than_the_device_holds_is_one_line_that_names_the_batch(tmp_path):
  """XLA's out-of-memory error was a traceback. One CPU device under an 8 GB address-space limit: the step of 32,768
  images asks for about 14 GB (with several simulated devices the one that fails leaves the others waiting in a
  collective: one device keeps the error an error)."""
  import resource

  def limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))

  one_device = ["--config.mesh.cpu_devices=1", "--config.mesh.nodes=1", "--config.mesh.local=1"]
  big = ["--config.global_batch_size=32768", "--config.data.train_subset=32768", "--config.data.eval_subset=1000"]
  result = subprocess.run(
    [sys.executable, "train.py", "--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "run"),
     "--config.num_epochs=1", *one_device, *big],
    cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300,
    preexec_fn=limit_memory,
  )  # fmt: skip
  last = result.stderr.strip().splitlines()[-1]
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert last.startswith("error: out of the device's memory (RESOURCE_EXHAUSTED: Out of memory allocating "), last
  assert "Training asks 32,768 images over 1 device(s) a step" in last and "--config.data.eval_batch_size" in last
  assert "micro_batches" not in last  # the CPU runs the slices unrolled: they would not help here
