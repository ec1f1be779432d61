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


def test_cpu_collectives_wait_ten_minutes_unless_the_user_says_otherwise():
  env = {}
  xla_flags.apply(env)
  assert "--xla_cpu_collective_call_terminate_timeout_seconds=600" in env["XLA_FLAGS"].split()
  env = {"XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
  xla_flags.apply(env)
  assert env["XLA_FLAGS"].split() == ["--xla_cpu_collective_call_terminate_timeout_seconds=5"]


LATE_DEVICE = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from light_jax import xla_flags
xla_flags.apply()
jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((8,), ("d",))

def late(x):  # device 3 reaches the all-reduce 65 s after the others
  if int(np.asarray(x).ravel()[0]) == 3:
    time.sleep(65)
  return x

def f(x):
  return jax.lax.psum(jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), x), "d")

x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
print("sum", float(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))(x)[0]))
"""


@pytest.mark.slow  # ~70 s: without the flag XLA aborts the process after 60 s (20 s warning + 40 s)
def test_a_device_thread_late_by_a_minute_does_not_abort_the_process():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIGHT_JAX_XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  result = subprocess.run([sys.executable, "-c", LATE_DEVICE], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
  assert result.returncode == 0 and "sum 28.0" in result.stdout, result.stderr[-3000:]


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
  links = steps["calibrate_links"]["result"]  # the top-k rate, written where train.py's comm.cost_model reads it
  assert summary["topk_elements_per_sec"] == links["topk_elements_per_sec"] > 0
  assert json.loads((out / "links.json").read_text())["topk_elements_per_sec"] == links["topk_elements_per_sec"]
  assert json.loads(result.stdout.strip().splitlines()[-1])["failed"] == []
