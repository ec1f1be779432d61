"""benchmarks/throughput.py and benchmarks/gpu_check.sh at toy size on simulated CPU devices, and the XLA
flags set on GPUs."""

import json
import os
import subprocess
import sys

from light_jax import xla_flags
from tests.helpers import ROOT


def test_throughput_benchmark_runs_the_real_step_and_reports_its_json(tmp_path):
  result = subprocess.run(
    [sys.executable, "benchmarks/throughput.py", "--model", "resnet8_small", "--image_size", "32",
     "--batch_per_device", "4", "--dtype", "float32", "--steps", "3", "--warmup", "1", "--cpu_devices", "4",
     "--nodes", "2", "--strategy", "hitopk@0.01", "--num_classes", "10", "--config.model.width=8",
     "--profile_dir", str(tmp_path / "profile"), "--profile_steps", "2"],
    cwd=ROOT, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["devices"] == 4 and out["mesh"] == [2, 2] and out["strategy"] == "hitopk@0.01"
  assert out["step_seconds"] > 0 and out["compile_seconds"] > 0
  assert abs(out["images_per_sec"] * out["step_seconds"] - 4) < 1e-6  # per device
  assert out["images_per_sec_total"] == 4 * out["images_per_sec"]
  assert out["peak_memory_bytes_per_device"] > 0 and out["inter_node_bytes_per_step"] > 0
  assert list((tmp_path / "profile").rglob("*.xplane.pb")), "no trace written"


def test_gpu_xla_flags_yield_to_the_users_own():
  user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
  merged = xla_flags.merged(user, xla_flags.GPU_FLAGS)
  assert merged.startswith(user) and merged.count("latency_hiding") == 1
  assert f"--xla_gpu_all_reduce_combine_threshold_bytes={25 * 2**20}" in merged
  env = {"XLA_FLAGS": "", "LIGHT_JAX_XLA_FLAGS": "0"}
  xla_flags.apply(env)
  assert env["XLA_FLAGS"] == ""


def test_gpu_check_script_runs_every_step_at_toy_size_on_cpu(tmp_path):
  """benchmarks/gpu_check.sh --toy: throughput, collectives, input pipeline, a training run with a profile."""
  out = tmp_path / "check"
  result = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out), "--toy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, PYTHON=sys.executable))  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((out / "gpu_check.json").read_text())
  assert summary["failed"] == [], (out / "report.txt").read_text()[-3000:]
  assert set(summary["throughput"]) == {"float32@32"}
  assert summary["throughput"]["float32@32"]["batch_per_device"] == 8
  assert summary["profile"] and summary["profile"].startswith(str(out / "train" / "profile"))
  steps = {s["step"]: s for s in summary["steps"]}
  assert steps["collectives"]["result"] and steps["input_pipeline"]["result"]
  assert json.loads(result.stdout.strip().splitlines()[-1])["failed"] == []
