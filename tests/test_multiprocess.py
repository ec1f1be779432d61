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


@pytest.mark.parametrize("strategy", ["hierarchical", "dense"])
def test_two_processes_match_one_process(tmp_path, strategy):
  single = _run(1, tmp_path / "one.npz", strategy)
  multi = _run(2, tmp_path / "two.npz", strategy)
  assert single.keys() == multi.keys() and len(single) > 10
  for key in single:
    np.testing.assert_allclose(multi[key], single[key], atol=1e-5, rtol=1e-5, err_msg=key)
  assert np.isfinite(single["__loss"]).all()
