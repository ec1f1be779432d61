"""benchmarks/throughput.py and benchmarks/gpu_check.sh at toy size on simulated CPU devices, and the XLA
flags set on GPUs."""

import json
import os
import subprocess
import sys

import pytest

from light_jax import xla_flags
from tests.helpers import ROOT


def test_gpu_xla_flags_yield_to_the_users_own():
  user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
  merged = xla_flags.merged(user, xla_flags.GPU_FLAGS)
  assert merged.startswith(user) and merged.count("latency_hiding") == 1
  assert f"--xla_gpu_all_reduce_combine_threshold_bytes={25 * 2**20}" in merged
  env = {"XLA_FLAGS": "", "LIGHT_JAX_XLA_FLAGS": "0"}
  xla_flags.apply(env)
  assert env["XLA_FLAGS"] == ""


@pytest.mark.slow  # the whole prepared GPU check at toy size, ~1 min
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
  throughput = summary["throughput"]["float32@32"]  # benchmarks/throughput.py's JSON line
  assert throughput["step_seconds"] > 0 and throughput["compile_seconds"] > 0 and throughput["devices"] == 2
  assert abs(throughput["images_per_sec"] * throughput["step_seconds"] - 8) < 1e-6  # per device
  assert throughput["peak_memory_bytes_per_device"] > 0
  steps = {s["step"]: s for s in summary["steps"]}
  assert steps["collectives"]["result"] and steps["input_pipeline"]["result"]
  update = steps["update_step"]["result"]
  assert update["lars_fused"]["seconds"] > 0 and update["sharded_lars"]["seconds"] > 0  # 2 CPU devices
  assert json.loads(result.stdout.strip().splitlines()[-1])["failed"] == []
