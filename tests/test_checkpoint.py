"""Checkpoints, exact resume and fault handling.

Runs are in-process (``train_and_evaluate``) except where a real process is the point: ``kill -9`` and
the exit codes of ``train.py``. A resumed run must end bitwise equal to an uninterrupted one.
"""

import contextlib
import io
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import fashion_mnist
from light_jax import checkpoint as checkpoint_lib
from light_jax import data as data_lib
from light_jax import hooks, liveness, stderr_redirect, train_lib
from light_jax.checkpoint import CheckpointError
from light_jax.config import base_config
from light_jax.exit_codes import ExitCode
from light_jax.hooks import PREEMPTED
from light_jax.metrics import read_metrics
from tests.helpers import fill_disk, small_config, tmpfs, train_py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 1024 images / 128 = 8 steps per epoch, 3 epochs = 24 steps; a checkpoint every 4 steps.
FIELDS = dict(
  data__train_subset=1024,
  data__eval_subset=256,
  num_epochs=3,
  global_batch_size=128,
  data__eval_batch_size=128,
  checkpoint__every_steps=4,
  log_every_steps=2,
)
# The kill step is drawn once per seed (override with KILL_SEED=n to try others), so a failure reproduces.
KILL_SEED = int(os.environ.get("KILL_SEED", "0"))
KILL_AFTER = random.Random(KILL_SEED).choice([4, 8, 12])  # >= 12 steps and 2 evaluations left to reach it


def _config(**fields):
  return small_config("hitopk", **{**FIELDS, **fields})


def _train_py(workdir, **fields):
  """The train.py command line of ``_config(**fields)``: the fields that differ from fashion_mnist.py:hitopk."""
  default, config = fashion_mnist.get_config("hitopk"), _config(**fields)
  overrides = [
    f"--config.{section}.{key}={value}" if key else f"--config.{section}={value}"
    for section, key, value in _differences(default, config)
  ]
  return [
    sys.executable,
    "train.py",
    "--config",
    "configs/fashion_mnist.py:hitopk",
    "--workdir",
    str(workdir),
    *overrides,
  ]


def _differences(default, config):
  for section, value in config.items():
    if hasattr(value, "items"):
      yield from ((section, k, v) for k, v in value.items() if default[section][k] != v)
    elif default[section] != value:
      yield section, None, value


def _run_cli(workdir, expect, **fields):
  result = train_py(*_train_py(workdir, **fields)[2:])
  assert result.returncode == expect, result.stderr[-4000:]
  return result.stderr


def _steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _final_state(workdir):
  step = max(_steps(workdir))
  return step, ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))


def _flatten(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same_run(a, b):
  step_a, state_a = _final_state(a)
  step_b, state_b = _final_state(b)
  assert step_a == step_b == 24
  flat_a, flat_b = _flatten(state_a), _flatten(state_b)
  assert flat_a.keys() == flat_b.keys()
  for key in flat_a:  # bitwise: the CPU computation is deterministic and the data order is a function of the step
    np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)
  ra, rb = read_metrics(a), read_metrics(b)
  assert [r["step"] for r in rb] == [r["step"] for r in ra] == [8, 16, 24]  # no duplicates, none missing
  for x, y in zip(ra, rb):
    for key in ("train_loss", "eval_top1", "eval_top5", "eval_loss"):
      assert x[key] == y[key], (x["step"], key, x[key], y[key])


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
  """(workdir, summary) of the whole run, the reference of the resumed ones; stopped at its last step as a SIGTERM
  there would stop the loop, which must still finish the run (test_a_signal_at_the_last_step_finishes_the_run)."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  last = (lambda info: PREEMPTED if info.step == 24 else None, 1)
  return workdir, train_lib.train_and_evaluate(_config(), str(workdir), extra_hooks=[last])


@pytest.fixture(scope="module")
def uninterrupted(whole_run):
  return whole_run[0]


def _copy_of(run, tmp_path):
  """``run``'s workdir copied into ``tmp_path`` (a test's own, to resume or damage)."""
  shutil.copytree(run, tmp_path, dirs_exist_ok=True)
  return tmp_path


def test_kill9_after_a_checkpoint_then_resume_gives_the_same_run(uninterrupted, tmp_path, caplog):
  proc = subprocess.Popen(
    _train_py(tmp_path),
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + 300
  while not any(s >= KILL_AFTER for s in _steps(tmp_path)):
    assert proc.poll() is None and time.time() < deadline, f"no checkpoint at step >= {KILL_AFTER} appeared"
    time.sleep(0.05)
  proc.kill()
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL  # killed, not finished: there is something to resume
  newest = max(_steps(tmp_path))
  with caplog.at_level(logging.INFO):
    summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  # From the newest checkpoint (a run started over, or from an older one, would end the same on CPU).
  assert summary["resumed_from_step"] == newest
  assert f"resumed from the checkpoint at step {newest} " in caplog.text
  _assert_same_run(uninterrupted, tmp_path)


def test_sigterm_saves_at_that_step_and_the_run_resumes_the_same(uninterrupted, tmp_path, caplog):
  def send_sigterm(info):
    if info.step == 6:
      os.kill(os.getpid(), signal.SIGTERM)  # caught by the trainer's PreemptionGuard

  with caplog.at_level(logging.WARNING):
    stopped = train_lib.train_and_evaluate(_config(), str(tmp_path), extra_hooks=[(send_sigterm, 1)])
  assert stopped == {"stopped": "preempted", "steps": 6}
  assert "received SIGTERM" in caplog.text
  assert _steps(tmp_path) == [4, 6]  # the periodic save and the one where it stopped
  meta_file = tmp_path / "checkpoints" / "6" / "meta" / "metadata"  # orbax JsonSave
  with open(meta_file) as f:
    seconds_at_6 = json.load(f)["train_seconds"]
  summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert summary["resumed_from_step"] == 6  # not started over (which would end the same on CPU)
  _assert_same_run(uninterrupted, tmp_path)
  # TensorBoard is written again from the records kept, every earlier event hidden (a SessionLog START at step 0):
  # it drew both runs' points after the checkpoint, and a killed run's last events may never have been written.
  events = list(_tensorboard_events(tmp_path))
  last_start = max(i for i, e in enumerate(events) if e.HasField("session_log") and e.session_log.status == 1)
  assert events[last_start].step == 0
  shown = {(v.tag, e.step): v.simple_value for e in events[last_start:] for v in e.summary.value}  # float32
  records = {
    (key, r["step"]): float(value)
    for r in read_metrics(tmp_path)
    for key, value in r.items()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
  }
  assert shown.keys() == records.keys()
  for key, value in records.items():
    assert shown[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
  # The clock goes on from the checkpoint's: the first record after the resume (step 8) counts steps 0-8.
  seconds = [r["train_seconds"] for r in read_metrics(tmp_path)]
  assert 0 < seconds_at_6 < seconds[0] < seconds[1] < seconds[2]


def _input_failing_at(batch):
  """Reading the ``batch``-th batch (counted from 0) of the next runs raises a DataError (a damaged record, say)."""
  next_batch, batches = data_lib.DevicePrefetcher.__next__, itertools.count()

  def damaged(self):
    if next(batches) == batch:
      raise data_lib.DataError("shard 3 is damaged")
    return next_batch(self)

  return _patched(data_lib.DevicePrefetcher, "__next__", damaged)


def _patched(owner, name, replacement):
  """``owner.name`` replaced by ``replacement`` until the returned context ends (several runs inside one test)."""
  patched = pytest.MonkeyPatch()
  patched.setattr(owner, name, replacement)
  return contextlib.closing(types.SimpleNamespace(close=patched.undo))


def test_an_input_that_fails_mid_run_saves_the_steps_done_and_the_run_resumes_the_same(uninterrupted, tmp_path):
  """The 7th batch cannot be read: the 6 steps done (2 since the checkpoint at 4) are saved before the error, which
  says so. Rerun before the input is mended, the first batch fails: the error again, nothing saved, no summary.
  Rerun once mended, the run ends as the uninterrupted one."""
  with _input_failing_at(6), pytest.raises(data_lib.DataError, match=r"^shard 3 is damaged \(the run's 6 steps are"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert _steps(tmp_path) == [4, 6]
  with _input_failing_at(0), pytest.raises(data_lib.DataError, match=r"^shard 3 is damaged$"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert _steps(tmp_path) == [4, 6] and not (tmp_path / "summary.json").exists()
  summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert summary["resumed_from_step"] == 6
  _assert_same_run(uninterrupted, tmp_path)


def test_an_input_that_fails_after_an_unreported_non_finite_step_stops_as_non_finite(tmp_path):
  """Step 5 is bad, checked at step 8 (the log step) at the earliest; the input fails after step 6. The save then
  holds the bad step, so it is reported first: exit 3's error, not the input's (a resumed run would count it seen)."""
  config = _config(train__inject_nan_at_step=5, train__on_nonfinite="stop", log_every_steps=8)
  with _input_failing_at(6), pytest.raises(train_lib.NonFiniteError, match="at or before step 6.* also failed"):
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert _steps(tmp_path) == [4, 6]


def _tensorboard_events(workdir):
  """Every event of the run's TensorBoard files (TFRecord: length, its CRC, the event, its CRC)."""
  import struct

  from tensorboardX.proto import event_pb2

  for path in sorted((workdir / "tensorboard").iterdir()):
    data, at = path.read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[at + 12 : at + 12 + length])
      yield event
      at += 12 + length + 4


def test_a_signal_at_the_last_step_finishes_the_run(whole_run):
  """The run is complete: a summary, not "preempted, rerun to resume" (whose rerun only evaluated again). The
  fixture's run was stopped so at step 24; the resumed runs of the tests above end equal to it."""
  workdir, summary = whole_run  # what train.py reads to say "preempted" or not
  assert summary["steps"] == 24 and "stopped" not in summary
  assert json.loads((workdir / "summary.json").read_text())["steps"] == 24 and read_metrics(workdir)[-1]["final"]


def _garble(workdir, step):
  """Overwrites every file of the checkpoint at ``step`` in ``workdir``: it is finished, and cannot be restored."""
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints", str(step), "state")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(uninterrupted, tmp_path, caplog):
  """The finished run's newest checkpoint garbled: the rerun resumes from the one before, trains the last steps
  again, saves over the damaged one, and ends the same."""
  _copy_of(uninterrupted, tmp_path)
  _garble(tmp_path, 24)
  with caplog.at_level(logging.INFO):
    summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert "checkpoint at step 24" in caplog.text and "cannot be restored" in caplog.text
  assert "falling back" in caplog.text and "resumed from the checkpoint at step 20" in caplog.text
  assert summary["resumed_from_step"] == 20
  _assert_same_run(uninterrupted, tmp_path)


def test_a_damaged_checkpoint_is_replaced_when_the_resumed_run_saves_at_its_step(tmp_path):
  state, meta = {"w": jax.numpy.arange(4.0)}, {"config": {}}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  for step in (1, 2):
    checkpointer.save(step, jax.tree.map(lambda x: x + step, state), meta)
  checkpointer.close()
  _garble(tmp_path, 2)
  abstract = checkpoint_lib.abstract(state)
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  assert checkpointer.restore_latest(abstract, {})[0] == 1  # falls back past the damaged step 2
  assert checkpointer.save(2, jax.tree.map(lambda x: x + 20, state), meta)  # replaces it instead of skipping
  checkpointer.close()
  step, restored, _ = checkpoint_lib.Checkpointer(str(tmp_path), keep=3).restore_latest(abstract, {})
  assert step == 2 and np.array_equal(restored["w"], np.arange(4.0) + 20)


def test_a_damaged_checkpoint_that_keep_removed_since_is_not_deleted_again(tmp_path):
  """orbax's checkpoint.keep removes the oldest saved, not the lowest step: a resumed run that saves more often
  (checkpoint.every_steps may change) drops the damaged step before it reaches that step again."""
  state, meta = {"w": jax.numpy.arange(4.0)}, {"config": {}}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=2)
  for step in (10, 20):
    checkpointer.save(step, state, meta)
  checkpointer.close()
  _garble(tmp_path, 20)
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=2)
  assert checkpointer.restore_latest(checkpoint_lib.abstract(state), {})[0] == 10
  for step in (12, 14):
    checkpointer.save(step, state, meta)
  assert 20 not in checkpointer.manager.all_steps()  # removed by keep=2
  assert checkpointer.save(20, jax.tree.map(lambda x: x + 20, state), meta)
  checkpointer.close()
  step, restored, _ = checkpoint_lib.Checkpointer(str(tmp_path), keep=2).restore_latest(
    checkpoint_lib.abstract(state), {}
  )
  assert step == 20 and np.array_equal(restored["w"], np.arange(4.0) + 20)


def test_saving_replicated_arrays_compiles_nothing_and_restores_them(tmp_path):
  """Each array is written whole by one replica: orbax's replica-parallel saving (its CPU default) would trace
  and compile a slicing program per shape here (shapes new to this process, so no cache hides one)."""
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # Each shape new to this process, each with a dimension that 8 replicas could split
  state = {f"w{i}": jax.device_put(np.full((8 * (3 + i), 13), float(i), np.float32), replicated) for i in range(3)}
  traced = []

  def listen(event, seconds, **kwargs):
    if event == "/jax/core/compile/jaxpr_trace_duration":
      traced.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=1)
    checkpointer.save(1, state, {"config": {}})
    checkpointer.close()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert traced == []
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=1)
  step, restored, _ = checkpointer.restore_latest(checkpoint_lib.abstract(state), {})
  checkpointer.close()
  assert step == 1 and all(np.array_equal(restored[k], state[k]) for k in state)
  assert restored["w2"].sharding.is_fully_replicated


def test_a_failed_restore_keeps_its_log_records_and_drops_the_rest_of_its_output(capfd):
  # What orbax's in-flight TensorStore reads print from other threads once a restore has failed: raw writes to
  # the file descriptor, not through Python's sys.stderr.
  noise = "Traceback (most recent call last):\n  File ...\nRuntimeError: Event loop is closed\n"
  late = threading.Timer(
    0.1, os.write, (2, (noise * 3 + "W1206 04:15:02.8 1 checkpoint.py:1] a log record\n").encode())
  )
  with pytest.raises(ValueError, match="DATA_LOSS"), checkpoint_lib._quiet_if_it_fails(settle_seconds=0.5):
    os.write(2, b"while it runs, stderr is untouched\n")
    late.start()
    raise ValueError("DATA_LOSS: damaged")
  err = capfd.readouterr().err
  assert "Traceback" not in err and "a log record" in err and "while it runs, stderr is untouched" in err
  assert "the failed restore printed 9 lines of orbax/TensorStore output, left out" in err
  with checkpoint_lib._quiet_if_it_fails():  # a restore that works passes everything on
    os.write(2, noise.encode())
  assert capfd.readouterr().err == noise


def test_a_stop_reported_during_a_failed_restores_capture_reaches_stderr(capfd, monkeypatch):
  """The watchdog ends its process with os._exit right after its report: the capture would never be read."""
  # sys.stderr writing to file descriptor 2, as in a process of its own (pytest's writes past it)
  monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True))
  during = []

  def report_during_the_capture():
    deadline = time.monotonic() + 10
    while not stderr_redirect.is_redirected() and time.monotonic() < deadline:
      time.sleep(0.01)
    during.append(stderr_redirect.is_redirected())
    liveness.report_stop(1, 2, "process 0 has given no sign of life", "/w")

  report = threading.Thread(target=report_during_the_capture)
  with pytest.raises(ValueError, match="DATA_LOSS"), checkpoint_lib._quiet_if_it_fails(settle_seconds=1.0):
    report.start()
    raise ValueError("DATA_LOSS: damaged")
  report.join()
  lines = capfd.readouterr().err.splitlines()
  stop = "error: stopping process 1 of 2: process 0 has given no sign of life. Committed checkpoints in /w/"
  assert during == [True] and any(line.startswith(stop) for line in lines)
  assert not stderr_redirect.is_redirected()  # the capture is over


def test_a_failed_restore_raises_its_own_error_whatever_the_capture_meets(monkeypatch):
  start = time.perf_counter()
  with pytest.raises(KeyboardInterrupt), checkpoint_lib._quiet_if_it_fails(settle_seconds=5):
    raise KeyboardInterrupt  # Ctrl-C is not captured, nor waited on
  assert time.perf_counter() - start < 1
  monkeypatch.setattr(checkpoint_lib.tempfile, "tempdir", "/proc/light_jax_nope")  # no file for the capture
  with pytest.raises(ValueError, match="DATA_LOSS"), checkpoint_lib._quiet_if_it_fails(settle_seconds=0.0):
    raise ValueError("DATA_LOSS: damaged")


def test_a_checkpoint_from_another_mesh_is_refused_and_not_called_damaged(tmp_path):
  # mesh.nodes/local=-1 resolve from the processes and devices, so the same config can meet another mesh
  state = {"w": jax.numpy.arange(4.0)}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  checkpointer.save(3, state, {"config": {}, "mesh": [2, 4]})
  checkpointer.close()
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  with pytest.raises(CheckpointError, match=r"step 3 .* nodes x local = 2 x 4; this run's mesh is 4 x 2.*nodes=2"):
    checkpointer.restore_latest(checkpoint_lib.abstract(state), {}, [4, 2])
  assert checkpointer.damaged_steps == set()
  assert checkpointer.restore_latest(checkpoint_lib.abstract(state), {}, [2, 4])[0] == 3


def test_a_checkpoint_with_other_communication_buckets_is_refused_and_not_called_damaged(tmp_path):
  # auto and adaptive fusion plan the buckets, and so the reducer state's shapes, from the cost model's file
  state = {"w": jax.numpy.arange(4.0)}
  saved = {"['bucket_0']": [2, 4, 1000], "['bucket_1']": [2, 4, 24]}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  checkpointer.save(3, state, {"config": {}, "mesh": [2, 4], "comm_state_shapes": saved})
  checkpointer.close()
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  now = {"['bucket_0']": [2, 4, 1024]}
  with pytest.raises(
    CheckpointError, match=r"other communication buckets: the reducer's state differs in \['bucket_0'"
  ):
    checkpointer.restore_latest(checkpoint_lib.abstract(state), {}, [2, 4], comm_state_shapes=now)
  assert checkpointer.damaged_steps == set()
  assert checkpointer.restore_latest(checkpoint_lib.abstract(state), {}, [2, 4], comm_state_shapes=saved)[0] == 3


def test_incompatible_config_is_refused_with_exit_code_2(uninterrupted, tmp_path):
  err = _run_cli(_copy_of(uninterrupted, tmp_path), ExitCode.BAD_INPUT, model__width=16)
  assert "error: the checkpoint at step 24" in err and "model.width: 8 -> 16" in err and "Traceback" not in err


def test_a_run_resumes_with_more_micro_batches(uninterrupted, tmp_path, caplog):
  """A step a device cannot hold is told to rerun with more micro_batches (train.py's out-of-memory line): the
  checkpoint takes them, and the run goes on in slices."""
  workdir = _copy_of(uninterrupted, tmp_path)
  with caplog.at_level(logging.INFO):
    summary = train_lib.train_and_evaluate(_config(micro_batches=2, num_epochs=4), str(workdir))
  assert "micro_batches: 1 -> 2" in caplog.text and "resumed from the checkpoint at step 24" in caplog.text
  assert summary["steps"] == 32 and max(_steps(workdir)) == 32


def test_the_mesh_fields_as_written_may_change_where_they_give_the_same_mesh():
  """A 2-process run (mesh.nodes=mesh.local=-1, 2 x 4) resumed by one process of 8 devices with nodes=2, local=4:
  the mesh is the same, so the fields are no reason to refuse (the mesh itself is checked: the test above)."""
  saved, current = base_config().to_dict(), base_config().to_dict()
  saved["mesh"].update(nodes=-1, local=-1)
  current["mesh"].update(nodes=2, local=4)
  breaking, safe = checkpoint_lib.config_changes(saved, current)
  assert breaking == [] and safe == ["mesh.local: -1 -> 4", "mesh.nodes: -1 -> 2"]


def test_a_field_added_since_the_checkpoint_is_accepted_at_its_default_only():
  saved = base_config().to_dict()
  del saved["comm"]["k_allocation"]  # a checkpoint written before the field existed
  current = base_config().to_dict()
  breaking, safe = checkpoint_lib.config_changes(saved, current)
  assert breaking == [] and safe == [
    "comm.k_allocation: not in the checkpoint's config (added since), at its default 'proportional'"
  ]
  current["comm"]["k_allocation"] = "sqrt"
  breaking, _ = checkpoint_lib.config_changes(saved, current)
  assert breaking == [
    "comm.k_allocation: not in the checkpoint's config (added since, so the run used its default "
    "'proportional') -> 'sqrt'"
  ]


def test_nan_skip_policy_skips_the_step_and_goes_on(tmp_path):
  # max_steps=8, an epoch's end: the program of the full run with that NaN, which the next tests compile too.
  summary = train_lib.train_and_evaluate(_config(train__inject_nan_at_step=5, max_steps=8), str(tmp_path))
  assert summary["nonfinite_steps"] == 1 and summary["steps"] == 8
  assert np.isfinite(summary["final_train_loss"])  # the skipped step's NaN loss is left out of the epoch's mean
  step, state = _final_state(tmp_path)
  assert step == 8 and all(np.all(np.isfinite(v)) for v in _flatten(state).values())  # nothing poisoned kept


def test_a_signal_before_the_next_check_still_reports_a_non_finite_step(tmp_path):
  """on_nonfinite=stop with the bad step (5) not yet checked (every 4 steps) when a SIGTERM stops the run at step
  7: it stops as non-finite, not as preempted, else the resumed run would count the step as seen and go on."""

  def send_sigterm(info):
    if info.step == 7:
      os.kill(os.getpid(), signal.SIGTERM)

  config = _config(train__inject_nan_at_step=5, train__on_nonfinite="stop", log_every_steps=4)
  with pytest.raises(train_lib.NonFiniteError):
    train_lib.train_and_evaluate(config, str(tmp_path), extra_hooks=[(send_sigterm, 1)])
  assert _steps(tmp_path)[-1] == 7


def test_a_signal_just_after_the_non_finite_checks_turn_still_reports_a_non_finite_step(tmp_path, monkeypatch):
  """As above, but the SIGTERM comes at step 7 after the non-finite check's turn was decided (not due) and before
  the preemption check reads it: microseconds in a run, made certain here."""
  check = hooks.PreemptionCheck.__call__

  def signalled_first(self, info):
    if info.step == 7:
      os.kill(os.getpid(), signal.SIGTERM)
    return check(self, info)

  monkeypatch.setattr(hooks.PreemptionCheck, "__call__", signalled_first)
  config = _config(train__inject_nan_at_step=5, train__on_nonfinite="stop", log_every_steps=4)
  with pytest.raises(train_lib.NonFiniteError):
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert _steps(tmp_path)[-1] == 7


@pytest.mark.parametrize("stop_at,reason", [(7, "halt"), (8, PREEMPTED)])
def test_an_extra_hooks_stop_still_reports_a_non_finite_step(tmp_path, stop_at, reason):
  """An extra hook (run first, its reason outranking the trainer's) stops the run after the bad step 5: at step 7,
  where the non-finite check is not due, or at the log step 8, where its reason outranks the check's. Either way
  the run stops as non-finite: the checkpoint counts the step as seen, and a resumed run would never report it."""
  config = _config(train__inject_nan_at_step=5, train__on_nonfinite="stop", log_every_steps=4)
  with pytest.raises(train_lib.NonFiniteError):
    train_lib.train_and_evaluate(
      config, str(tmp_path), extra_hooks=[(lambda info: reason if info.step == stop_at else None, 1)]
    )
  assert _steps(tmp_path)[-1] == stop_at


def test_nan_stop_policy_saves_and_stops_with_exit_code_3(tmp_path):
  """Step 5 is bad; checkpoints every 6 steps, logs every 8. The check also runs at each checkpoint step, so the
  run stops at 6: a checkpoint never holds an unreported bad step (before, the run saved step 6 and went on to
  the log step 8; killed in between, it resumed counting step 5 as seen and never stopped)."""
  err = _run_cli(
    tmp_path,
    ExitCode.NONFINITE_STOP,
    train__inject_nan_at_step=5,
    train__on_nonfinite="stop",
    log_every_steps=8,
    checkpoint__every_steps=6,
  )
  assert "stopped: non-finite loss or gradient" in err
  assert _steps(tmp_path)[-1] == 6
  _, state = _final_state(tmp_path)
  assert int(state["nonfinite_steps"]) == 1
  assert all(np.isfinite(v).all() for v in _flatten(state["params"]).values())
  assert not (tmp_path / "summary.json").exists()  # a stopped run has no summary


def test_a_checkpoint_of_a_newer_state_layout_is_refused_in_one_line(tmp_path):
  """A downgrade: a checkpoint a later light_jax wrote, whose arrays may have this version's shapes and another
  meaning, restored as this version's state without a word."""
  from light_jax import train_step as step_lib

  state = {"w": jax.numpy.arange(4.0)}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=1)
  checkpointer.save(4, state, {"config": {}, "state_layout": step_lib.STATE_LAYOUT + 1})
  checkpointer.close()
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=1)
  with pytest.raises(CheckpointError, match=r"at step 4 in .* was written by a newer light_jax \(train state layout "):
    checkpointer.restore_latest(checkpoint_lib.abstract(state), {}, restore_target=step_lib.restore_target)
  checkpointer.close()


def test_a_checkpoint_with_one_copy_of_the_batchnorm_statistics_resumes_with_a_copy_per_device(tmp_path):
  """Layout 1 (before the statistics were kept per device) replicated them: each device resumes from that copy."""
  from light_jax import optim
  from light_jax import train_step as step_lib
  from light_jax.models import create_model
  from light_jax.parallel import mesh as mesh_lib
  from light_jax.parallel import reducer as reducer_lib

  mesh = mesh_lib.make_mesh(2, 4)
  tx = optim.build_optimizer(base_config().optimizer, lambda step: 0.1)
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 2, 4)
  state = step_lib.create_train_state(create_model("resnet8_small", 10, width=4), tx, reducer, (8, 8, 1), mesh, seed=0)
  one_copy = jax.tree.map(lambda x: x[0, 0] + 0.5, state.batch_stats)  # as layout 1 saved them: replicated
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  checkpointer.save(3, state.replace(batch_stats=one_copy), {"config": {}, "mesh": [2, 4]})  # no state_layout
  checkpointer.close()
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  step, restored, _ = checkpointer.restore_latest(checkpoint_lib.abstract(state), {}, [2, 4], step_lib.restore_target)
  assert step == 3 and checkpointer.damaged_steps == set()
  for saved, per_device, fresh in zip(*map(jax.tree.leaves, (one_copy, restored.batch_stats, state.batch_stats))):
    assert per_device.shape == (2, 4, *saved.shape) and per_device.sharding == fresh.sharding
    np.testing.assert_array_equal(np.asarray(per_device), np.broadcast_to(np.asarray(saved), per_device.shape))


def test_checkpoints_that_cannot_restore_end_the_run_with_one_line_last(uninterrupted, tmp_path):
  """Every checkpoint's data cut short: the error is the last line, with none of the abandoned reads' tracebacks
  after it (coroutines and asyncio tasks finalized at exit printed thousands of lines there)."""
  _copy_of(uninterrupted, tmp_path)
  for root, _, files in os.walk(tmp_path / "checkpoints"):
    for name in files:
      if root.endswith(os.path.join("ocdbt.process_0", "d")):  # the arrays' data, not the metadata: reads fail
        os.truncate(os.path.join(root, name), 10)
  result = train_py(*_train_py(tmp_path)[2:])
  assert result.returncode == 2, result.stderr[-2000:]
  last = result.stderr.rstrip().splitlines()[-1]
  assert last.startswith("error: none of the checkpoints in") and "(steps [24, 20, 16])" in last, result.stderr[-3000:]
  assert "TensorStore details" not in last
  for noise in ("Exception ignored", "never retrieved", "never awaited"):
    assert noise not in result.stderr, noise
  # The run's log and a few tracebacks TensorStore's threads print while a restore fails; it was 10,000 lines.
  assert len(result.stderr.splitlines()) < 1000


def test_a_signal_in_set_up_whose_raise_a_library_swallowed_stops_set_up_at_the_next_stage():
  """asyncio logs and drops an exception raised in its callbacks (orbax's restore runs some): the signal is still
  noted, and set-up stops at its next stage, at the latest when the guard is armed for the first step."""
  from light_jax.preemption import PreemptionGuard, StoppedInSetup

  with PreemptionGuard() as guard:
    with contextlib.suppress(StoppedInSetup):  # the library that swallowed it
      os.kill(os.getpid(), signal.SIGTERM)
    assert guard.signal == signal.SIGTERM and not guard.armed
    with pytest.raises(StoppedInSetup):
      guard.check_set_up()
    with pytest.raises(StoppedInSetup):
      guard.arm()


def test_a_signal_in_set_up_that_a_library_made_an_error_of_its_own_of_is_still_a_stop():
  """The guard's raise can land inside a library that makes another error of it (numpy's C code, called back
  into Python: "SystemError: ... returned a result with an exception set", exit 1 with a traceback). The guard
  saw the signal in set-up: what leaves it is the stop."""
  from light_jax.preemption import PreemptionGuard, StoppedInSetup

  with pytest.raises(StoppedInSetup) as stopped, PreemptionGuard():
    try:
      os.kill(os.getpid(), signal.SIGTERM)
    except StoppedInSetup as stop:
      raise SystemError("<function __numpy_dtype__> returned a result with an exception set") from stop
  assert str(stopped.value) == "SIGTERM" and isinstance(stopped.value.__cause__, SystemError)
  with pytest.raises(ValueError), PreemptionGuard():  # no signal: an error stays what it is
    raise ValueError("a bug")


def test_a_stop_raised_where_python_cannot_raise_is_not_printed_and_set_up_still_stops():
  """A stop's raise that lands in a callback Python cannot raise from (JAX's garbage-collection callback, a
  __del__) printed "Exception ignored in: ..." with a traceback, and set-up went on; it stops at the next check.
  In a process of its own: pytest takes such exceptions as warnings."""
  code = """
import os, signal
from light_jax.preemption import PreemptionGuard, StoppedInSetup

class SignalledWhenFreed:
  def __del__(self):
    os.kill(os.getpid(), signal.SIGTERM)
    (lambda: None)()  # a Python call: the handler runs here at the latest, and raises inside __del__

with PreemptionGuard() as guard:
  SignalledWhenFreed()
  assert guard.signal == signal.SIGTERM
  try:
    guard.check_set_up()
  except StoppedInSetup:
    print("stopped at the check")
"""
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert result.stdout == "stopped at the check\n", result.stderr[-3000:]
  assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


# Runs train.py with a SIGTERM sent as the function its first argument names is entered inside the trainer (a
# profile hook until then: the signal comes where the test means it to, not wherever a loaded machine has got to).
_SIGNAL_AT = """
import os, runpy, signal, sys
target = sys.argv.pop(1)
def at_target(frame, event, arg):
  if event == "call" and frame.f_code.co_qualname == target:
    sys.setprofile(None)
    os.kill(os.getpid(), signal.SIGTERM)
from light_jax import train_lib
train = train_lib.train_and_evaluate
def signalled(*args, **kwargs):
  sys.setprofile(at_target)
  try:
    return train(*args, **kwargs)
  finally:
    sys.setprofile(None)
train_lib.train_and_evaluate = signalled
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def _train_py_through(runner, *args, target=None):
  """``runner`` (Python code that runs train.py; ``target``, if any, its own first argument) with train.py's
  ``args``, on fashion_mnist.py and 1,024 training images."""
  config = ["--config", "configs/fashion_mnist.py", "--config.data.train_subset=1024"]
  return subprocess.run(
    [sys.executable, "-c", runner, *([target] if target else []), *config, *args],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.parametrize(
  "where",
  [
    # Before the compiles (seconds here, minutes on a GPU): they are not waited for.
    "CompiledSteps.compile_phases",
    # Inside orbax's making of the checkpointer: the object whose __init__ it cut short printed a traceback ("Exception
    # ignored in: ... _AsyncManager.__del__") after the run's last line, and orbax's thread that removes unfinished
    # saves' folders an error ("cannot schedule new futures after interpreter shutdown"); CI saw "coroutine ... was
    # never awaited" there.
    "_AsyncManager.__init__",
    # Just after the checkpointer is made: its thread that removes unfinished saves' folders was not waited for.
    "Checkpointer.restore_latest",
  ],
)
def test_a_signal_during_set_up_stops_it_at_once_on_one_line(tmp_path, where):
  """Before the first step there is nothing to save: set-up (data, a decoded cache to build, compiling) stops at
  once, and the stop's line is the last."""
  start = time.monotonic()
  result = _train_py_through(
    _SIGNAL_AT, "--workdir", str(tmp_path / "run"), "--config.global_batch_size=128", target=where
  )
  assert result.returncode == ExitCode.OK, result.stderr[-3000:]
  assert "received SIGTERM during set-up" in result.stderr  # the signal came where the test meant it to
  assert "step compiled" not in result.stderr and time.monotonic() - start < 60, result.stderr[-3000:]
  for noise in ("Traceback", "Exception ignored", "never awaited"):
    assert noise not in result.stderr, result.stderr[-3000:]
  assert not re.search(r"^E\d{4} ", result.stderr, re.MULTILINE), result.stderr[-3000:]  # an error record
  assert result.stderr.strip().splitlines()[-1] == (
    "stopped by SIGTERM during set-up, before the first step: nothing to save; run the same command again to start "
    "(or resume) the run."
  )
  assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


# Runs train.py with a SIGTERM sent from a __del__ inside the workdir's lock, one of train.py's checks before the
# trainer: Python cannot raise there, and the guard's stop is swallowed (as JAX's gc callback swallows it).
_SWALLOWED_IN_CHECKS = """
import os, runpy, signal, sys
from light_jax import checkpoint
lock = checkpoint.lock_workdir
class SignalledWhenFreed:
  def __del__(self):
    os.kill(os.getpid(), signal.SIGTERM)
    (lambda: None)()  # the handler runs here at the latest, and raises inside __del__
def lock_and_signal(workdir):
  SignalledWhenFreed()
  lock(workdir)
checkpoint.lock_workdir = lock_and_signal
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_swallowed_signal_during_train_pys_checks_stops_before_the_data_is_loaded(tmp_path):
  """The trainer's first check comes after the data (hours building a decoded cache on ImageNet) and the restore:
  train.py checks for a stop a library swallowed as soon as its own checks are done."""
  result = _train_py_through(_SWALLOWED_IN_CHECKS, "--workdir", str(tmp_path / "run"))
  assert result.returncode == ExitCode.OK, result.stderr[-3000:]
  assert "received SIGTERM during set-up" in result.stderr and "Traceback" not in result.stderr
  assert "data fashion_mnist:" not in result.stderr, result.stderr[-3000:]  # the trainer's input was never made
  assert result.stderr.strip().splitlines()[-1].startswith("stopped by SIGTERM during set-up, before the first step")


def test_a_checkpoint_another_process_could_not_restore_is_passed_over_here_too(tmp_path, caplog):
  """This process read the newest checkpoint, process 1 did not (its shards are damaged; a real pair:
  tests/test_multiprocess.py): this one falls back too, says why, and replaces it when it saves that step."""
  state = {"w": jax.numpy.arange(1000.0)}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  for step in (4, 8):
    checkpointer.save(step, state, {"config": {}})
  checkpointer.close()
  resumed = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  agreed = iter([[], [1], [], []])  # step 8: the meta read everywhere, the state not on process 1; step 4 read
  resumed._processes_that_failed = lambda step, ok: next(agreed) if ok else pytest.fail("this process read it")
  with caplog.at_level(logging.WARNING):
    step, _, _ = resumed.restore_latest(checkpoint_lib.abstract(state), {})
  assert step == 4 and resumed.damaged_steps == {8}
  assert (
    "checkpoint at step 8 in" in caplog.text and "(it failed on process 1: see its log); falling back" in caplog.text
  )
  resumed.save(8, state, {"config": {}})
  resumed.close()
  assert "replacing the damaged checkpoint at step 8" in caplog.text


def test_the_orbax_internals_a_restore_relies_on_are_there(tmp_path):
  """A process whose read failed passes the barrier orbax's restore ends with, by the key orbax makes
  (Checkpointer._pass_the_restores_barrier): an orbax that changes them fails here, not only in a slow test."""
  import inspect

  from orbax.checkpoint._src.checkpointers.checkpointer import Checkpointer as OrbaxCheckpointer

  source = inspect.getsource(OrbaxCheckpointer.restore)
  assert "'Checkpointer:restore'" in source and "multihost.sync_global_processes(" in source
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  inner = checkpointer.manager._checkpointer
  assert isinstance(inner, OrbaxCheckpointer)
  assert hasattr(inner, "_barrier_sync_key_prefix") and hasattr(inner, "_active_processes")
  checkpointer._pass_the_restores_barrier()  # one process: no barrier
  checkpointer.close()


def test_the_orbax_wait_a_checkpointer_closes_with_is_there():
  """Checkpointer.close waits for orbax's removal of unfinished saves' folders through a private method (a run that
  ended before its first save exited under that thread): an orbax that renames it fails here, not silently."""
  assert callable(getattr(ocp.CheckpointManager, "_maybe_await_cleanup_tmp_directory", None))


def test_a_save_on_a_full_disk_is_one_error_and_the_previous_checkpoint_stays(tmp_path, capfd):
  """Orbax reported it as a thousand lines of tracebacks from its threads, and a multi-process run then waited 10
  minutes at a barrier (tests/test_multiprocess.py). Now: one CheckpointError naming the step, the reason and the
  checkpoint to resume from; close() returns at once; the unfinished save's folder goes at the next start."""
  small = {"w": jax.numpy.arange(1000.0)}
  large = {"w": jax.numpy.asarray(np.random.default_rng(0).normal(size=(512, 1024)), np.float32)}  # 2 MiB
  with tmpfs(tmp_path / "disk", "size=1m") as disk:
    checkpointer = checkpoint_lib.Checkpointer(str(disk), keep=3)
    checkpointer.save(1, small, {"config": {}})
    with pytest.raises(CheckpointError) as failed:
      checkpointer.save(2, large, {"config": {}})  # written in the background: its failure shows at the next wait
      checkpointer.close()
    start = time.monotonic()
    checkpointer.close()
    assert time.monotonic() - start < 1
    message = str(failed.value)
    assert f"saving the checkpoint at step 2 in {disk / 'checkpoints'} failed: No space left on device." in message
    assert "free space there (checkpoint.keep=3 checkpoints are kept)" in message
    assert "the newest finished checkpoint, step 1, is intact: rerun the same command to resume from it" in message
    err = capfd.readouterr().err
    assert "Traceback" not in err and "tensorstore_spec" not in err and "Event loop is closed" not in err, err[-3000:]
    assert sorted(os.listdir(disk / "checkpoints")) == ["1", "2.orbax-checkpoint-tmp"]
    resumed = checkpoint_lib.Checkpointer(str(disk), keep=3)
    step, restored, _ = resumed.restore_latest(checkpoint_lib.abstract(small), {})
    resumed.close()
    assert os.listdir(disk / "checkpoints") == ["1"]  # the unfinished save's folder is removed (in the background)
  assert step == 1 and np.array_equal(restored["w"], small["w"])


def test_a_save_that_fails_after_a_fallback_names_the_checkpoint_the_rerun_resumes_from(tmp_path):
  """The run resumed from step 1, past the damaged step 2: a save that fails then names step 1, not step 2, as the
  checkpoint to resume from (a rerun falls back past step 2 again)."""
  small, meta = {"w": jax.numpy.arange(1000.0)}, {"config": {}}
  large = {"w": jax.numpy.asarray(np.random.default_rng(0).normal(size=(512, 1024)), np.float32)}  # 2 MiB
  with tmpfs(tmp_path / "disk", "size=1m") as disk:
    checkpointer = checkpoint_lib.Checkpointer(str(disk), keep=3)
    for step in (1, 2):
      checkpointer.save(step, small, meta)
    checkpointer.close()
    _garble(disk, 2)
    checkpointer = checkpoint_lib.Checkpointer(str(disk), keep=3)
    assert checkpointer.restore_latest(checkpoint_lib.abstract(small), {})[0] == 1
    with pytest.raises(CheckpointError) as failed:
      checkpointer.save(3, large, meta)
      checkpointer.close()
    checkpointer.close()
  assert "the newest finished checkpoint, step 1, is intact: rerun the same command" in str(failed.value)


def test_a_save_that_fails_at_once_is_raised_while_orbax_still_reports_it_saving(tmp_path):
  """A save whose writes fail fast (a read-only disk) fails before orbax's save() returns. In a multi-process run
  orbax then keeps reporting it as in progress while its thread waits for the other processes (10 minutes): the
  failure must still be raised at once, and only for that save's own folder."""
  small = {"w": jax.numpy.arange(1000.0)}
  with tmpfs(tmp_path / "disk", "size=1m") as disk:
    checkpointer = checkpoint_lib.Checkpointer(str(disk), keep=3)
    checkpointer.save(1, small, {"config": {}})
    checkpointer.close()
    checkpointer = checkpoint_lib.Checkpointer(str(disk), keep=3)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    start = time.monotonic()
    try:
      checkpointer.save(2, small, {"config": {}})
      checkpointer.manager.is_saving_in_progress = lambda: time.monotonic() - start < 60  # the others' barrier
      checkpointer.close()
    except CheckpointError as e:
      failed = str(e)
    else:
      failed = ""
    finally:
      subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
  assert time.monotonic() - start < 10
  assert f"saving the checkpoint at step 2 in {disk / 'checkpoints'} failed: " in failed
  assert "Read-only file system" in failed and "the newest finished checkpoint, step 1, is intact" in failed


def test_a_stop_signal_during_a_restore_is_not_a_damaged_checkpoint(tmp_path):
  """orbax wraps what stops a read in an Exception of its own: a stop signal in set-up (or a Ctrl-C) read as a
  damaged checkpoint, which was passed over, or the run told to move its checkpoints away."""
  from light_jax.preemption import StoppedInSetup

  state = {"w": jax.numpy.arange(4.0)}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  checkpointer.save(1, state, {"config": {}})
  checkpointer.close()
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)

  def interrupted_read(*args, **kwargs):
    try:
      raise StoppedInSetup(signal.SIGTERM)  # the guard's raise, inside orbax's read
    except BaseException as stop:
      raise Exception("Encountered error while reading array index") from stop  # as orbax words it

  checkpointer.manager.restore = interrupted_read
  with pytest.raises(StoppedInSetup):
    checkpointer.restore_latest(checkpoint_lib.abstract(state), {})
  checkpointer.close()
  assert checkpointer.damaged_steps == set()


def test_train_py_on_a_disk_that_fills_up_stops_with_one_line(tmp_path):
  args = [
    "--config",
    "configs/fashion_mnist.py",
    "--config.data.train_subset=1024",
    "--config.data.eval_subset=500",
    "--config.data.eval_batch_size=504",
    "--config.num_epochs=1",
    "--config.global_batch_size=128",
    "--config.log_every_steps=4",
  ]
  with tmpfs(tmp_path / "disk", "size=2m") as disk:  # a checkpoint of this model takes 2.8 MB
    result = train_py(*args, "--workdir", str(disk / "run"))
  assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-3000:]
  assert "Traceback" not in result.stderr and "tensorstore_spec" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
    f"error: saving the checkpoint at step 8 in {disk / 'run' / 'checkpoints'} failed: No space left on device. "
    "Training stopped: free space there (checkpoint.keep=3 checkpoints are kept), or move --workdir to a larger "
    "disk; no checkpoint has been saved yet: a rerun starts from step 0 (the unfinished save's folder is removed then)."
  )


# Runs train.py with its workdir's disk filled (by another program, as it were) just before the first record.
_FULL_DISK_AT_THE_FIRST_RECORD = """
import runpy, sys
filler = sys.argv.pop(1)
from light_jax import metrics
from tests.helpers import fill_disk
write = metrics.MetricsWriter.write
def fill_then_write(self, record):
  fill_disk(filler)
  write(self, record)
metrics.MetricsWriter.write = fill_then_write
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_disk_that_fills_up_before_a_record_is_written_stops_with_one_line(tmp_path):
  """Not a checkpoint's save but the append to metrics.jsonl met the full disk: a traceback (exit 1)."""
  with tmpfs(tmp_path / "disk", "size=2m") as disk:
    result = _train_py_through(
      _FULL_DISK_AT_THE_FIRST_RECORD,
      *("--workdir", str(disk / "run"), "--config.num_epochs=1", "--config.global_batch_size=128"),
      *("--config.data.eval_subset=500", "--config.data.eval_batch_size=504"),
      target=str(disk / "filler"),
    )
  assert result.returncode == ExitCode.BAD_INPUT and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
    f"error: writing in --workdir={disk / 'run'} failed: No space left on device. Training stopped: free space "
    "there, or move --workdir to a larger disk; then rerun the same command to resume from the newest checkpoint."
  )


def test_a_peer_lost_during_a_multi_process_restore_or_save_is_not_damage_nor_the_disks_fault(tmp_path, monkeypatch):
  """Process 1 killed while a two-process run restored its state: process 0's gathers failed (gloo: connection
  closed) and every good checkpoint was read as damaged, the run told to move them away (exit 2). Killed during
  a save: "fix what the file system says" (exit 2). Both are a lost peer: PeerLost, which train.py stops on with
  the peer's reason (exit 4), the checkpoints untouched. (The error is the one gloo raised in those runs.) A read
  error whose text holds the same words (a path with "gloo" in it) is still the checkpoint's own."""
  lost = jax.errors.JaxRuntimeError(
    "UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:6314"
  )
  state = {"w": jax.numpy.arange(1000.0)}
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  checkpointer.save(4, state, {"config": {}})
  checkpointer.close()

  def gather_fails(*args, **kwargs):
    raise lost

  resumed = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  monkeypatch.setattr(checkpoint_lib.jax, "process_count", lambda: 2)  # once orbax is set up for one process
  monkeypatch.setattr(resumed.manager, "restore", gather_fails)
  with pytest.raises(liveness.PeerLost, match=r"restoring a checkpoint: a collective failed \(UNKNOWN: Gloo"):
    resumed.restore_latest(checkpoint_lib.abstract(state), {})
  assert resumed.damaged_steps == set()
  monkeypatch.setattr(resumed.manager, "save", gather_fails)
  with pytest.raises(liveness.PeerLost, match=r"saving the checkpoint at step 8: a collective failed \(UNKNOWN: Gloo"):
    resumed.save(8, state, {"config": {}})
  monkeypatch.undo()
  resumed.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]
  unreadable = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  monkeypatch.setattr(checkpoint_lib.jax, "process_count", lambda: 2)
  # The barrier after a failed read and the processes' agreement on what restored are collectives, which one process
  # cannot make as two (a real pair: tests/test_multiprocess.py): here both processes failed alike.
  monkeypatch.setattr(unreadable, "_pass_the_restores_barrier", lambda: None)
  monkeypatch.setattr(unreadable, "_processes_that_failed", lambda step, ok: [] if ok else [0, 1])

  def read_fails(*args, **kwargs):
    raise ValueError("DATA_LOSS: Error reading local file /runs/gloo_2x4/checkpoints/4/state/d: unavailable")

  monkeypatch.setattr(unreadable.manager, "restore", read_fails)
  with pytest.raises(CheckpointError, match=r"none of the checkpoints .* \(steps \[4\]\) can be restored"):
    unreadable.restore_latest(checkpoint_lib.abstract(state), {})
  monkeypatch.undo()
  unreadable.close()
  # One process: the same error is the checkpoint's own (no peer to lose).
  alone = checkpoint_lib.Checkpointer(str(tmp_path), keep=3)
  monkeypatch.setattr(alone.manager, "restore", gather_fails)
  with pytest.raises(CheckpointError, match=r"none of the checkpoints .* \(steps \[4\]\) can be restored"):
    alone.restore_latest(checkpoint_lib.abstract(state), {})
  monkeypatch.undo()
  alone.close()


def test_a_lock_file_that_cannot_be_opened_is_named_with_what_to_do():
  """A .lock that is there but cannot be opened can be removed; a workdir that takes no new file cannot be mended so
  (it said "remove it" of /proc/.lock, which is not there)."""
  with pytest.raises(
    CheckpointError, match=r"^--workdir=/proc: cannot open /proc/.lock \(.*\); give another --workdir$"
  ):
    checkpoint_lib.lock_workdir("/proc")


def test_a_lock_file_that_cannot_be_written_on_a_full_disk_is_one_error(tmp_path):
  """Its first line was written at the flush: an OSError traceback from train.py's checks (exit 1)."""
  with tmpfs(tmp_path / "disk", "size=16k") as disk:
    fill_disk(disk / "filler")
    with pytest.raises(CheckpointError) as refused:
      checkpoint_lib.lock_workdir(str(disk))
  assert str(refused.value) == (
    f"--workdir={disk}: cannot write {disk / '.lock'} (No space left on device); free space there, or give another "
    "--workdir"
  )


def test_a_second_run_in_a_workdir_in_use_is_refused_before_touching_it(tmp_path):
  """Two runs in one workdir (a job restarted while the old process lingers): the second deleted the first's save
  in flight and each broke the other. The workdir is taken by the first run's process 0 until it ends."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  checkpoint_lib.lock_workdir(str(workdir))  # this process: the run in progress
  lock_file = checkpoint_lib._WORKDIR_LOCKS[str(workdir)]  # read through it: closing another descriptor of the
  lock_file.seek(0)  # file would drop this process's lock
  holder = lock_file.read().strip()
  try:
    result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(workdir), "--config.max_steps=1")
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error == (
      f"error: --workdir={workdir} is in use by another run ({holder}): two runs in one workdir delete each other's "
      "checkpoints. Wait for it to end or stop it, or give another --workdir."
    )
    assert holder.startswith(f"process {os.getpid()} on ")
    assert sorted(os.listdir(workdir)) == [".lock"]  # nothing else written
  finally:
    checkpoint_lib._WORKDIR_LOCKS.pop(str(workdir)).close()  # the run ends: its lock goes with it
  # Its .lock file stays behind and takes nothing: tests/test_train_e2e.py runs train.py in a workdir holding one.


def test_a_signal_during_an_epochs_evaluation_stops_the_run_after_that_step(tmp_path, monkeypatch):
  """The preemption check ran before the evaluation: a SIGTERM during it (minutes, on ImageNet) was seen a step
  later, which ran first."""
  evaluate_epoch = train_lib.EpochEvaluation.__call__

  def signalled_while_evaluating(self, info):
    evaluate_epoch(self, info)
    if info.step == 8:  # the first epoch's end
      os.kill(os.getpid(), signal.SIGTERM)  # caught by the trainer's PreemptionGuard

  monkeypatch.setattr(train_lib.EpochEvaluation, "__call__", signalled_while_evaluating)
  assert train_lib.train_and_evaluate(_config(), str(tmp_path)) == {"stopped": "preempted", "steps": 8}
  assert _steps(tmp_path) == [4, 8]


def _evaluation_failing(times):
  """The next ``times`` evaluations cannot read their split: a DataError at the first batch, as a damaged chunk of
  the evaluation split gives."""
  iterator, calls = data_lib.EvalBatches.iterator, itertools.count()

  def damaged(self, *args, **kwargs):
    if next(calls) >= times:
      return iterator(self, *args, **kwargs)

    def batches():
      raise data_lib.DataError("val.array_record is damaged")
      yield  # a generator: the error comes at the first read

    return batches()

  return _patched(data_lib.EvalBatches, "iterator", damaged)


def _unevaluated(workdir, step):
  """The record's training half that the checkpoint at ``step`` kept (its evaluation failed), or None."""
  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f).get("unevaluated")


def test_an_evaluation_that_fails_saves_the_steps_and_the_resumed_run_evaluates_them_first(uninterrupted, tmp_path):
  """The first evaluation (step 8) cannot read its split: the 8 steps are saved (they were lost: the run resumed
  from step 4), with the record's training half. Rerun before the split is mended: its error alone, nothing saved.
  Rerun once mended: step 8's record is written first, with the images/s of the run that trained those steps,
  and the run ends as the uninterrupted one."""
  with (
    _evaluation_failing(1),
    pytest.raises(
      data_lib.DataError, match=r"^val.array_record is damaged \(the run's 8 steps are saved: once mended, rerun"
    ),
  ):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert _steps(tmp_path) == [4, 8] and not (tmp_path / "metrics.jsonl").exists()
  training = _unevaluated(tmp_path, 8)
  assert training["step"] == 8 and training["images_per_sec"] > 0 and training["train_loss"] > 0
  with _evaluation_failing(1), pytest.raises(data_lib.DataError, match=r"^val.array_record is damaged$"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert _steps(tmp_path) == [4, 8] and not (tmp_path / "metrics.jsonl").exists()
  summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert summary["resumed_from_step"] == 8
  _assert_same_run(uninterrupted, tmp_path)
  first = read_metrics(tmp_path)[0]
  assert {key: first[key] for key in training} == training
  assert _unevaluated(tmp_path, 16) is None


def test_a_last_evaluation_that_fails_is_written_when_the_finished_run_is_resumed(uninterrupted, tmp_path):
  """The evaluation at the last step fails: the rerun trains nothing, writes the final record and the summary;
  run again, it writes them again, not twice (the checkpoint keeps the record's training half), and where that
  evaluation fails again the record written stays."""
  _copy_of(uninterrupted, tmp_path)
  shutil.rmtree(tmp_path / "checkpoints" / "24")
  with _evaluation_failing(1), pytest.raises(data_lib.DataError, match=r"\(the run's 24 steps are saved"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert [r["step"] for r in read_metrics(tmp_path)] == [8, 16] and not (tmp_path / "summary.json").exists()
  assert _unevaluated(tmp_path, 24)["step"] == 24
  for _ in range(2):
    summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
    assert summary["resumed_from_step"] == 24 and summary["steps"] == 24
    _assert_same_run(uninterrupted, tmp_path)
    assert read_metrics(tmp_path)[-1]["final"]
  with _evaluation_failing(1), pytest.raises(data_lib.DataError, match=r"^val.array_record is damaged$"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  _assert_same_run(uninterrupted, tmp_path)


def test_an_evaluation_that_fails_after_a_non_finite_step_reported_at_it_stops_as_non_finite(tmp_path):
  """The 8th step (0-based 7) is bad and reported at step 8 (an epoch end), whose evaluation then fails before the
  loop could stop on it: exit 3's error, which says that the evaluation failed too. It was the input's error, and
  the resumed run, its checkpoint counting the bad step as seen, went on."""
  config = _config(train__inject_nan_at_step=7, train__on_nonfinite="stop", log_every_steps=8)
  with (
    _evaluation_failing(1),
    pytest.raises(
      train_lib.NonFiniteError, match=r"at or before step 8.* The evaluation at step 8 also failed \(val.array_record"
    ),
  ):
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert _steps(tmp_path) == [4, 8]


def test_a_finished_run_whose_evaluation_fails_when_rerun_says_why_and_keeps_everything(uninterrupted, tmp_path):
  """A finished run rerun evaluates what it restored: where its input fails, the input's error (a DataError: exit
  2, one line), not the wrapper the processes agree with, and nothing is lost."""
  _copy_of(uninterrupted, tmp_path)
  with _evaluation_failing(1), pytest.raises(data_lib.DataError, match=r"^val.array_record is damaged$"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  _assert_same_run(uninterrupted, tmp_path)
