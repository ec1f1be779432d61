"""The scripts' and benchmarks' bad input: one `error:` line and exit code 2, no traceback (README: scripts exit 2
on bad input); and relative work directories given from outside the repository."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _fails(script, *args, cwd=ROOT):
  result = subprocess.run(
    [sys.executable, os.path.join(ROOT, script), *args],
    cwd=cwd,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  return errors[0]


def test_compare_runs_names_a_bad_run_argument(tmp_path):
  out = str(tmp_path / "runs.png")
  assert "'dense' is not LABEL=WORKDIR" in _fails("scripts/compare_runs.py", "--out", out, "dense")
  error = _fails("scripts/compare_runs.py", "--out", out, f"dense={tmp_path / 'missing'}")
  assert "missing/metrics.jsonl; give the workdir of a train.py run" in error
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "metrics.jsonl").write_text("")
  assert "holds no evaluation yet" in _fails("scripts/compare_runs.py", "--out", out, f"dense={tmp_path / 'empty'}")


def test_kernel_norms_compares_the_resolved_meshes(tmp_path):
  """A config with local=-1 (all devices) ran on the same 2 x 4 mesh as one that names it: not a mismatch."""
  for name, local in (("a", -1), ("b", 4)):
    (tmp_path / name).mkdir()
    summary = {"mesh": {"nodes": 2, "local": 4}, "config": {"mesh": {"nodes": 2, "local": local}, "model": {}}}
    (tmp_path / name / "summary.json").write_text(json.dumps(summary))
  error = _fails("scripts/kernel_norms.py", str(tmp_path / "a"), str(tmp_path / "b"))
  assert "no checkpoint under" in error  # past the comparison, at the first run's missing checkpoint


def test_input_pipeline_creates_its_workdir_or_says_why_it_cannot(tmp_path):
  (tmp_path / "file").write_text("")
  error = _fails("benchmarks/input_pipeline.py", f"--workdir={tmp_path / 'file' / 'bench'}")
  assert "cannot create it (Not a directory); choose another directory" in error
  workdir = tmp_path / "new" / "bench"
  command = [sys.executable, os.path.join(ROOT, "benchmarks", "input_pipeline.py"), f"--workdir={workdir}"]
  tiny = ["--images=2", "--rounds=1", "--seconds=0.01"]
  result = subprocess.run(command + tiny, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(workdir)) == ["cache_160.array_record", "cache_256.array_record"]


def test_prepare_image_folder_refuses_an_out_under_a_file(tmp_path):
  (tmp_path / "file").write_text("")
  error = _fails("scripts/prepare_image_folder.py", f"--folder={tmp_path}", f"--out={tmp_path / 'file' / 'out'}")
  assert "--out=" in error and "cannot create it (Not a directory)" in error


def test_prepare_imagenet_exits_2_on_a_missing_manual_dir(tmp_path):
  error = _fails("scripts/prepare_imagenet.py", f"--manual_dir={tmp_path / 'none'}", f"--data_dir={tmp_path}")
  assert "is not a directory. It must hold ILSVRC2012_img_train.tar" in error


STAND_IN_TRAIN_PY = """
import os, sys
workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
open(os.path.join(workdir, "summary.json"), "w").write("{}")
"""


@pytest.fixture
def train_runs(tmp_path, monkeypatch):
  """benchmarks/train_runs.py with a stand-in train.py in a repository root of its own."""
  module = importlib.import_module("train_runs")
  (tmp_path / "root").mkdir()
  (tmp_path / "root" / "train.py").write_text(STAND_IN_TRAIN_PY)
  monkeypatch.setattr(module, "ROOT", str(tmp_path / "root"))
  return module


def test_a_study_run_with_a_relative_workdir_from_outside_the_repository(train_runs, tmp_path, monkeypatch):
  (tmp_path / "caller").mkdir()
  monkeypatch.chdir(tmp_path / "caller")
  train_runs.run("row", "c.py", [], "runs/row")
  assert (tmp_path / "caller" / "runs" / "row" / "summary.json").exists()  # where the caller reads it
  assert not (tmp_path / "root" / "runs").exists()


def test_a_study_run_stamped_with_a_relative_workdir_is_still_reused(train_runs, tmp_path, monkeypatch):
  """Stamps written before workdirs were absolute name them relative to the root, where the studies ran."""
  workdir = tmp_path / "root" / "runs" / "row"
  workdir.mkdir(parents=True)
  (workdir / "command.txt").write_text("train.py --config=c.py --workdir=runs/row --config.seed=1")
  (workdir / "summary.json").write_text('{"kept": true}')
  monkeypatch.chdir(tmp_path / "root")
  train_runs.run("row", "c.py", ["--config.seed=1"], "runs/row")
  assert (workdir / "summary.json").read_text() == '{"kept": true}' and not (workdir / "train.log").exists()
