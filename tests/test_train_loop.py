"""The training loop in-process: train_and_evaluate on real Fashion-MNIST subsets, its hooks and its records."""

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from light_jax import checkpoint as checkpoint_lib
from light_jax import data as data_lib
from light_jax import schedules, train_lib
from light_jax.hooks import Hooks, StepInfo
from light_jax.metrics import MetricsError, MetricsWriter, read_metrics
from light_jax.models import create_model
from light_jax.parallel import fusion
from light_jax.parallel import reducer as reducer_lib
from tests.helpers import small_config, tmpfs


def test_hooks_run_by_period_and_predicate_in_order():
  calls = []
  hooks = Hooks()
  hooks.add(lambda i: calls.append(("every3", i.step)), every=3)
  hooks.add(lambda i: calls.append(("odd", i.step)) or ("stop" if i.step == 5 else None), when=lambda s: s % 2 == 1)
  hooks.add(lambda i: calls.append(("never", i.step)), every=0)
  stops = [hooks.run(StepInfo(step, None, None, 8, None)) for step in range(1, 7)]
  assert calls == [("odd", 1), ("every3", 3), ("odd", 3), ("odd", 5), ("every3", 6)]
  assert stops == [None, None, None, None, "stop", None]
  # Two reasons at one step: the first registered wins, and every due hook still runs.
  ranked = Hooks()
  for reason in ("nonfinite", "preempted"):
    ranked.add(lambda i, reason=reason: calls.append(reason) or reason, every=1)
  assert ranked.run(StepInfo(7, None, None, 8, None)) == "nonfinite" and calls[-2:] == ["nonfinite", "preempted"]


def test_max_steps_stops_mid_epoch_evaluates_and_writes_the_summary(tmp_path):
  summary = train_lib.train_and_evaluate(small_config("dense", max_steps=5), str(tmp_path))
  records = read_metrics(tmp_path)
  assert len(records) == 1 and records[0]["step"] == 5 and records[0]["epoch"] == round(5 / 32, 4)
  assert records[0]["eval_examples"] == 200 and records[0]["final"] is True
  assert summary["steps"] == 5 and summary["final_eval_top1"] == records[0]["eval_top1"]
  assert summary["config"]["comm"]["strategy"] == "dense"
  # dense: one flat psum, so a device sends the same bytes at both levels (2(P-1)/P x 4 bytes x params).
  assert (
    summary["inter_node_bytes_per_step"]
    == summary["intra_node_bytes_per_step"]
    == 2 * 7 * 4 * summary["num_params"] // 8
    == summary["inter_node_bytes_per_step_mean"]
  )
  assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints")) == [5]  # saved at the end
  # Extended (max_steps is safe to change): the step-5 record is no longer the final one; one record is.
  train_lib.train_and_evaluate(small_config("dense", max_steps=8), str(tmp_path))
  assert [(r["step"], r["final"]) for r in read_metrics(tmp_path)] == [(5, False), (8, True)]


def test_hitopk_with_adaptive_fusion_mstopk_and_density_warmup(tmp_path, caplog):
  config = small_config(
    "hitopk",
    num_epochs=2,
    global_batch_size=128,
    comm__fusion="adaptive",
    comm__topk_selector="mstopk",
    comm__density_warmup_epochs=1.0,
  )
  assert reducer_lib.reducer_from_config(config.comm, 2, 4).selector == "mstopk"
  with caplog.at_level(logging.INFO):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  plan = re.search(r"adaptive fusion \(MG-WFBP, v100_nvlink_25gbe\) .*: (\d+) buckets for (\d+) tensors", caplog.text)
  assert plan and int(plan[1]) < int(plan[2])  # tensors merged (here all: 29 small ones on latency-bound links)
  assert caplog.text.count("train step compiled") == 5  # 4 warm-up densities + the target
  first, last = read_metrics(tmp_path)
  # Epoch 1 ends in the last warm-up phase (density 0.025), epoch 2 at the target 0.01.
  assert first["inter_node_bytes_per_step"] > last["inter_node_bytes_per_step"]
  # Hierarchical dense would send 1/6 of its intra-node bytes across nodes; hitopk at 1% far less.
  assert last["inter_node_bytes_per_step"] < 0.02 * last["intra_node_bytes_per_step"]
  assert last["eval_top1"] > 0.3  # learns (chance: 0.1) in 32 steps at 1% density
  # The summary's mean counts the warm-up's denser steps; its per-step bytes are the last step's.
  assert summary["inter_node_bytes_per_step"] == last["inter_node_bytes_per_step"]
  assert summary["inter_node_bytes_per_step_mean"] > 2 * summary["inter_node_bytes_per_step"]


def test_progressive_resizing_on_fashion_mnist_compiles_every_phase_before_the_loop(tmp_path, caplog, monkeypatch):
  """data.resolution_schedule on an array dataset: 20 px in batches of 128 for epoch 0 (16 steps), then 28 px
  in batches of 64. Both steps are compiled before the loop (and its clock) starts; the learning rate follows
  each phase's batch (linear scaling), and a record's learning_rate is the one its last step used."""
  compiled_at_start = []

  def train_loop(state, start_step, total_steps, batches, compiled, hooks):
    compiled_at_start.append(len(compiled._compiled))
    return real_train_loop(state, start_step, total_steps, batches, compiled, hooks)

  real_train_loop = train_lib.train_loop
  monkeypatch.setattr(train_lib, "train_loop", train_loop)
  config = small_config(num_epochs=2, max_steps=20, data__resolution_schedule="0:20:128,1:28")
  with caplog.at_level(logging.INFO):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert compiled_at_start == [2]
  assert re.findall(r"train step compiled in [\d.]+ s \(batch ([\dx]+)\)", caplog.text) == ["128x20x20x1", "64x28x28x1"]
  assert "peak lr 0.1 (batch 128) / 0.05 (batch 64)" in caplog.text
  first, last = read_metrics(tmp_path)
  assert (first["step"], first["epoch"], last["step"], last["epoch"]) == (16, 1.0, 20, 1.125)
  assert summary["steps"] == 20 and np.isfinite(summary["final_train_loss"])
  # The run's images/s: its images over its training seconds, which are its records' (to the clock's readings).
  assert summary["images_per_sec_mean"] == pytest.approx((16 * 128 + 4 * 64) / last["train_seconds"])
  seconds = 16 * 128 / first["images_per_sec"] + 4 * 64 / last["images_per_sec"]
  assert seconds == pytest.approx(last["train_seconds"], rel=1e-2)
  plan = schedules.EpochPlan(2048, 2, schedules.parse_resolution_schedule("0:20:128,1:28", None), 64)
  schedule = schedules.learning_rate_schedule(config.optimizer, plan)
  assert first["learning_rate"] == pytest.approx(float(schedule(15)))  # step 15 (from 0), at batch 128's rate
  assert last["learning_rate"] == pytest.approx(float(schedule(19)))


def test_the_runs_images_per_second_is_its_images_over_its_training_seconds_whatever_the_resumes():
  plan = schedules.EpochPlan(2048, 2, schedules.parse_resolution_schedule("0:20:128,1:28", None), 64)
  # 16 x 128 images at 1000/s, then 4 x 64 at 500/s
  records = [
    {"step": 16, "images_per_sec": 1000.0, "train_seconds": 2.048},
    {"step": 20, "images_per_sec": 500.0, "train_seconds": 2.56},
  ]
  assert train_lib.images_per_sec_mean(records, plan) == pytest.approx(2304 / 2.56)
  # Resumed at step 19: the last record's rate covers step 19-20 alone (its process's; a slower one here), but its
  # train_seconds, carried by the checkpoint, the whole run's: the figure is the run's, not the records' weighed.
  records[-1]["images_per_sec"] = 64 / 0.2
  assert train_lib.images_per_sec_mean(records, plan) == pytest.approx(2304 / 2.56)
  assert train_lib.images_per_sec_mean([], plan) is None


class _SetUpDone(Exception):
  """Raised in place of a stage of train_and_evaluate: a test of set-up's log lines goes no further."""


def _set_up_only(monkeypatch, config, workdir, until=(checkpoint_lib, "Checkpointer")):
  """train_and_evaluate up to ``until`` (module, name), which raises instead: by default the checkpointer, made
  after set-up's lines and before any step is compiled; ``(train_lib, "tune_input")`` after the compile."""

  def done(*args, **kwargs):
    raise _SetUpDone

  monkeypatch.setattr(*until, done)
  with pytest.raises(_SetUpDone):
    train_lib.train_and_evaluate(config, str(workdir))


def test_a_warm_up_longer_than_the_run_and_phases_after_it_are_named(tmp_path, caplog, monkeypatch):
  """Fine in a short trial of a long recipe, but not what the config says: the warm-ups are cut to the run (the
  density never reaches comm.density), and the phases starting after its last epoch are left out; set-up names
  both (the run stops there: tests/test_tune.py's trials train with a warm-up cut so)."""
  config = small_config(
    num_epochs=1,
    max_steps=2,
    optimizer__warmup_epochs=3.0,
    data__resolution_schedule="0:28,4:20",
    comm__strategy="hitopk",
    comm__density_warmup_epochs=2.0,
  )
  with caplog.at_level(logging.WARNING):
    _set_up_only(monkeypatch, config, tmp_path)
  assert "optimizer.warmup_epochs=3 is longer than the run (num_epochs=1): the warm-up is cut" in caplog.text
  assert "comm.density_warmup_epochs=2 is longer than the run (num_epochs=1): the run ends inside" in caplog.text
  assert "data.resolution_schedule: the phase(s) from epoch 4 start after the run's last epoch" in caplog.text


TWO_EPOCHS = small_config(num_epochs=2, train__profile_steps="63:99")


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
  """(workdir, summary) of a 64-step float32 run profiled from step 63 past its end: float16's reference, a
  profile the run ends inside of, and a finished run to resume."""
  workdir = tmp_path_factory.mktemp("two_epochs")
  return workdir, train_lib.train_and_evaluate(TWO_EPOCHS, str(workdir))


def test_a_profile_the_run_ends_inside_of_is_still_written(two_epochs):
  """train.profile_steps past the run's end: the trace started after step 63 is written when the run ends."""
  workdir, _ = two_epochs
  traces = [name for _, _, names in os.walk(workdir / "profile") for name in names if name.endswith(".xplane.pb")]
  assert len(traces) == 1


def test_a_profile_that_starts_after_the_runs_last_step_is_said_to_write_nothing(tmp_path, caplog):
  """train.profile_steps=5:6 in a 2-step run wrote no trace, without a word."""
  with caplog.at_level(logging.WARNING):
    train_lib.train_and_evaluate(small_config(max_steps=2, train__profile_steps="5:6"), str(tmp_path))
  assert "train.profile_steps=5:6 writes no trace: this run takes steps 1 to 2" in caplog.text
  assert not (tmp_path / "profile").exists()


def test_an_error_before_the_loop_still_closes_the_checkpointer(tmp_path, monkeypatch):
  """What train_and_evaluate opens is closed on any error, not only on one inside the loop."""
  closed = []
  real_close = checkpoint_lib.Checkpointer.close
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "close", lambda self: (closed.append(1), real_close(self)))

  def tune_input(*args, **kwargs):
    raise data_lib.DataError("unreadable batch")

  monkeypatch.setattr(train_lib, "tune_input", tune_input)
  with pytest.raises(data_lib.DataError, match="unreadable batch"):
    train_lib.train_and_evaluate(small_config(max_steps=2), str(tmp_path))
  assert closed == [1]


def test_final_density_epochs_send_at_the_final_density(tmp_path, caplog):
  """comm.final_density_epochs: the last epoch compiles a step at comm.final_density, and its bytes say so."""
  config = small_config(
    "hitopk", num_epochs=2, global_batch_size=128, comm__final_density_epochs=1.0, comm__final_density=0.05
  )
  with caplog.at_level(logging.INFO):
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert caplog.text.count("train step compiled") == 2
  assert "top-k density 0.01)" in caplog.text and "top-k density 0.05)" in caplog.text
  first, last = read_metrics(tmp_path)
  assert last["inter_node_bytes_per_step"] > first["inter_node_bytes_per_step"]


def test_sqrt_k_allocation_and_auto_are_planned_by_the_trainer(tmp_path, caplog, monkeypatch):
  """CompiledSteps plans with cost_model.plan_reducer: the square-root share reaches the compiled step (its
  log line), and auto logs its choice per bucket."""
  with caplog.at_level(logging.INFO), monkeypatch.context() as patched:
    config = small_config("hitopk", max_steps=2, comm__k_allocation="sqrt")
    _set_up_only(patched, config, tmp_path / "a", until=(train_lib, "tune_input"))  # after the step's compile
  assert "top-k density 0.01, k in proportion to sqrt(size)" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO):
    _set_up_only(monkeypatch, small_config(max_steps=2, comm__strategy="auto"), tmp_path / "b")
  assert "comm.strategy=auto (v100_nvlink_25gbe, top-k at 1e+09 elements/s), per bucket:" in caplog.text


def test_compact_pairs_reach_the_trained_step_and_its_byte_count(tmp_path, caplog):
  """comm.compact_pairs from the config: the compiled step says so, and summary.json's inter-node bytes are
  the compact count, 4 bytes a pair instead of 8 (per tensor, every shard of the model is under 65,536)."""
  config = small_config("hitopk", max_steps=2, comm__compact_pairs=True, comm__fusion="none")
  with caplog.at_level(logging.INFO):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert "top-k density 0.01, compact pairs (bfloat16 value, uint16 index)" in caplog.text
  compact = reducer_lib.reducer_from_config(config.comm, config.mesh.nodes, config.mesh.local)
  model = create_model(config.model.name, 10, width=config.model.width)
  params = fusion.profile_parameters(model, (28, 28, 1)).params
  pairs = sum(k for _, _, k in compact.bucket_plan(params))
  wide = dataclasses.replace(compact, compact_pairs=False).bytes_per_step(params).inter_node
  assert pairs > 0 and summary["inter_node_bytes_per_step"] == wide - 4 * pairs
  assert np.isfinite(summary["final_eval_top1"])


def test_resuming_a_finished_run_reports_again_even_without_metrics_jsonl(two_epochs, tmp_path):
  """A finished run has no step left: it evaluates what it restored, on every process alike (before,
  the summary read the last metrics.jsonl record, which only process 0 has: a TypeError elsewhere)."""
  run, first = two_epochs
  shutil.copytree(run, tmp_path / "again")
  os.remove(tmp_path / "again" / "metrics.jsonl")
  again = train_lib.train_and_evaluate(TWO_EPOCHS, str(tmp_path / "again"))
  assert again["steps"] == first["steps"] == 64 and again["resumed_from_step"] == 64
  for key in ("final_eval_top1", "final_eval_top5", "final_train_loss"):
    assert again[key] == pytest.approx(first[key], abs=1e-6), key
  assert again["inter_node_bytes_per_step"] == first["inter_node_bytes_per_step"]


def test_a_batch_larger_than_the_split_is_a_clear_error(tmp_path):
  with pytest.raises(schedules.ScheduleError, match=r"has 2048 examples, fewer than one global batch \(4096\)"):
    train_lib.train_and_evaluate(small_config(global_batch_size=4096), str(tmp_path))


def test_a_run_stopped_on_a_nonfinite_step_resumes_past_it(tmp_path):
  """The checkpoint remembers the bad step; rerunning with the same policy goes on instead of stopping
  again at the first check (before, the count restarted from 0, so the old step looked new)."""
  config = small_config(train__inject_nan_at_step=3, train__on_nonfinite="stop", log_every_steps=2, max_steps=8)
  with pytest.raises(train_lib.NonFiniteError, match="at or before step 4"):
    train_lib.train_and_evaluate(config, str(tmp_path))
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["steps"] == 8 and summary["resumed_from_step"] == 4 and summary["nonfinite_steps"] == 1


def test_float16_with_dynamic_loss_scaling_trains_like_float32(two_epochs, tmp_path):
  fp32_run, fp32 = two_epochs  # its profile of the last step changes no number
  fp16 = train_lib.train_and_evaluate(small_config(num_epochs=2, model__dtype="float16"), str(tmp_path / "fp16"))
  records = read_metrics(tmp_path / "fp16")
  assert [r["loss_scale"] for r in records] == [2.0**15] * 2  # no overflow in 64 steps at this size
  assert "loss_scale" not in read_metrics(fp32_run)[0]
  assert fp16["final_eval_top1"] > 0.3 and abs(fp16["final_eval_top1"] - fp32["final_eval_top1"]) < 0.05
  assert fp16["final_train_loss"] == pytest.approx(fp32["final_train_loss"], rel=0.05)
  assert fp16["final_train_loss"] != fp32["final_train_loss"]  # it did compute in float16


def test_metrics_jsonl_with_a_last_line_cut_short_resumes_and_a_damaged_one_is_named(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 4, "epoch": 1.0}\n{"step": 8, "epoch": 2.0}\n{"step": 12, "ep')  # a crash mid-append
  with caplog.at_level(logging.WARNING):
    writer = MetricsWriter(str(tmp_path), resume_step=8)
  assert "leaving out its last line" in caplog.text and [r["step"] for r in writer.records] == [4, 8]
  writer.write({"step": 12, "epoch": 3.0})
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [4, 8, 12]  # rewritten whole, then appended to
  assert not (tmp_path / "metrics.jsonl.tmp").exists()
  path.write_text('{"step": 4, "epoch": 1.0}\n{"step": 8, "ep\n{"step": 12, "epoch": 3.0}\n')
  with pytest.raises(MetricsError, match=r"metrics.jsonl, line 2: not a JSON record .* Move it away"):
    MetricsWriter(str(tmp_path), resume_step=8)


@pytest.mark.parametrize(
  "line,what",
  [
    (b"[1, 2]", "not a record with a step"),  # a TypeError traceback
    (b'{"epoch": 1.0}', "not a record with a step"),  # a KeyError traceback
    (b'{"step": 4, "name": "\xff"}', r"not a JSON record \(not UTF-8 text\)"),  # a UnicodeDecodeError traceback
    (b'{"step": 4,, "epoch": 1.0}', r"not a JSON record \(Expecting property name enclosed in double quotes at column"),
  ],
)
def test_a_metrics_jsonl_line_that_is_not_a_record_is_named(tmp_path, line, what):
  (tmp_path / "metrics.jsonl").write_bytes(line + b'\n{"step": 8, "epoch": 2.0}\n')
  with pytest.raises(MetricsError, match=f"metrics.jsonl, line 1: {what}"):
    MetricsWriter(str(tmp_path), resume_step=8)


def test_a_previous_runs_records_summary_and_plot_are_kept_aside_not_dropped(tmp_path):
  """A run started over where another left records but no checkpoint dropped its records with a warning; a rerun
  replaced a finished run's summary (its timing) and plot, and an extension killed before its end left the old
  summary, which tools read as a finished run."""
  (tmp_path / "metrics.jsonl").write_text('{"step": 4, "epoch": 1.0}\n')
  (tmp_path / "summary.json").write_text('{"steps": 4}')
  (tmp_path / "curves.png").write_bytes(b"png")
  MetricsWriter(str(tmp_path)).close()  # started over
  kept = sorted(name for name in os.listdir(tmp_path) if ".before-" in name)
  assert [name.split(".before-")[0] for name in kept] == ["curves.png", "metrics.jsonl", "summary.json"]
  assert (tmp_path / kept[1]).read_text() == '{"step": 4, "epoch": 1.0}\n'
  assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()
  (tmp_path / "summary.json").write_text('{"steps": 8}')
  MetricsWriter(str(tmp_path)).close()  # again within the second: the first one kept stays
  kept = sorted(name for name in os.listdir(tmp_path) if name.startswith("summary.json.before-"))
  assert [(tmp_path / name).read_text() for name in kept] == ['{"steps": 4}', '{"steps": 8}']
  # A finished run resumed trains nothing: its summary (its timing) stays as it is, and nothing piles up.
  (tmp_path / "summary.json").write_text('{"steps": 8, "wall_seconds": 9.75}')
  writer = MetricsWriter(str(tmp_path), resume_step=8, goes_on=False)
  writer.write_summary({"steps": 8, "wall_seconds": 5.0})
  assert json.loads((tmp_path / "summary.json").read_text())["wall_seconds"] == 9.75
  assert len([name for name in os.listdir(tmp_path) if name.startswith("summary.json.before-")]) == 2


def test_a_previous_runs_file_that_cannot_be_moved_aside_is_one_error(tmp_path):
  """It was a PermissionError traceback, exit 1 (which benchmarks/train_runs.py retries as a run that died)."""
  with tmpfs(tmp_path / "disk", "size=1m") as disk:
    (disk / "summary.json").write_text('{"steps": 4}')
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    try:
      with pytest.raises(MetricsError, match=r"summary.json is a previous run's, and cannot be moved aside to summ"):
        MetricsWriter(str(disk)).close()
    finally:
      subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    assert json.loads((disk / "summary.json").read_text()) == {"steps": 4}


def test_hitopk_on_one_node_says_it_saves_nothing(tmp_path, caplog, monkeypatch):
  with caplog.at_level(logging.WARNING):  # hitopk on 1 x 8 trains: tests/test_collectives.py
    _set_up_only(monkeypatch, small_config("hitopk", max_steps=1, mesh__nodes=1, mesh__local=8), tmp_path)
  assert "comm.strategy=hitopk on one node (mesh 1 x 8)" in caplog.text


def test_step_times_of_a_resumed_run_keep_only_the_steps_up_to_its_checkpoint(tmp_path):
  """The steps after the checkpoint ran again: their first timings (and a line cut short by a kill) go."""
  from light_jax.hooks import StepTimer

  path = tmp_path / "step_times.jsonl"
  path.write_text(
    "".join(f'{{"step": {s}, "seconds": 0.1, "sent_bytes": 0}}\n' for s in range(1, 9)) + '{"step": 9, "se'
  )
  StepTimer(str(path), resume_step=6)
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_step_times_leave_out_the_evaluations_and_saves_after_a_step(tmp_path, monkeypatch):
  """train.time_steps: each step's seconds are its input, dispatch and computation. The timer ran after the
  evaluation and the checkpoint save, so a step with either counted them (here the save at step 4 and the
  evaluation at step 8 take 2 s more, made so)."""
  import time

  from light_jax import hooks

  for hook, at in ((hooks.CheckpointSaver, 4), (hooks.EpochEvaluation, 8)):

    def slow(self, info, call=hook.__call__, at=at):
      if info.step == at:
        time.sleep(2.0)
      return call(self, info)

    monkeypatch.setattr(hook, "__call__", slow)
  config = small_config(train__time_steps=True, data__train_subset=512, checkpoint__every_steps=4)
  train_lib.train_and_evaluate(config, str(tmp_path))
  records = [json.loads(line) for line in (tmp_path / "step_times.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 9))  # 8 steps: saves at 4 and 8, the evaluation at 8
  # Step 1 waits for the first batch and runs the step's first execution: left out, as the mesh lab's warm-up.
  assert max(r["seconds"] for r in records[1:]) < 1.5, records


def test_the_progress_bars_images_per_second_leave_out_evaluations():
  """The bar's own timer ran through each epoch's evaluation: 1,976 images/s, then 199 right after one."""
  import time
  import types

  import jax.numpy as jnp

  from light_jax.hooks import ProgressBar, StepInfo, TrainClock

  class Bar:
    def update(self, n):
      pass

    def set_postfix(self, **shown):
      self.shown = shown

  bar, clock = Bar(), TrainClock()
  progress = ProgressBar(bar, lambda step: 0.1, 2, clock)
  state = types.SimpleNamespace(nonfinite_steps=jnp.zeros((), jnp.int32))
  for step in range(1, 5):
    time.sleep(0.02)  # the step
    progress(StepInfo(step, state, np.zeros(8, np.float32), 100, None))
    if step == 2:  # an evaluation, which EpochEvaluation keeps off the clock
      clock.pause()
      time.sleep(0.5)
      clock.resume()
  assert float(bar.shown["img_s"]) > 200 / 0.2  # 200 images in about 0.04 s of steps, not in 0.54 s
