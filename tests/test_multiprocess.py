"""Two real processes (2 x 4 CPU devices, jax.distributed over gloo on 127.0.0.1) train like one process with 8."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.pop("XLA_FLAGS", None)
  return env


def _run(num_processes, out, strategy):
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, WORKER, "--num_processes", str(num_processes), "--process_id", str(i),
                             "--port", str(port), "--strategy", strategy, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), text=True)
           for i in range(num_processes)]
  outputs = []
  for p in procs:
    try:
      outputs.append(p.communicate(timeout=300)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("multi-process run timed out")
  for p, text in zip(procs, outputs):
    assert p.returncode == 0, text[-3000:]
  return dict(np.load(out))


@pytest.mark.parametrize("strategy", ["hierarchical", "dense", "hitopk"])
def test_two_processes_match_one_process(tmp_path, strategy):
  single = _run(1, tmp_path / "one.npz", strategy)
  multi = _run(2, tmp_path / "two.npz", strategy)
  assert single.keys() == multi.keys() and len(single) > 10
  residuals = [k for k in single if k.startswith("residual/")]
  assert bool(residuals) == (strategy == "hitopk")
  assert all(single[key].shape[:2] == (2, 4) for key in residuals)
  # Some buckets stay exactly zero: behind a zero-initialised BatchNorm scale that top-k has not sent
  # yet, a residual branch has no gradient at all. Others must carry what top-k held back.
  assert not residuals or any(np.abs(single[key]).max() > 0 for key in residuals)
  for key in single:
    np.testing.assert_allclose(multi[key], single[key], atol=1e-5, rtol=1e-5, err_msg=key)
  assert np.isfinite(single["__loss"]).all()


def _train_py(workdir, extra, port=None, process_id=None):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  args = [sys.executable, "train.py", "--config", "configs/fashion_mnist.py", "--workdir", str(workdir),
          "--config.data.train_subset=1024", "--config.data.eval_subset=500", "--config.max_steps=6",
          "--config.global_batch_size=128", "--config.data.eval_batch_size=96", *extra]
  if port is not None:
    args += [f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={process_id}"]
  return subprocess.Popen(args, cwd=root, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_train_py_on_two_processes_matches_one_process(tmp_path):
  """The CLI path: train.py --coordinator/--num_processes/--process_id, each process one node."""
  import json

  port = _free_port()
  procs = [_train_py(tmp_path / "two", ["--config.mesh.nodes=-1", "--config.mesh.local=-1"], port, i) for i in range(2)]
  procs.append(_train_py(tmp_path / "one", []))
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == 0, text[-3000:]
  assert "process 0 of 2, 8 devices (4 local)" in outputs[0]
  assert "mesh node x local = 2 x 4 (8 cpu devices, 2 process(es))" in outputs[0]
  two = json.loads((tmp_path / "two" / "metrics.jsonl").read_text())
  one = json.loads((tmp_path / "one" / "metrics.jsonl").read_text())
  assert not (tmp_path / "two" / "metrics.jsonl").read_text().count("\n") > 1
  for key in ("train_loss", "eval_top1", "eval_top5", "eval_loss"):
    assert abs(two[key] - one[key]) < 1e-5, (key, two[key], one[key])
  assert two["eval_examples"] == one["eval_examples"] == 500
