"""The inputs of the mesh lab and its tools, refused early with a message that says what is wrong: bandwidths,
calibration files, strategies and flags; and the cleanup of the 127.0.0.1 cluster. No root or namespaces."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from light_jax.emulated_cluster import LoopbackCluster, parse_rate
from light_jax.parallel import cost_model
from tests.helpers import ROOT, main_refuses

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import mesh_lab  # noqa: E402


def test_parse_rate_reads_rates_and_refuses_what_tc_cannot_shape():
  assert parse_rate("50mbit") == 50_000_000 and parse_rate("1kbit") == 1000 and parse_rate(" Unshaped ") is None
  assert parse_rate("300gbit") == 3 * 10**11
  # What tc would cut short without a word: a 166-byte bucket at 8 bit/s, 14 ms of queue at 400 Gbit/s, not 100.
  for text in ("0.1bit", "8bit", "999bit", "0mbit", "-5mbit", "infbit", "nanbit", "1e400gbit", "301gbit", "1000gbit"):
    with pytest.raises(ValueError, match="must be a rate from 1kbit to 300gbit"):
      parse_rate(text)
  with pytest.raises(ValueError, match="not 'unshaped' or a rate"):
    parse_rate("50mb")


@pytest.mark.parametrize(
  "content, message",
  [
    ('{"intra": {"alpha": 1e-5}, "inter": {"alpha": 1e-5, "beta": 1e-9}}', "'intra' must be {\"alpha\""),
    ('{"intra": {"alpha": 1e-5, "beta": 1e-9}, "inter": {"alpha": 1e-5, "bta": 1e-9}}', "'inter' must be"),
    ('{"intra": {"alpha": 1e-5, "beta": 1e-9}}', "'inter' must be .*not None"),
    ("[1, 2]", "'intra' must be"),
    ('{"intra": {"alpha": 1e-5, "beta": "fast"}, "inter": {"alpha": 0, "beta": 0}}', "intra.beta='fast' must be"),
    ('{"intra": {"alpha": -1, "beta": 0}, "inter": {"alpha": 0, "beta": 0}}', "intra.alpha=-1 must be"),
    ('{"intra": {"alpha": 1e-5, "beta": 1e-9},', "cannot read it as JSON"),
  ],
)
def test_a_bad_calibration_file_is_a_value_error_naming_it(tmp_path, content, message):
  path = tmp_path / "links.json"
  path.write_text(content)
  with pytest.raises(ValueError, match=message) as info:
    cost_model.load(str(path))
  assert str(path) in str(info.value)


def test_a_calibration_file_loads_and_a_missing_one_is_named(tmp_path):
  path = tmp_path / "links.json"
  path.write_text('{"intra": {"alpha": 1e-5, "beta": 0.0}, "inter": {"alpha": 5e-5, "beta": 1e-9}}')
  assert cost_model.load(str(path)).inter == cost_model.LinkCost(5e-5, 1e-9)
  with pytest.raises(ValueError, match="neither a preset"):
    cost_model.load(str(tmp_path / "missing.json"))


def _lab_args(**changes):
  args = dict(bandwidth="50mbit,unshaped", strategies="hierarchical,hitopk@0.001", loopback=False, plot=None, steps=30,
              warmup=5, config="configs/fashion_mnist.py", set=[], peer_timeout=60.0, timeout=900.0)  # fmt: skip
  return argparse.Namespace(**{**args, **changes})


def test_mesh_lab_bandwidth_labels_are_normalised_once():
  rates, requested = mesh_lab.check_args(_lab_args(bandwidth="50MBit, Unshaped"), [(2, 4)])
  assert rates == {"50mbit": 50_000_000, "unshaped": None}  # the cells' keys and the unshaped lookups agree
  assert [label for label, _ in requested] == ["hierarchical", "hitopk@0.001"]


def test_mesh_lab_warns_once_that_dense_in_bfloat16_crosses_the_cpus_links_in_float32(capsys):
  """XLA's CPU backend widens a bfloat16 all-reduce to float32: the cell's bytes and prediction were half the real."""
  mesh_lab.check_args(_lab_args(strategies="dense/bfloat16,hierarchical/bfloat16,dense"), [(2, 4), (1, 8)])
  warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
  assert warnings == [
    "warning: dense/bfloat16: on CPU devices XLA carries dense's bfloat16 all-reduce as float32: twice the bytes its "
    "row counts and its prediction assumes"
  ]


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"loopback": True}, "the 127.0.0.1 mode cannot shape links \\(50mbit"),
    ({"strategies": "hierarchical,hitopkk"}, "'hitopkk' is unknown; use one of"),
    ({"strategies": "hitopk@abc"}, "'abc' is not a valid comm.density"),
    ({"strategies": "diloco@0"}, "sync_every"),
    ({"strategies": "hierarchical/float16"}, "neither a wire dtype"),
    ({"bandwidth": "unshaped", "plot": "lab.png"}, "needs an unshaped and a shaped"),
    ({"bandwidth": "0.1bit,unshaped"}, "from 1kbit to 300gbit"),
    ({"steps": 0}, "--steps 0 must be at least 1"),  # no step to take the median of, after a whole run
    ({"warmup": -1}, "--warmup -1 must be at least 0"),  # would keep the wrong records
    # Every cell failed after the calibrations (nan: a hung cell was never stopped).
    ({"peer_timeout": 0.0}, "--peer_timeout 0.0 must be a number of seconds > 0"),
    ({"timeout": float("nan")}, "--timeout nan must be a number of seconds > 0"),
    # What train.py would refuse in every cell, after the calibrations:
    ({"set": ["optimizer.bse_lr=0.1"]}, "hierarchical on 2 x 4: --config.optimizer.bse_lr: no such config field; Did"),
    ({"set": ["comm.compact_pairs=true"]}, "hierarchical on 2 x 4: .*compact"),
    # The first cell failed on it, after the calibrations, and every other cell then too.
    ({"set": ["data.data_dir=/nonexistent"]}, "the runs' data: Fashion-MNIST not found: missing /nonexistent/train"),
  ],
)
def test_mesh_lab_refuses_bad_arguments_before_any_run(changes, message):
  with pytest.raises(ValueError, match=message):
    mesh_lab.check_args(_lab_args(**changes), [(2, 4)])


@pytest.mark.parametrize("mesh", [(2, 0), (0, 4)])
def test_mesh_lab_refuses_an_empty_mesh_before_any_run(mesh):
  with pytest.raises(ValueError, match=f"a mesh of {mesh[0]} x {mesh[1]} .*each must be at least 1"):
    mesh_lab.check_args(_lab_args(), [(2, 4), mesh])


def test_mesh_lab_refuses_a_run_one_of_its_meshes_cannot_take():
  args = _lab_args(strategies="hitopk@0.01,gtopk@0.01")
  with pytest.raises(ValueError, match="hitopk@0.01 on 3 x 2: global_batch_size=256 does not divide over 6 devices"):
    mesh_lab.check_args(args, [(2, 4), (3, 2)])
  args.set = ["global_batch_size=192", "data.eval_batch_size=600"]
  with pytest.raises(ValueError, match="gtopk@0.01 on 3 x 2: comm.strategy='gtopk' pairs devices by the bits"):
    mesh_lab.check_args(args, [(2, 4), (3, 2)])


@pytest.mark.parametrize("variant", ["gtopk_4x2", "shapes", "auto", "strategies"])
def test_the_mesh_experiments_pass_the_checks(variant):
  args = _lab_args()
  meshes = mesh_lab.load_experiment(f"configs/mesh_experiments.py:{variant}", args)
  mesh_lab.check_args(args, meshes)


_EXPERIMENT = """
import ml_collections
def get_config(variant=None):
  return ml_collections.ConfigDict(dict(meshes=MESHES, bandwidths=["unshaped"], strategies=["hierarchical"], steps=2,
                                        warmup=0, config="configs/fashion_mnist.py", overrides=[]))
"""


@pytest.mark.parametrize(
  "meshes, error",
  [
    ("[]", r"meshes is empty; give at least one \[nodes, devices per node\]"),  # exit 0, an empty table
    (
      "[[2, 'four']]",
      r"meshes holds \[2, 'four'\]; each mesh is \[nodes, devices per node\], two integers",
    ),  # TypeError
    ("[[2, 4,]", r"experiment.py, line 5: closing parenthesis .* see configs/mesh_experiments.py$"),  # a traceback
  ],
)
def test_a_mesh_experiment_that_cannot_run_is_refused_in_one_line(tmp_path, meshes, error):
  path = tmp_path / "experiment.py"
  path.write_text(_EXPERIMENT.replace("MESHES", meshes))
  with pytest.raises(ValueError, match=error):
    mesh_lab.load_experiment(str(path), _lab_args())


def test_a_ctrl_c_stops_the_mesh_lab_in_one_line(monkeypatch, capsys):
  """It was a KeyboardInterrupt traceback (the mesh's processes and namespaces were cleaned up all the same)."""

  def interrupted(*args):
    raise KeyboardInterrupt

  monkeypatch.setattr(mesh_lab, "run_mesh", interrupted)
  argv = ["mesh_lab.py", "--loopback", "--bandwidth", "unshaped", "--nodes", "2", "--local", "1", "--steps", "1"]
  monkeypatch.setattr(sys, "argv", argv)
  with pytest.raises(SystemExit) as stopped:
    mesh_lab.main()
  assert stopped.value.code == 130
  assert capsys.readouterr().err == "stopped by Ctrl-C during the 2 x 1 mesh; meshes finished before it: none\n"


def test_mesh_lab_checks_the_runs_with_the_cost_model_its_cells_use():
  # The cells plan auto with the calibration the lab writes: a config naming a file not written yet still runs.
  args = _lab_args(strategies="auto@0.01", set=["comm.cost_model=runs/not_calibrated_yet.json"])
  with pytest.raises(ValueError, match="neither a preset"):  # a --set comes after the lab's own, as in the cells
    mesh_lab.check_args(args, [(2, 4)])
  args.set = []
  args.config = "configs/fashion_mnist.py:hitopk"
  mesh_lab.check_args(args, [(2, 4)])


def test_mesh_lab_refuses_a_strategy_given_twice():
  with pytest.raises(ValueError, match=r"--strategies names hitopk@0.01 more than once; give each strategy once"):
    mesh_lab.check_args(_lab_args(strategies="hitopk@0.01,hierarchical,hitopk@0.01"), [(2, 4)])


def test_mesh_lab_accepts_every_strategy_the_config_does():
  _, requested = mesh_lab.check_args(_lab_args(strategies="auto@0.01,powersgd@2,diloco@4,gtopk@0.01/compact"), [(2, 4)])
  assert len(requested) == 4


# Each script's entry point once, as a subprocess; its other refusals in this process (tests/helpers.py main_refuses).
@pytest.mark.parametrize(
  "script, argv, message",
  [
    ("mesh_lab.py", ["--loopback"], "the 127.0.0.1 mode cannot shape links"),
    ("fault_drill.py", ["--every_steps", "96"], "--every_steps 96 leaves no room for kills"),
    ("fault_drill.py", ["--workdir", "README.md"], "--workdir=README.md: README.md is a file; give a folder"),
    ("time_to_accuracy.py", ["--report_only", "--strategies", "hitopk@abc"], "is not a valid comm.density"),
    (
      "large_batch.py",
      ["--report_only", "--workdir", "README.md"],
      "--workdir=README.md: README.md is a file; give a folder",
    ),
    ("calibrate_links.py", ["--nodes", "0"], "argument --nodes: 0 must be >= 1"),
  ],
)
def test_the_lab_scripts_exit_with_a_usage_error(script, argv, message):
  result = subprocess.run([sys.executable, f"benchmarks/{script}", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
  assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
  assert "Traceback" not in result.stderr and "calibrating" not in result.stderr and result.stdout == ""


def test_calibrate_links_refuses_a_mesh_that_does_not_fit_the_devices(tmp_path):
  """8 devices set for the process, a mesh of 3 x 4: a MeshError traceback before."""
  result = subprocess.run(
    [sys.executable, "benchmarks/calibrate_links.py", "--nodes=3", f"--out={tmp_path}/links.json"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8"),
  )
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "error: mesh 3 x 4 = 12 devices, but 8 are available; set --nodes and --local so that" in result.stderr


@pytest.mark.parametrize(
  "script, argv, message",
  [
    ("mesh_lab.py", ["--strategies", "hitopkk"], "'hitopkk' is unknown"),
    ("mesh_lab.py", ["--experiment", "configs/mesh_experiments.py:nope"], "unknown variant 'nope'"),
    ("mesh_lab.py", ["--experiment", "configs/fashion_mnist.py"], "configs/fashion_mnist.py is not a mesh experiment"),
    ("mesh_lab.py", ["--experiment", "configs/"], "no such file: configs/; give a mesh experiment config"),
    ("mesh_lab.py", ["--experiment", "README.md"], "README.md is not a Python file"),  # a traceback
    (  # the lab's own --config.mesh.nodes was named, and fashion_mnist.py called no training config
      "mesh_lab.py",
      ["--loopback", "--bandwidth", "unshaped", "--set", "nodes=2"],
      "--config.nodes: no such config field; did you mean --config.mesh.nodes?",
    ),
    (  # "--config.config.num_epochs: no such config field"
      "mesh_lab.py",
      ["--loopback", "--bandwidth", "unshaped", "--set", "config.num_epochs=3"],
      "--set 'config.num_epochs=3': give FIELD=VALUE without --config., e.g. --set num_epochs=3",
    ),
    ("mesh_lab.py", ["--loopback", "--bandwidth", "unshaped", "--set", "foo=1"], "--config.foo: no such config"),
    ("time_to_accuracy.py", ["--report_only", "--local", "0"], "--local 0: each must be at least 1"),
    ("time_to_accuracy.py", ["--report_only", "--target", "92"], "--target 92 must be a top-1 fraction"),
    ("time_to_accuracy.py", ["--report_only", "--timeout", "0"], "--timeout 0.0 must be a number of seconds > 0"),
    (  # the first run failed on it, on the emulated cluster
      "time_to_accuracy.py",
      ["--set", "data.data_dir={tmp}/none", "--workdir", "{tmp}/runs"],
      "the runs' data: Fashion-MNIST not found: missing {tmp}/none/train",
    ),
    (
      "time_to_accuracy.py",
      ["--report_only", "--workdir", "README.md"],
      "--workdir=README.md: README.md is a file; give a",
    ),
    (
      "calibrate_links.py",
      ["--out", "/proc/light_jax_nope/links.json"],
      "--out=/proc/light_jax_nope/links.json: canno",
    ),
    (  # --out: not its default runs/links.json, whose folder it would make in the repository
      "calibrate_links.py",
      ["--emulate", "fast", "--out", "{tmp}/links.json"],
      "--emulate=fast: bandwidth 'fast' is not 'unshaped' or a rate",
    ),
    # --rerun dropped without a word; an empty table for a mistyped --workdir.
    ("large_batch.py", ["--report_only", "--rerun"], "--report_only runs nothing, so it cannot --rerun"),
    ("large_batch.py", ["--report_only", "--workdir", "{tmp}/none"], "--workdir={tmp}/none does not exist"),
    ("large_batch.py", ["--report_only", "--workdir", "{tmp}", "--plot", ""], "--plot= is empty; give a file's path"),
    # Measured from 2 sizes instead of 9 (and nan: "beta": 0.0, a link of no cost), or an IndexError traceback.
    ("calibrate_links.py", ["--max_seconds", "nan", "--out", "{tmp}/l.json"], "--max_seconds nan must be a number"),
    ("calibrate_links.py", ["--coordinator", "foo", "--out", "{tmp}/l.json"], "--coordinator=foo: expected host:port"),
    (
      "calibrate_links.py",
      ["--num_processes", "2", "--process_id", "5", "--out", "{tmp}/l.json"],
      "--process_id=5: the processes are numbered 0 to --num_processes - 1 (1)",
    ),
  ],
)
def test_the_lab_scripts_refuse_bad_arguments_before_any_work(script, argv, message, tmp_path, monkeypatch, capsys):
  err = main_refuses(monkeypatch, capsys, f"benchmarks/{script}", *(arg.format(tmp=tmp_path) for arg in argv))
  assert message.format(tmp=tmp_path) in err and "calibrating" not in err, err[-2000:]


@pytest.mark.parametrize(
  "script, argv",
  [
    ("mesh_lab.py", []),
    ("time_to_accuracy.py", ["--workdir", "{tmp}/runs"]),
    ("calibrate_links.py", ["--emulate", "50mbit", "--out", "{tmp}/links.json"]),
  ],
)
def test_the_lab_scripts_say_they_need_root_as_bad_input(script, argv):
  """Run as a normal user: the one line that says root is needed, exit 2 (bad input), before any work."""
  if os.geteuid() != 0 or not shutil.which("setpriv"):
    pytest.skip("needs root and setpriv, to run the script as another user")
  with tempfile.TemporaryDirectory() as tmp:  # not in tmp_path: pytest's root folder is root's alone
    os.chmod(tmp, 0o777)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    argv = [arg.format(tmp=tmp) for arg in argv]
    result = subprocess.run([*as_nobody, sys.executable, f"benchmarks/{script}", *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": tmp})  # fmt: skip
    if "Permission denied" in result.stderr and "needs root" not in result.stderr:
      pytest.skip(f"another user cannot read the checkout or its venv here: {result.stderr[-300:]}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "an emulated cluster needs root" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert os.listdir(tmp) in ([], ["runs"])  # no run was started, nothing written


def test_time_to_accuracy_finds_a_finished_run_whose_config_has_changed_since(tmp_path):
  """The same command after an edit of the config file reused (and reported) the run of the old values."""
  import time_to_accuracy
  from mesh_lab import cluster_mesh

  from light_jax import cli

  args = argparse.Namespace(nodes=2, local=4, config="configs/fashion_mnist.py")
  overrides = ["--config.comm.strategy=hitopk", "--config.num_epochs=2"]
  recorded = cli.resolve_config(args.config, [*cluster_mesh(2, 4), *overrides]).to_dict()  # as train.py ran it
  assert time_to_accuracy.stale(args, str(tmp_path), overrides) == ""  # no finished run
  (tmp_path / "summary.json").write_text(json.dumps({"config": recorded}))
  assert time_to_accuracy.stale(args, str(tmp_path), overrides) == ""
  recorded["optimizer"]["base_lr"] = 0.4  # the file's value when the run was made
  (tmp_path / "summary.json").write_text(json.dumps({"config": recorded}))
  assert "optimizer.base_lr" in time_to_accuracy.stale(args, str(tmp_path), overrides)
  (tmp_path / "summary.json").write_text('{"config": ')  # damaged: left to the records
  assert time_to_accuracy.stale(args, str(tmp_path), overrides) == ""


def test_time_to_accuracy_keeps_the_other_strategies_results_of_the_same_cluster(tmp_path):
  """A command for one strategy (or --report_only for some) replaced results.json with its rows alone: the figures
  of hours of runs were gone."""
  import time_to_accuracy

  path = str(tmp_path / "results.json")
  args = argparse.Namespace(
    bandwidth="50mbit", nodes=2, local=4, target=0.92, config="configs/fashion_mnist.py", set=[], workdir=str(tmp_path)
  )
  time_to_accuracy.write_results(path, args, {"hierarchical": {"seconds_to_target": 900.0}})
  time_to_accuracy.write_results(path, args, {"gtopk@0.01": {"seconds_to_target": 400.0}})
  with open(path) as f:
    assert json.load(f) == {
      "bandwidth": "50mbit",
      "mesh": [2, 4],
      "target": 0.92,
      "config": "configs/fashion_mnist.py",
      "set": [],
      "hierarchical": {"seconds_to_target": 900.0},
      "gtopk@0.01": {"seconds_to_target": 400.0},
    }
  # The config file changed since gtopk's run: its figures are another setting's, dropped from the file.
  from mesh_lab import cluster_mesh

  from light_jax import cli

  _, gtopk = time_to_accuracy.parse_strategy("gtopk@0.01")
  recorded = cli.resolve_config(args.config, [*cluster_mesh(2, 4), *gtopk]).to_dict()
  recorded["optimizer"]["base_lr"] = 0.4
  (tmp_path / "gtopk@0.01").mkdir()
  (tmp_path / "gtopk@0.01" / "summary.json").write_text(json.dumps({"config": recorded}))
  time_to_accuracy.write_results(path, args, {"hierarchical": {"seconds_to_target": 800.0}})
  with open(path) as f:
    assert "gtopk@0.01" not in json.load(f)
  # --rerun of hierarchical whose new run failed before its first evaluation: its old figures' run is gone.
  time_to_accuracy.write_results(path, args, {"dense": {}}, asked=["hierarchical", "dense"])
  with open(path) as f:
    assert "hierarchical" not in json.load(f)
  for other in ({"bandwidth": "10mbit"}, {"set": ["num_epochs=1"]}):  # another link, a smoke run: not comparable
    time_to_accuracy.write_results(path, argparse.Namespace(**{**vars(args), **other}), {"dense": {}})
    with open(path) as f:
      assert set(json.load(f)) == {"bandwidth", "mesh", "target", "config", "set", "dense"}
    time_to_accuracy.write_results(path, args, {"hierarchical": {}})


def _cell(buckets, step_seconds=0.5, strategy="hierarchical"):
  return {"step_seconds": step_seconds, "comm_buckets": buckets, "wire_itemsize": 4, "compact_pairs": False,
          "strategy": strategy}  # fmt: skip


UNSHAPED_FIT = {"intra": {"alpha": 1e-5, "beta": 1e-10}, "inter": {"alpha": 1e-4, "beta": 1e-9}}
SHAPED_FIT = {"intra": {"alpha": 1e-5, "beta": 1e-10}, "inter": {"alpha": 1e-3, "beta": 1e-7}}


def test_mesh_lab_prediction_takes_each_cells_own_buckets():
  """The unshaped step loses its own collectives and gains the shaped cell's (adaptive fusion and auto plan
  different buckets at each bandwidth); with the same buckets it is the simulator's move_measured_step."""
  from light_jax import simulation

  bucket = [("hierarchical", 1_000_000, 0)]
  same = mesh_lab.predict_step(_cell(bucket), _cell(bucket), UNSHAPED_FIT, SHAPED_FIT, 2, 4)
  moved_to = cost_model.ClusterCost.from_dict({**UNSHAPED_FIT, "inter": SHAPED_FIT["inter"]})
  buckets = [simulation.BucketComm("hierarchical", 1_000_000, 0)]
  unshaped = cost_model.ClusterCost.from_dict(UNSHAPED_FIT)
  assert same == pytest.approx(simulation.move_measured_step(0.5, buckets, unshaped, moved_to, 2, 4))
  # No collectives in the unshaped cell: its whole step is compute, and the shaped cell's are added to it.
  shaped_only = mesh_lab.predict_step(_cell([]), _cell(bucket), UNSHAPED_FIT, SHAPED_FIT, 2, 4)
  assert shaped_only == pytest.approx(0.5 + moved_to.reduction_seconds("hierarchical", 1_000_000, 2, 4))
  assert shaped_only > same


@pytest.mark.parametrize("strategy", ["hitopk", "diloco"])
def test_a_cells_step_leaves_out_the_warmup_and_the_last_step_and_takes_diloco_over_whole_periods(
  tmp_path, monkeypatch, strategy
):
  """The run takes warmup + steps + 1 steps; the last, the run's end (a DiLoCo sync off its period), is left out.
  A DiLoCo step crosses the machines every sync_every steps: its cell is the mean over whole periods, not the
  median."""
  args = _lab_args(warmup=2, steps=9, local=4, config="configs/fashion_mnist.py", timeout=60, peer_timeout=6)

  def train_on_cluster(cluster, local, config, overrides, workdir, peer_timeout, timeout):
    assert f"--config.max_steps={2 + 9 + 1}" in overrides
    os.makedirs(workdir)
    with open(os.path.join(workdir, "step_times.jsonl"), "w") as f:
      for step in range(1, 13):  # a sync after steps 4, 8 and 12 (the run's end)
        sync = step % 4 == 0
        seconds = 9.0 if step == 12 else 1.0 if sync else 0.1 * step
        f.write(json.dumps({"step": step, "seconds": seconds, "sent_bytes": 1000 if sync else 10}) + "\n")
    comm = {"strategy": strategy, "sync_every": 4, "dtype": "float32", "compact_pairs": False}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({"inter_node_bytes_per_step": 1, "comm_buckets": [], "config": {"comm": comm}}, f)

  monkeypatch.setattr(mesh_lab, "train_on_cluster", train_on_cluster)
  with LoopbackCluster(2) as cluster:
    cell = mesh_lab.run_cell(cluster, args, [], str(tmp_path / "cell"), "links.json")
  if strategy == "diloco":  # steps 5-8, the one whole period among steps 3-11
    assert cell["step_seconds"] == pytest.approx((0.5 + 0.6 + 0.7 + 1.0) / 4)
  else:  # the median of steps 3-11: 0.3, 1.0, 0.5, 0.6, 0.7, 1.0, 0.9, 1.0, 1.1
    assert cell["step_seconds"] == pytest.approx(0.9)


def test_a_cell_whose_run_ended_before_its_timed_steps_fails_by_name(tmp_path, monkeypatch):
  """A config whose whole run is shorter than --warmup + --steps + 1 (12 steps for 2 + 30 + 1): the cell took the
  median of the steps there were, under a header that says 30."""
  args = _lab_args(warmup=2, steps=30, local=4, config="configs/fashion_mnist.py", timeout=60, peer_timeout=6)

  def train_on_cluster(cluster, local, config, overrides, workdir, peer_timeout, timeout):
    os.makedirs(workdir)
    with open(os.path.join(workdir, "step_times.jsonl"), "w") as f:
      f.writelines(json.dumps({"step": step, "seconds": 0.1, "sent_bytes": 10}) + "\n" for step in range(1, 13))

  monkeypatch.setattr(mesh_lab, "train_on_cluster", train_on_cluster)
  with LoopbackCluster(2) as cluster, pytest.raises(RuntimeError, match="the run took 12 steps, fewer than --warm"):
    mesh_lab.run_cell(cluster, args, [], str(tmp_path / "cell"), "links.json")


def test_mesh_lab_refuses_diloco_steps_that_may_hold_no_whole_period():
  with pytest.raises(ValueError, match="diloco@8: --steps 14 may hold no whole period of 8 steps"):
    mesh_lab.check_args(_lab_args(strategies="diloco@8", steps=14), [(2, 4)])
  mesh_lab.check_args(_lab_args(strategies="diloco@8", steps=15), [(2, 4)])


def test_mesh_lab_predicts_a_diloco_step_with_one_sync_in_sync_every():
  """Its buckets are a sync step's, and its step the mean over whole sync periods: the sync's change of time
  counts once in sync_every steps."""
  buckets = [("hierarchical", 1_000_000, 0)]
  every_step = mesh_lab.predict_step(_cell(buckets), _cell(buckets), UNSHAPED_FIT, SHAPED_FIT, 2, 4)
  cell = {**_cell(buckets, strategy="diloco"), "sync_every": 4}
  assert mesh_lab.predict_step(cell, cell, UNSHAPED_FIT, SHAPED_FIT, 2, 4) == pytest.approx(
    0.5 + (every_step - 0.5) / 4
  )
  assert every_step > 0.5 + 0.01  # a shaped link's sync costs time


def test_a_job_past_its_deadline_names_the_node_and_is_killed_at_one_deadline():
  """One deadline for all nodes: node 0 ends after 1 s, node 1 never; the job stops at 1.5 s, not 2.5 s."""
  script = (
    "import sys, time; print('stuck', sys.argv[-1], flush=True); time.sleep(1 if sys.argv[-1][-1] == '0' else 60)"
  )
  with LoopbackCluster(2) as cluster:
    start = time.perf_counter()
    # with what the stuck node said last, for the run is gone (time_to_accuracy keeps no other copy)
    with pytest.raises(
      RuntimeError, match=r"(?s)on node\(s\) 1 still ran after 1.5 s.*last lines:\n  stuck --process_id=1$"
    ):
      cluster.run_everywhere([sys.executable, "-c", script], timeout=1.5)
    assert time.perf_counter() - start < 2.3
    assert cluster._processes == []  # both ended (one killed), and forgotten: close kills no group of theirs


def test_what_an_ended_node_left_running_is_stopped_when_the_job_ends(tmp_path):
  """A node's process that exits leaving a child (a worker holding its output pipe): the child lived on until the
  cluster closed, which then killed the group id (as root), by then maybe another process group's; the job waited
  5 s for the pipe. Now the job kills the group as it collects the node, and forgets it."""
  pid_file = tmp_path / "child.pid"
  script = (
    "import subprocess, sys\n"
    f"child = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
    "print('started', flush=True)\n"
  )
  with LoopbackCluster(1) as cluster:
    start = time.perf_counter()
    assert cluster.run_everywhere([sys.executable, "-c", script], timeout=10) == ["started\n"]
    assert time.perf_counter() - start < 4  # not the readers' 5 s for a pipe the child held
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"
    assert cluster._processes == []


def test_a_node_that_writes_more_than_a_pipe_holds_does_not_stall_the_job(tmp_path):
  """Node 1 writes 1 MiB, then lets node 0 finish (a collective, in miniature): its output is read as it comes,
  not after node 0's, so neither waits on the other. A byte that is not UTF-8 comes back replaced."""
  flag = tmp_path / "node1_done"
  script = (
    "import os, sys, time\n"
    "if sys.argv[-1] == '--process_id=1':\n"
    f"  sys.stdout.write('x' * 2**20); sys.stdout.flush(); open({str(flag)!r}, 'w').close()\n"
    "  sys.stdout.buffer.write(b'\\xff')\n"  # not UTF-8: replaced, not a dead reader
    "else:\n"
    f"  while not os.path.exists({str(flag)!r}): time.sleep(0.01)\n"
    "  print('node 0 done')\n"
  )
  with LoopbackCluster(2) as cluster:
    outputs = cluster.run_everywhere([sys.executable, "-c", script], timeout=10)
  assert outputs[0] == "node 0 done\n" and outputs[1] == "x" * 2**20 + "\ufffd"


def test_sigterm_stops_the_loopback_clusters_processes():
  previous = signal.getsignal(signal.SIGTERM)
  cluster = LoopbackCluster(1)
  sleeper = cluster.run(0, [sys.executable, "-c", "import time; time.sleep(600)"])
  with pytest.raises(SystemExit) as info:
    signal.raise_signal(signal.SIGTERM)
  assert info.value.code == 128 + signal.SIGTERM
  assert sleeper.poll() is not None and signal.getsignal(signal.SIGTERM) == previous


def test_simulate_keys_the_device_sweep_by_simulated_devices_and_takes_a_beta_of_0(tmp_path):
  """--devices_per_node 3: whole machines, so 8 requested devices are 6; calibrate_links.py writes beta 0 for a
  level the mesh lacks, and the printout shows it instead of dividing by it. Batch 252: the points whose device
  count does not divide it (15, 30, 255, ...) are left out, as train.py would refuse them."""
  links = tmp_path / "links.json"
  links.write_text(json.dumps({"intra": {"alpha": 1e-5, "beta": 0.0}, "inter": {"alpha": 5e-5, "beta": 0.0}}))
  result = subprocess.run(
    [sys.executable, "scripts/simulate.py", "--config", "configs/fashion_mnist.py", "--nodes", "2",
     "--devices_per_node", "3", "--config.global_batch_size=252", "--config.data.eval_batch_size=1008",
     "--cost_model", str(links), "--sweep", "devices"],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  assert "inter-node unlimited (beta 0)" in result.stdout
  sweep = json.loads(result.stdout.strip().splitlines()[-1])["sweep"]
  assert list(next(iter(sweep.values()))) == ["6", "63", "126"]
