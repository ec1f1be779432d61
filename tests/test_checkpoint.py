"""Checkpoints, exact resume and fault handling, through the real CLI in subprocesses."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 1024 images / 128 = 8 steps per epoch, 3 epochs = 24 steps; a checkpoint every 4 steps.
ARGS = ["--config", "configs/fashion_mnist.py:hitopk", "--config.data.train_subset=1024",
        "--config.data.eval_subset=256", "--config.num_epochs=3", "--config.global_batch_size=128",
        "--config.data.eval_batch_size=128", "--config.checkpoint.every_steps=4", "--config.log_every_steps=2"]


def _start(workdir, *extra):
  return subprocess.Popen([sys.executable, "train.py", "--workdir", str(workdir), *ARGS, *extra], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _run(workdir, *extra, expect=0):
  proc = _start(workdir, *extra)
  out = proc.communicate(timeout=600)[0]
  assert proc.returncode == expect, out[-4000:]
  return out


def _steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _wait_for_checkpoint(proc, workdir, at_least):
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if any(s >= at_least for s in _steps(workdir)):
      return
    time.sleep(0.05)
  pytest.fail(f"no checkpoint at step >= {at_least} appeared (exit code {proc.poll()})")


def _final_state(workdir):
  step = max(_steps(workdir))
  return step, ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))


def _records(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _assert_same_run(a, b):
  step_a, state_a = _final_state(a)
  step_b, state_b = _final_state(b)
  assert step_a == step_b == 24
  flat_a, flat_b = _flatten(state_a), _flatten(state_b)
  assert flat_a.keys() == flat_b.keys()
  for key in flat_a:   # bitwise: the CPU computation is deterministic and the data order is a function of the step
    np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)
  ra, rb = _records(a), _records(b)
  assert [r["step"] for r in rb] == [r["step"] for r in ra] == [8, 16, 24]   # no duplicates, none missing
  for x, y in zip(ra, rb):
    for key in ("train_loss", "eval_top1", "eval_top5", "eval_loss"):
      assert x[key] == y[key], (x["step"], key, x[key], y[key])


def _flatten(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _run(workdir)
  return workdir


def test_kill9_at_a_random_step_then_resume_gives_the_same_run(uninterrupted, tmp_path):
  kill_after = random.Random().choice([4, 8, 12, 16])
  proc = _start(tmp_path)
  _wait_for_checkpoint(proc, tmp_path, kill_after)
  proc.kill()
  proc.wait()
  out = _run(tmp_path)
  assert "resumed from the checkpoint at step" in out
  _assert_same_run(uninterrupted, tmp_path)


def test_sigterm_saves_and_exits_zero_then_resumes(uninterrupted, tmp_path):
  proc = _start(tmp_path)
  _wait_for_checkpoint(proc, tmp_path, 4)
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  if "preempted after step" in out:          # (the run may have finished before the signal landed)
    assert "received SIGTERM" in out
    stopped = int(out.split("preempted after step ")[1].split(":")[0])
    assert stopped in _steps(tmp_path)        # saved exactly where it stopped
  _run(tmp_path)
  _assert_same_run(uninterrupted, tmp_path)


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(uninterrupted, tmp_path):
  _run(tmp_path, "--config.max_steps=12")
  assert _steps(tmp_path)[-1] == 12
  state_dir = os.path.join(tmp_path, "checkpoints", "12", "state")
  for root, _, files in os.walk(state_dir):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  out = _run(tmp_path)
  assert "checkpoint at step 12" in out and "cannot be restored" in out and "falling back" in out
  assert "resumed from the checkpoint at step 8" in out
  _assert_same_run(uninterrupted, tmp_path)


def test_incompatible_config_is_refused(tmp_path):
  _run(tmp_path, "--config.max_steps=4")
  out = _run(tmp_path, "--config.model.width=16", expect=2)
  assert "error: the checkpoint at step 4" in out and "model.width: 0 -> 16" in out and "Traceback" not in out


def test_nan_skip_policy_skips_the_step_and_goes_on(tmp_path):
  _run(tmp_path, "--config.train.inject_nan_at_step=5", "--config.max_steps=10")
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["nonfinite_steps"] == 1 and summary["steps"] == 10
  assert np.isfinite(summary["final_train_loss"])   # the skipped step's NaN loss is left out of the mean
  assert summary["final_eval_top1"] > 0.1


def test_nan_stop_policy_saves_and_stops(tmp_path):
  out = _run(tmp_path, "--config.train.inject_nan_at_step=5", "--config.train.on_nonfinite=stop", expect=3)
  assert "stopped: non-finite loss or gradient" in out
  stopped = _steps(tmp_path)[-1]
  assert 6 <= stopped <= 8                       # noticed at the next log point (every 2 steps)
  _, state = _final_state(tmp_path)
  assert int(state["nonfinite_steps"]) == 1
  assert all(np.isfinite(v).all() for v in _flatten(state["params"]).values())
