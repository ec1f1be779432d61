"""The benchmarks that chain long runs (time_to_accuracy.py, mesh_lab.py, the studies' train_runs.py): a run
that fails is named in one line, the others go on, what finished is reported and the exit status says so;
finished runs are reused and cut ones resumed. Stand-ins for the cluster and train.py: no namespaces, no
training."""

import json
import os
import sys

import pytest

from light_jax.emulated_cluster import LoopbackCluster
from tests.helpers import ROOT, tmpfs

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import mesh_lab  # noqa: E402
import time_to_accuracy  # noqa: E402
import train_runs  # noqa: E402

NODE_FAILED = "`python train.py` on node 1 exited 1, the first node to fail:\nValueError: boom"


def _record(step, top1, final=False):
  return {"step": step, "epoch": step / 100, "eval_top1": top1, "train_seconds": step / 10,
          "inter_node_bytes_per_step": 624, "final": final}  # fmt: skip


class _Cluster:
  """Stands in for EmulatedCluster: nothing to make."""

  def __init__(self, nodes, rate):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    pass


@pytest.fixture
def lab(tmp_path, monkeypatch):
  """time_to_accuracy.main on a stand-in cluster whose train.py writes two evaluations, a checkpoint and a
  summary; a run of gtopk fails, and one of a strategy in ``cut`` stops after its first epoch."""
  calls, cut = [], set()

  def train_on_cluster(cluster, local, config, overrides, workdir, peer_timeout, timeout):
    label = overrides[0].split("=", 1)[1]  # --config.comm.strategy=NAME
    os.makedirs(workdir, exist_ok=True)  # as train.py does
    calls.append((label, sorted(os.listdir(workdir))))
    if label == "gtopk":
      raise RuntimeError(NODE_FAILED)
    os.makedirs(os.path.join(workdir, "checkpoints", "100"), exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps(_record(100, 0.90)) + "\n")
      if label in cut:
        raise RuntimeError("`python train.py` on node(s) 0, 1 still ran after 7200 s (the limit for the whole job)")
      f.write(json.dumps(_record(200, 0.93, final=True)) + "\n")
    open(os.path.join(workdir, "summary.json"), "w").write("{}")

  monkeypatch.setattr(time_to_accuracy, "EmulatedCluster", _Cluster)
  monkeypatch.setattr(time_to_accuracy, "train_on_cluster", train_on_cluster)

  def main(*argv):
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["time_to_accuracy.py", f"--workdir={tmp_path}", *argv])
    try:
      time_to_accuracy.main()
    except SystemExit as e:
      return e.code
    return 0

  main.calls, main.cut = calls, cut
  return main


def test_a_failed_run_is_one_line_and_the_later_strategies_still_run(lab, capsys):
  code = lab("--strategies", "hierarchical,gtopk@0.01,hitopk@0.01")
  out, err = capsys.readouterr()
  assert [label for label, _ in lab.calls] == ["hierarchical", "gtopk", "hitopk"]
  assert f"error: gtopk@0.01 failed: {NODE_FAILED.splitlines()[0].rstrip(':')}\n" in err and "Traceback" not in err
  assert code not in (0, None) and "gtopk@0.01 failed" in str(code)  # after the table: exit status 1
  assert "gtopk@0.01" in out and "no evaluation yet" in out
  assert list(json.loads(out.strip().splitlines()[-1])) == ["hierarchical", "hitopk@0.01"]


def test_the_same_command_reuses_finished_runs_and_resumes_a_cut_one(lab, capsys):
  lab.cut.add("hitopk")
  assert lab("--strategies", "hierarchical,hitopk@0.01") not in (0, None)  # hitopk timed out after an epoch
  lab.cut.clear()
  assert lab("--strategies", "hierarchical,hitopk@0.01") == 0
  # hierarchical finished: reused, not run; hitopk resumed in its workdir (its checkpoint and record kept).
  assert lab.calls == [("hitopk", ["checkpoints", "command.txt", "metrics.jsonl"])]
  assert "hierarchical: reusing" in capsys.readouterr().err
  assert lab("--strategies", "hierarchical", "--set", "seed=1") == 0  # another command: started over
  assert lab.calls == [("hierarchical", ["command.txt"])]
  assert lab("--strategies", "hierarchical", "--set", "seed=1", "--rerun") == 0
  assert lab.calls == [("hierarchical", ["command.txt"])]


def test_report_only_shows_a_run_without_an_evaluation(lab, tmp_path, capsys):
  """One run has two evaluations, one was cut before its first (an empty metrics.jsonl), one has no workdir."""
  lab("--strategies", "hierarchical")
  (tmp_path / "hitopk@0.01").mkdir()
  (tmp_path / "hitopk@0.01" / "metrics.jsonl").write_text("")
  capsys.readouterr()
  assert lab("--strategies", "hierarchical,hitopk@0.01,gtopk@0.01", "--report_only") == 0
  out, err = capsys.readouterr()
  rows = {line.split()[0]: line for line in out.splitlines() if line.split() and "@" in line.split()[0]}
  assert "no evaluation yet" in rows["hitopk@0.01"] and "no evaluation yet" in rows["gtopk@0.01"]
  assert list(json.loads(out.strip().splitlines()[-1])) == ["hierarchical"] and "Traceback" not in err
  # A --workdir that does not exist (a mistyped one) printed "no evaluation yet" for each, exit 0.
  assert lab("--strategies", "hierarchical", "--report_only", f"--workdir={tmp_path / 'nope'}") == 2
  assert f"--workdir={tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_report_only_leaves_out_a_run_of_another_command(lab, tmp_path, capsys):
  """A run made at 50 Mbit/s is not reported under the title of a report at 10 Mbit/s."""
  lab("--strategies", "hierarchical,hitopk@0.01")
  capsys.readouterr()
  results = (tmp_path / "results.json").read_text()
  assert lab("--strategies", "hierarchical,hitopk@0.01", "--bandwidth", "10mbit", "--report_only") == 0
  out, err = capsys.readouterr()
  assert "hierarchical: left out: " in err and "holds a run of another command: train.py" in err
  assert err.count("left out") == 2 and err.rstrip().endswith("# on 2 x 4 at 50mbit")
  assert json.loads(out.strip().splitlines()[-1]) == {}
  assert (tmp_path / "results.json").read_text() == results  # the 50 Mbit/s figures, not overwritten
  assert lab("--strategies", "hierarchical", "--report_only") == 0  # the command that made it: reported
  assert list(json.loads(capsys.readouterr()[0].strip().splitlines()[-1])) == ["hierarchical"]


def test_a_plot_whose_folder_cannot_be_made_is_refused_before_any_run(lab, tmp_path, monkeypatch, capsys):
  assert lab("--strategies", "hierarchical", "--plot", "/proc/nope/curves.png") == 2 and lab.calls == []
  assert capsys.readouterr().err.startswith("error: --plot=/proc/nope/curves.png: cannot make its folder")
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}", "--plot=/proc/nope/p.png"])
  with pytest.raises(SystemExit) as info:  # a study: before its first run
    train_runs.study("a study", {"good": ("c.py", [], "")}, "runs", "")
  assert info.value.code == 2 and not (tmp_path / "runs").exists()
  monkeypatch.setattr(sys, "argv", ["mesh_lab.py", "--loopback", "--plot=/proc/nope/p.png"])
  with pytest.raises(SystemExit) as info:
    mesh_lab.main()
  assert info.value.code == 2 and capsys.readouterr().err.startswith("error: --plot=/proc/nope/p.png: cannot make")


FIT = {"intra": {"alpha": 1e-5, "beta": 1e-10}, "inter": {"alpha": 1e-4, "beta": 1e-9}}


def _mesh_lab(monkeypatch, run_cell, calibrate=lambda cluster, local, out: (FIT, "")):
  """mesh_lab.main in the 127.0.0.1 mode, with stand-ins for the calibration and the cells' runs."""
  monkeypatch.setattr(mesh_lab, "calibrate_on_cluster", calibrate)
  monkeypatch.setattr(mesh_lab, "run_cell", run_cell)
  monkeypatch.setattr(mesh_lab, "LoopbackCluster", lambda nodes: LoopbackCluster(nodes))
  monkeypatch.setattr(sys, "argv", ["mesh_lab.py", "--loopback", "--bandwidth", "unshaped", "--strategies",
                                    "hitopk@0.01,hierarchical"])  # fmt: skip
  with pytest.raises(SystemExit) as info:
    mesh_lab.main()
  return info.value.code


def test_a_failed_mesh_lab_cell_is_one_line_and_the_table_keeps_the_others(monkeypatch, capsys):
  def run_cell(cluster, args, strategy_overrides, workdir, links):
    if "--config.comm.strategy=hitopk" in strategy_overrides:
      raise RuntimeError(NODE_FAILED)
    return {"step_seconds": 0.2, "inter_node_bytes_per_step": 1000, "wire_bytes_per_step": None, "comm_buckets": [],
            "wire_itemsize": 4, "compact_pairs": False, "strategy": "hierarchical"}  # fmt: skip

  code = _mesh_lab(monkeypatch, run_cell)
  out, err = capsys.readouterr()
  assert "error: hitopk@0.01@unshaped failed: `python train.py` on node 1 exited 1" in err and "Traceback" not in err
  assert code not in (0, None) and "hitopk@0.01@unshaped" in str(code)
  assert "hierarchical@unshaped" in out and list(json.loads(out.strip().splitlines()[-1])) == ["hierarchical@unshaped"]


def test_a_failed_calibration_leaves_out_its_cells_and_still_prints_the_table(monkeypatch, capsys):
  def calibrate(cluster, local, out):
    raise RuntimeError(NODE_FAILED.replace("train.py", "calibrate_links.py"))

  def run_cell(*args):
    raise AssertionError("a cell ran without its calibration")

  code = _mesh_lab(monkeypatch, run_cell, calibrate)
  out, err = capsys.readouterr()
  assert "error: the calibration at unshaped failed: `python calibrate_links.py` on node 1" in err
  assert code not in (0, None) and out.strip().splitlines()[-1] == "{}"


STUDY_TRAIN_PY = """
import json, os, sys
from light_jax import cli
workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
if "--bad" in sys.argv:
  sys.exit(2)  # train.py refused its input
config = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--config="))
overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
  f.write(json.dumps({"step": 10, "train_seconds": 1.0, "inter_node_bytes_per_step": 8}) + "\\n")
summary = {"config": cli.resolve_config(config, overrides).to_dict(), "final_eval_top1": 0.9, "final_eval_top5": 0.99,
           "images_per_sec_mean": 100.0, "inter_node_bytes_per_step": 8, "intra_node_bytes_per_step": 8,
           "nonfinite_steps": 0}
open(os.path.join(workdir, "summary.json"), "w").write(json.dumps(summary))
"""
# The stand-in's config file, in its ROOT: its rows' configs resolve (a study compares a finished run's config).
STUDY_CONFIG_PY = """
from light_jax.config import base_config

def get_config():
  config = base_config()
  config.global_batch_size, config.num_epochs = 256, 1
  return config
"""


def _study_stand_in(tmp_path, monkeypatch):
  """train.py and c.py of a study's stand-in in ``tmp_path``, made its ROOT."""
  (tmp_path / "train.py").write_text(STUDY_TRAIN_PY)
  (tmp_path / "c.py").write_text(STUDY_CONFIG_PY)
  monkeypatch.setattr(train_runs, "ROOT", str(tmp_path))
  monkeypatch.syspath_prepend(ROOT)  # c.py imports light_jax


def test_a_study_run_that_fails_is_one_line_and_the_later_runs_still_run(tmp_path, monkeypatch, capsys):
  _study_stand_in(tmp_path, monkeypatch)
  runs = {"bad": ("c.py", ["--bad"], ""), "good": ("c.py", [], "")}
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}"])
  args, results, stopped = train_runs.study("a study", runs, "runs", "")
  err = capsys.readouterr().err
  assert list(results) == ["good"] and not stopped and args.failed == ["bad"]
  line = next(line for line in err.splitlines() if line.startswith("error:"))
  assert line.startswith("error: bad failed: train.py exited 2; train.py refused its input: fix the config or flag")
  assert "--rerun starts the run over" not in err and "Traceback" not in err
  # A damaged metrics.jsonl of one run: named in one line, the others still reported.
  (tmp_path / "runs" / "good" / "metrics.jsonl").write_text('{"step": 4, "ep\n{"step": 8}\n')
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}", "--report_only"])
  args, results, _ = train_runs.study("a study", runs, "runs", "")
  assert args.failed == ["good"] and "error: good: " in capsys.readouterr().err
  # A damaged summary.json (a JSONDecodeError traceback before): named in one line too.
  (tmp_path / "runs" / "good" / "metrics.jsonl").write_text('{"step": 10, "train_seconds": 1.0}\n')
  (tmp_path / "runs" / "good" / "summary.json").write_text('{"config": ')
  args, results, _ = train_runs.study("a study", runs, "runs", "")
  err = capsys.readouterr().err
  assert args.failed == ["good"] and "summary.json is not a finished run's summary (JSONDecodeError" in err
  # A --workdir where nothing can be written: refused before any run (each failed with a traceback).
  with tmpfs(tmp_path / "read_only", "ro,size=1m") as folder:
    monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={folder / 'runs'}"])
    with pytest.raises(SystemExit):
      train_runs.study("a study", runs, "runs", "")
  assert f"--workdir={folder / 'runs'}: cannot write in {folder} (Read-only file system)" in capsys.readouterr().err


def test_the_large_batch_report_compares_with_the_batch_256_run_outside_only(tmp_path, monkeypatch, capsys):
  """The "vs 256" column was blank unless the batch-256 row was in --only (docs/measurements.md showed such tables)."""
  import large_batch

  _study_stand_in(tmp_path, monkeypatch)
  runs = {"ref": ("c.py", [], "the reference"), "big": ("c.py", ["--config.seed=1"], "a large batch")}
  monkeypatch.setattr(large_batch, "RUNS", runs)
  monkeypatch.setattr(large_batch, "REFERENCE", {1: "ref"})
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}"])
  train_runs.study("a study", runs, "runs", "")
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}", "--only=big", "--report_only"])
  args, results, stopped = train_runs.study("a study", runs, "runs", "")
  assert list(results) == ["big"] and large_batch.reference_top1(args.workdir, results) == {1: 0.9}
  capsys.readouterr()
  monkeypatch.setattr(large_batch, "epoch_table", lambda results: None)  # the stand-in's records have no epochs
  large_batch.report(results, stopped, large_batch.reference_top1(args.workdir, results))
  row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("big"))
  assert " +0.00 " in row
  # compression_accuracy.py's "vs dense" column, the same way (it was blank there too).
  import compression_accuracy

  monkeypatch.setattr(compression_accuracy, "RUNS", runs)
  monkeypatch.setattr(compression_accuracy, "DENSE", "ref")
  compression_accuracy.main()
  row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("big"))
  assert " +0.00 " in row
  # A reference run another command made (another seed, say) is not this row's: no comparison.
  (tmp_path / "runs" / "ref" / "command.txt").write_text("train.py --config=c.py --config.seed=7")
  assert large_batch.reference_top1(args.workdir, results) == {}


def test_a_study_names_rows_it_cannot_read_or_resolve_and_refuses_an_empty_report(tmp_path, monkeypatch, capsys):
  """A finished row whose command no longer resolves (a field renamed since) stopped the study with a traceback;
  --report_only of rows that never ran printed an empty table with exit 0; a row refused for a folder of the user's
  own was still read into the table."""
  _study_stand_in(tmp_path, monkeypatch)
  runs = {"renamed": ("c.py", ["--config.optimizer.no_such_field=1"], ""), "good": ("c.py", [], ""),
          "mine": ("c.py", ["--config.seed=3"], "")}  # fmt: skip
  (tmp_path / "runs").mkdir()
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}", "--report_only"])
  with pytest.raises(SystemExit) as empty:
    train_runs.study("a study", runs, "runs", "")
  err = capsys.readouterr().err
  assert empty.value.code == 2 and f"--workdir={tmp_path / 'runs'} holds no run of renamed, good, mine" in err, err
  (tmp_path / "runs" / "mine").mkdir()
  (tmp_path / "runs" / "mine" / "metrics.jsonl").write_text('{"step": 10, "train_seconds": 1.0}\n')  # the user's
  # "renamed" ran when its field existed: a finished run, stamped with its command.
  workdir = tmp_path / "runs" / "renamed"
  workdir.mkdir()
  (workdir / "command.txt").write_text(train_runs._stamps(str(workdir), "c.py", runs["renamed"][1])[0])
  (workdir / "metrics.jsonl").write_text('{"step": 10, "train_seconds": 1.0, "inter_node_bytes_per_step": 8}\n')
  (workdir / "summary.json").write_text(json.dumps({"config": {"seed": 0}}))
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}"])
  args, results, stopped = train_runs.study("a study", runs, "runs", "")
  err = capsys.readouterr().err
  assert list(results) == ["good"] and not stopped and sorted(args.failed) == ["mine", "renamed"], err
  assert "error: renamed: the row's command no longer gives a config: --config.optimizer.no_such_field" in err
  assert "Traceback" not in err
  monkeypatch.setattr(sys, "argv", ["large_batch.py", f"--workdir={tmp_path / 'runs'}", "--report_only"])
  args, results, _ = train_runs.study("a study", runs, "runs", "")
  err = capsys.readouterr().err
  assert list(results) == ["good"] and "renamed: left out: " in err and "no longer gives a config" in err, err
