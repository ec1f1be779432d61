"""The studies' rows (benchmarks/large_batch.py, benchmarks/compression_accuracy.py) are valid train.py
command lines: each resolves, through train.py's own flag parser, to a config that passes validation on
the 8 devices the studies use. No training: a typo in a row would otherwise surface an hour into a study."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from light_jax import cli
from light_jax import config as config_lib
from tests.helpers import ROOT, workdir_held

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
STUDIES = ("large_batch", "compression_accuracy")


@pytest.mark.parametrize(
  "study,label", [(study, label) for study in STUDIES for label in importlib.import_module(study).RUNS]
)
def test_every_study_row_is_a_valid_config(study, label, monkeypatch):
  monkeypatch.chdir(ROOT)  # the rows name their config files relative to the repository, as train.py runs them
  config, overrides, _ = importlib.import_module(study).RUNS[label]
  assert config_lib.validate(cli.resolve_config(config, overrides), num_devices=8) == (2, 4)


@pytest.mark.parametrize(
  "variant,label",
  [
    ("large_batch", "sgd_4096_w5_linear"),
    ("large_batch_hitopk", "sgd_4096_w3_hitopk_dgc_per_tensor_clip"),
    ("large_batch_hitopk_03", "sgd_4096_w3_hitopk_clip_03pct_bf16"),
    ("large_batch_hitopk_compact", "sgd_4096_w3_hitopk_clip_05pct_bf16_compact"),
    ("large_batch_lars", "lars_tuned_lr1"),
  ],
)
def test_the_large_batch_variants_are_the_rows_that_measured_them(variant, label, monkeypatch):
  """README reports these rows' runs as the variants' own: each pair must stay the same config."""
  monkeypatch.chdir(ROOT)
  config, overrides, _ = importlib.import_module("large_batch").RUNS[label]
  assert (
    cli.resolve_config(config, overrides).to_dict()
    == cli.resolve_config(f"configs/fashion_mnist.py:{variant}", []).to_dict()
  )


def test_the_epoch_table_gives_each_runs_top1_and_loss_at_fixed_epochs(capsys):
  large_batch = importlib.import_module("large_batch")
  records = [{"epoch": e, "eval_top1": 0.5 + e / 100, "train_loss": 2.0 - e / 20} for e in range(1, 29)]
  large_batch.epoch_table({"run": {"epochs": 28, "records": records}, "short": {"epochs": 8, "records": records[:8]}})
  lines = capsys.readouterr().out.split("\n")
  assert lines[1].split() == ["epoch", "1", "2", "4", "8", "12", "16", "20", "24", "28"]
  assert lines[2].split()[:2] == ["run", "51.00"] and lines[2].split()[-1] == "0.60"
  assert lines[3].split() == ["short", "51.00", "52.00", "54.00", "58.00", "loss", "1.95", "1.90", "1.80", "1.60"]


def test_mean_bytes_per_step_weights_each_evaluation_by_its_steps():
  """A density warm-up sends more in its first epochs: the report's mean covers them, step-weighted."""
  train_runs = importlib.import_module("train_runs")
  records = [{"step": 10, "b": 1000}, {"step": 20, "b": 100}, {"step": 40, "b": 10}]
  assert train_runs.mean_per_step(records, "b") == (10 * 1000 + 10 * 100 + 20 * 10) / 40
  assert train_runs.mean_per_step([], "b") == 0


def test_a_finished_run_whose_command_now_gives_another_config_is_not_reused(tmp_path, monkeypatch):
  """The stamp is the command's text, and a variant's values may change under the same text: the summary's
  config must still be what the command gives, but for fields added since at their defaults."""
  import json

  train_runs = importlib.import_module("train_runs")
  with pytest.MonkeyPatch.context() as inside:
    inside.chdir(ROOT)
    now = json.loads(json.dumps(cli.resolve_config("configs/fashion_mnist.py:large_batch", []).to_dict()))
  monkeypatch.chdir(tmp_path)  # config_changed resolves in ROOT, whatever the current folder
  for name, recorded, changed in [
    ("same", now, ""),
    ("added_since", {**now, "comm": {k: v for k, v in now["comm"].items() if k != "k_allocation"}}, ""),
    ("other_values", {**now, "optimizer": {**now["optimizer"], "base_lr": 0.3}}, "optimizer.base_lr: 0.3 -> 0.2"),
    ("other_length", {**now, "num_epochs": 8}, "num_epochs: 8 -> 28"),  # resumable, but another run's result
    ("other_mesh", {**now, "mesh": {**now["mesh"], "nodes": 4, "local": 2}}, "mesh.local: 2 -> 4; mesh.nodes: 4 -> 2"),
    ("logged_more", {**now, "log_every_steps": 5, "checkpoint": {**now["checkpoint"], "every_steps": 7}}, ""),
  ]:
    (tmp_path / name).mkdir()
    (tmp_path / name / "summary.json").write_text(json.dumps({"config": recorded}))
    assert train_runs.config_changed(str(tmp_path / name), "configs/fashion_mnist.py:large_batch", []) == changed


# A stand-in for train.py, to test the studies' harness alone (train.py's own resume is tested in
# test_checkpoint.py): its first process writes a checkpoint and a record, then ends with EXIT (None:
# aborts, as XLA does); the next resumes, writes the last record and the summary.
STOPPING_TRAIN_PY = """
import json, os, sys
workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
def record(step, seconds):
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": step, "train_seconds": seconds}) + "\\n")
print("process with", sorted(os.listdir(workdir)))
if STOPS_FIRST and not os.path.isdir(os.path.join(workdir, "checkpoints")):
  os.makedirs(os.path.join(workdir, "checkpoints", "100"))
  record(100, 10.0)
  os.abort() if EXIT is None else sys.exit(EXIT)
record(200, 14.0)
open(os.path.join(workdir, "summary.json"), "w").write("{}")
"""


def _stand_in(tmp_path, monkeypatch, stops_first=True, exit_code=None):
  train_runs = importlib.import_module("train_runs")
  (tmp_path / "train.py").write_text(f"STOPS_FIRST = {stops_first}\nEXIT = {exit_code}\n" + STOPPING_TRAIN_PY)
  monkeypatch.setattr(train_runs, "ROOT", str(tmp_path))
  return train_runs


def _processes(workdir):
  return (workdir / "train.log").read_text().count("process with")


@pytest.mark.parametrize("stops_first", [True, False])
def test_a_study_run_that_aborts_resumes_from_its_checkpoint(stops_first, tmp_path, monkeypatch):
  train_runs = _stand_in(tmp_path, monkeypatch, stops_first)
  workdir = tmp_path / "run"
  train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir))
  assert _processes(workdir) == (2 if stops_first else 1) and (workdir / "summary.json").exists()
  log = (workdir / "train.log").read_text()
  # Run again with the same command: reused; with another command: started over.
  train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir))
  assert (workdir / "train.log").read_text() == log
  train_runs.run("row", "c.py", ["--config.seed=2"], str(workdir))
  assert _processes(workdir) == (2 if stops_first else 1)


def test_a_workdir_a_run_still_holds_is_not_emptied(tmp_path, monkeypatch):
  """--rerun (or another command) while the run still trains there: its workdir was emptied under it."""
  train_runs = _stand_in(tmp_path, monkeypatch, stops_first=False)
  workdir = tmp_path / "run"
  train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir))
  before = sorted(os.listdir(workdir))
  with workdir_held(workdir) as holder:
    with pytest.raises(
      train_runs.UnusableWorkdir, match=rf"row: {workdir} is in use by a run still going \(process {holder} on "
    ):
      train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir), rerun=True)
    assert sorted(os.listdir(workdir)) == sorted([*before, ".lock"])  # kept, with the holder's lock file
  train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir), rerun=True)  # the run has ended: started over
  assert _processes(workdir) == 1


def test_a_folder_of_the_users_own_is_not_emptied_for_a_run(tmp_path, monkeypatch):
  """A --workdir that named a folder of the user's (no command.txt: no run of a study made it): it was deleted."""
  train_runs = _stand_in(tmp_path, monkeypatch, stops_first=False)
  workdir = tmp_path / "notes"
  workdir.mkdir()
  (workdir / "precious.txt").write_text("mine")
  with pytest.raises(
    train_runs.UnusableWorkdir,
    match=rf"row: {workdir} holds files no run of this program made \(precious.txt; no command.txt\), which",
  ):
    train_runs.run("row", "c.py", [], str(workdir))
  assert (workdir / "precious.txt").read_text() == "mine"
  train_runs.run("row", "c.py", [], str(tmp_path / "empty"))  # an empty folder, or none, is the run's to take
  train_runs.run("row", "c.py", ["--config.seed=2"], str(tmp_path / "empty"))  # its own, stamped: started over
  assert _processes(tmp_path / "empty") == 1


def test_a_file_where_a_run_s_workdir_goes_is_named_and_kept(tmp_path, monkeypatch):
  """It made the study fail with NotADirectoryError from shutil.rmtree."""
  train_runs = _stand_in(tmp_path, monkeypatch)
  workdir = tmp_path / "run"
  workdir.write_text("notes")
  with pytest.raises(train_runs.UnusableWorkdir, match=rf"row: {workdir} is a file, not a run's directory; move it"):
    train_runs.run("row", "c.py", [], str(workdir))
  with pytest.raises(train_runs.UnusableWorkdir, match=rf"row: cannot make {workdir / 'run'} \(Not a directory\)"):
    train_runs.run("row", "c.py", [], str(workdir / "run"))  # a file on the way
  assert workdir.read_text() == "notes"


def test_a_study_run_out_of_retries_resumes_when_the_study_runs_again(tmp_path, monkeypatch):
  train_runs = _stand_in(tmp_path, monkeypatch)
  workdir = tmp_path / "run"
  with pytest.raises(subprocess.CalledProcessError) as failed:
    train_runs.run("row", "c.py", [], str(workdir), retries=0)
  assert failed.value.returncode == -6 and _processes(workdir) == 1  # SIGABRT
  train_runs.run("row", "c.py", [], str(workdir))  # the same command: resumed, not wiped
  assert _processes(workdir) == 2 and [r["step"] for r in train_runs.metrics.read_metrics(str(workdir))] == [100, 200]
  train_runs.run("row", "c.py", [], str(workdir), rerun=True)  # --rerun: from scratch
  fresh = "process with ['command.txt', 'train.log']"  # a new workdir: no checkpoint, no records
  assert _processes(workdir) == 2 and (workdir / "train.log").read_text().startswith(fresh)


@pytest.mark.parametrize("exit_code", [2, 3])  # a refused input; a non-finite loss with on_nonfinite=stop
def test_a_study_run_that_stops_deliberately_is_not_retried(exit_code, tmp_path, monkeypatch):
  train_runs = _stand_in(tmp_path, monkeypatch, exit_code=exit_code)
  with pytest.raises(subprocess.CalledProcessError) as failed:
    train_runs.run("row", "c.py", [], str(tmp_path / "run"))
  assert failed.value.returncode == exit_code and _processes(tmp_path / "run") == 1


def test_a_study_run_that_fails_without_a_checkpoint_is_not_retried(tmp_path, monkeypatch):
  train_runs = _stand_in(tmp_path, monkeypatch)
  (tmp_path / "train.py").write_text("import sys\nprint('process with')\nsys.exit(1)\n")
  with pytest.raises(subprocess.CalledProcessError) as failed:
    train_runs.run("row", "c.py", [], str(tmp_path / "run"))
  assert failed.value.returncode == 1 and _processes(tmp_path / "run") == 1


def test_elapsed_adds_the_seconds_of_a_process_resumed_from_an_older_checkpoint():
  """Checkpoints now carry the clock (test_checkpoint.py); a run resumed from one written before restarted
  its clock at 0: the harness adds the seconds of the process before."""
  train_runs = importlib.import_module("train_runs")
  assert train_runs.elapsed([{"train_seconds": s} for s in (5.0, 10.0, 3.0, 7.0)]) == [5.0, 10.0, 13.0, 17.0]
  assert train_runs.elapsed([{"train_seconds": s} for s in (5.0, 10.0, 14.0)]) == [5.0, 10.0, 14.0]


def test_a_study_run_stopped_before_its_end_is_a_failure_the_same_command_resumes(tmp_path, monkeypatch):
  """train.py exits 0 when a signal stops it after a save (or in set-up): the row counted as done, with no summary."""
  train_runs = _stand_in(tmp_path, monkeypatch, exit_code=0)
  workdir = tmp_path / "run"
  with pytest.raises(subprocess.CalledProcessError) as failed:
    train_runs.run("row", "c.py", [], str(workdir))
  assert failed.value.returncode == 0 and _processes(workdir) == 1
  line = train_runs.failure_line("row", 0, str(workdir))
  assert line.startswith("error: row failed: train.py was stopped (a signal) before its end; the same command resumes")
  train_runs.run("row", "c.py", [], str(workdir))
  assert _processes(workdir) == 2 and (workdir / "summary.json").exists()


def test_a_damaged_summary_resumes_the_row_and_another_commands_run_is_not_reported_as_the_row(tmp_path, monkeypatch):
  """A half-written summary.json stopped the whole study with a JSONDecodeError traceback; --report_only reported a
  workdir stamped by another command (another density, say) as the row's result."""
  train_runs = _stand_in(tmp_path, monkeypatch)
  workdir = tmp_path / "run"
  train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir))
  assert train_runs.other_run(str(workdir), "c.py", ["--config.seed=1"]) == ""
  assert train_runs.other_run(str(workdir), "c.py", ["--config.seed=2"]).startswith(
    f"{workdir} holds the run of another command (train.py --config=c.py --workdir={workdir} --config.seed=1)"
  )
  assert train_runs.other_run(str(tmp_path / "none"), "c.py", []) == ""  # nothing to read
  assert _processes(workdir) == 2  # stopped, then resumed from its checkpoint
  (workdir / "summary.json").write_text('{"config": {"se')
  train_runs.run("row", "c.py", ["--config.seed=1"], str(workdir))
  # Resumed (its checkpoint kept, not started over), and the summary written again.
  assert _processes(workdir) == 3 and json.loads((workdir / "summary.json").read_text()) == {}


# Saves for a second when a Ctrl-C reaches it (as train.py does after its step), then exits 0.
SAVES_ON_CTRL_C = """
import os, signal, sys, time
workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
def save(signum, frame):
  time.sleep(1)
  open(os.path.join(workdir, "saved"), "w").close()
  sys.exit(0)
signal.signal(signal.SIGINT, save)
print("process with", flush=True)
time.sleep(60)
"""

_STUDY_OF_ONE_ROW = """
import sys
sys.path.insert(0, "benchmarks")
import train_runs
train_runs.ROOT = sys.argv[1]
sys.argv = ["study.py", "--workdir=" + sys.argv[2]]
train_runs.study("one row", {"row": ("c.py", [], "")}, sys.argv[1], "")
"""


def test_a_ctrl_c_waits_for_the_run_to_save_then_stops_the_study_in_one_line(tmp_path):
  """subprocess.run killed train.py 0.25 s after the Ctrl-C, in the middle of its save, and the study ended with a
  KeyboardInterrupt traceback."""
  import signal
  import sys
  import time

  (tmp_path / "train.py").write_text(SAVES_ON_CTRL_C)
  study = subprocess.Popen([sys.executable, "-c", _STUDY_OF_ONE_ROW, str(tmp_path), str(tmp_path / "runs")], cwd=ROOT,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
  deadline = time.monotonic() + 60
  while "process with" not in _log_text(tmp_path / "runs" / "row"):
    assert time.monotonic() < deadline and study.poll() is None
    time.sleep(0.1)
  os.killpg(study.pid, signal.SIGINT)  # a terminal's Ctrl-C: to the whole group
  err = study.communicate(timeout=60)[1]
  assert study.returncode == 130 and "Traceback" not in err, err
  assert err.strip().splitlines()[-1] == "stopped by Ctrl-C during row: the same command resumes it"
  assert (tmp_path / "runs" / "row" / "saved").exists()


def _log_text(workdir):
  try:
    return (workdir / "train.log").read_text()
  except FileNotFoundError:
    return ""
