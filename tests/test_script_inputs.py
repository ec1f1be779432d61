"""The scripts' and benchmarks' bad input: one `error:` line and exit code 2, no traceback (README: scripts exit 2
on bad input); and relative work directories given from outside the repository."""

import contextlib
import functools
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from absl import logging as absl_logging

from light_jax.data import records
from tests.helpers import ROOT, file_locked, load_script, main_refuses, tmpfs, workdir_held

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _fails(script, *args, cwd=ROOT, **env):
  """The one `error:` line of ``python ROOT/script ARGS`` (an absolute ``script`` as it is), which must exit 2."""
  result = subprocess.run(
    [sys.executable, os.path.join(ROOT, script), *args],
    cwd=cwd,
    env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  return errors[0]


def _refused(monkeypatch, capsys, script, *args):
  """``_fails``'s check with ``script``'s main() run in this process (tests/helpers.py main_refuses)."""
  err = main_refuses(monkeypatch, capsys, script, *args)
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, err[-3000:]
  return errors[0]


def test_compare_runs_names_a_bad_run_argument(tmp_path, monkeypatch, capsys):
  # The folders --out needed were made before the refusal, and removed at exit: a refused run leaves nothing.
  nested = tmp_path / "made" / "for" / "it" / "runs.png"
  assert "'dense' is not LABEL=WORKDIR" in _fails("scripts/compare_runs.py", "--out", str(nested), "dense")
  assert not (tmp_path / "made").exists()
  out = str(tmp_path / "runs.png")
  refused = functools.partial(_refused, monkeypatch, capsys)  # the other refusals: in this process
  error = refused("scripts/compare_runs.py", "--out", out, f"dense={tmp_path / 'missing'}")
  assert "missing/metrics.jsonl; give the workdir of a train.py run" in error
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "metrics.jsonl").write_text("")
  assert "holds no evaluation yet" in refused("scripts/compare_runs.py", "--out", out, f"dense={tmp_path / 'empty'}")
  # A folder for --out that cannot be made: said first, not as a traceback once the runs are read and drawn.
  error = refused("scripts/compare_runs.py", "--out", "/proc/nope/runs.png", f"dense={tmp_path / 'empty'}")
  assert error.startswith("error: --out=/proc/nope/runs.png: cannot make its folder")
  (tmp_path / "a_file").write_text("")  # under a file: it said "cannot make its folder (File exists)"
  error = refused("scripts/compare_runs.py", "--out", f"{tmp_path}/a_file/sub/runs.png", f"dense={tmp_path / 'empty'}")
  assert error.endswith(f"{tmp_path}/a_file is a file, not a folder; give a path in a folder")
  # A label given twice: the second run replaced the first's row and curve, without a word.
  (tmp_path / "run").mkdir()
  shutil.copy(os.path.join(ROOT, "docs", "fashion_mnist_metrics.jsonl"), tmp_path / "run" / "metrics.jsonl")
  error = refused("scripts/compare_runs.py", "--out", out, f"a={tmp_path / 'run'}", f"a={tmp_path / 'run'}")
  assert error.endswith("the label 'a' is given twice; give each run its own label")
  # A metrics.jsonl that is a folder, or holds what train.py does not write: tracebacks before.
  (tmp_path / "folder" / "metrics.jsonl").mkdir(parents=True)
  assert "metrics.jsonl (Is a directory)" in refused(
    "scripts/compare_runs.py", "--out", out, f"a={tmp_path / 'folder'}"
  )
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "metrics.jsonl").write_text("[1, 2]\n")
  error = refused("scripts/compare_runs.py", "--out", out, f"a={tmp_path / 'other'}")
  assert "metrics.jsonl, line 1: not a record with a step" in error
  (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 4, "epoch": 1.0, "train_loss": 1.0}\n')
  error = refused("scripts/compare_runs.py", "--out", out, f"a={tmp_path / 'other'}")
  assert error.endswith(
    "holds records without a number in eval_top1, eval_top5, inter_node_bytes_per_step; give the workdir of a run of "
    "this train.py"
  )
  (tmp_path / "other" / "metrics.jsonl").write_text(  # a null (a TypeError traceback in the table before)
    '{"step": 4, "epoch": 1.0, "train_loss": 1.0, "eval_top1": null, "eval_top5": 0.9, '
    '"inter_node_bytes_per_step": 8}\n'
  )
  assert "without a number in eval_top1;" in refused("scripts/compare_runs.py", "--out", out, f"a={tmp_path / 'other'}")


def test_compare_runs_marks_a_run_not_finished_and_says_where_the_plot_is(tmp_path):
  records = (Path(ROOT) / "docs" / "fashion_mnist_metrics.jsonl").read_text().splitlines()
  for name, lines in (("done", records), ("cut", records[:3])):
    (tmp_path / name).mkdir()
    (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  long_label = "hitopk@0.01_dw5_$\\foo$"  # a "$" started matplotlib's math mode: a ParseFatalException
  result = subprocess.run(
    [sys.executable, "scripts/compare_runs.py", "--out", str(tmp_path / "runs.png"), f"done={tmp_path / 'done'}",
     f"{long_label}={tmp_path / 'cut'}"],
    cwd=ROOT, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-2000:]
  header, done, cut = result.stdout.splitlines()[:3]
  assert cut.startswith(long_label + "  ") and cut.endswith("(not finished)") and not done.endswith("(not finished)")
  end = header.index("epochs") + len("epochs")  # every row's epochs end under the header's, the long label's too
  assert done[end - 1].isdigit() and cut[end - 1].isdigit() and cut[end] == " ", (header, done, cut)
  assert f"plot: {tmp_path / 'runs.png'}" in result.stderr and (tmp_path / "runs.png").exists()


def test_kernel_norms_names_a_summary_it_cannot_read(tmp_path):
  (tmp_path / "folder" / "summary.json").mkdir(parents=True)
  assert "summary.json (Is a directory)" in _fails("scripts/kernel_norms.py", str(tmp_path / "folder"))
  (tmp_path / "binary").mkdir()
  (tmp_path / "binary" / "summary.json").write_bytes(b"\xff\xfe")
  assert "summary.json is not JSON" in _fails("scripts/kernel_norms.py", str(tmp_path / "binary"))


def test_kernel_norms_compares_the_resolved_meshes(tmp_path):
  """A config with local=-1 (all devices) ran on the same 2 x 4 mesh as one that names it: not a mismatch."""
  for name, local in (("a", -1), ("b", 4)):
    (tmp_path / name).mkdir()
    config = {"mesh": {"nodes": 2, "local": local}, "model": {"name": "resnet8_fast", "width": 8}, "seed": 0,
              "data": {"dataset": "fashion_mnist"}}  # fmt: skip
    summary = {"mesh": {"nodes": 2, "local": 4}, "config": config}
    (tmp_path / name / "summary.json").write_text(json.dumps(summary))
  error = _fails("scripts/kernel_norms.py", str(tmp_path / "a"), str(tmp_path / "b"))
  assert "no checkpoint under" in error  # past the comparison, at the first run's missing checkpoint
  # One column per run: the same run twice made one column (two folders of one name too, named by path now).
  assert "a workdir is given twice" in _fails("scripts/kernel_norms.py", str(tmp_path / "a"), str(tmp_path / "a"))


def test_input_pipeline_creates_its_workdir_or_says_why_it_cannot(tmp_path, monkeypatch, capsys):
  (tmp_path / "file").write_text("")
  refused = functools.partial(_refused, monkeypatch, capsys)  # in this process; the run below, a subprocess
  error = refused("benchmarks/input_pipeline.py", f"--workdir={tmp_path / 'file' / 'bench'}")
  assert error.endswith(f"--workdir={tmp_path / 'file' / 'bench'}: {tmp_path / 'file'} is a file; give a folder")
  error = refused("benchmarks/input_pipeline.py", "--rounds=0")  # its median of no rounds was a traceback
  assert error.endswith("--images=200 --rounds=0 --seconds=2: each must be > 0 (and finite)")
  error = refused("benchmarks/input_pipeline.py", "--seconds=inf")  # it ran for ever
  assert error.endswith("--seconds=inf: each must be > 0 (and finite)")
  workdir = tmp_path / "new" / "bench"
  command = [sys.executable, os.path.join(ROOT, "benchmarks", "input_pipeline.py"), f"--workdir={workdir}"]
  tiny = ["--images=2", "--rounds=1", "--seconds=0.01"]
  result = subprocess.run(command + tiny, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(workdir)) == ["cache_160.array_record", "cache_256.array_record"]


def test_prepare_image_folder_refuses_an_out_under_a_file(tmp_path):
  (tmp_path / "file").write_text("")
  for split in ("train", "val"):
    (tmp_path / "folder" / split).mkdir(parents=True)
  folder = f"--folder={tmp_path / 'folder'}"
  error = _fails("scripts/prepare_image_folder.py", folder, f"--out={tmp_path / 'file' / 'out'}")
  assert "--out=" in error and "cannot create it (Not a directory)" in error


def test_input_pipeline_removes_its_temporary_workdir(tmp_path):
  tiny = ["--images=2", "--rounds=1", "--seconds=0.01"]
  command = [sys.executable, os.path.join(ROOT, "benchmarks", "input_pipeline.py"), *tiny]
  env = dict(os.environ, TMPDIR=str(tmp_path))
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert not list(tmp_path.glob("input_bench_*"))


def _stopped_by(signum, script, *args, after, stream="stderr", **env):
  """``python ROOT/script ARGS`` sent ``signum`` once a line of its ``stream`` holds ``after``: (exit code, the
  lines of its stderr)."""
  process = subprocess.Popen(
    [sys.executable, os.path.join(ROOT, script), *args],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **env),  # each line as it is printed
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,  # the scripts' few lines on the stream not watched fit its pipe
    text=True,
  )
  watched = process.stderr if stream == "stderr" else process.stdout
  for line in watched:
    if after in line:
      break
  process.send_signal(signum)
  _, err = process.communicate(timeout=60)
  return process.returncode, err.splitlines()


def test_a_signal_stops_a_benchmark_in_one_line_and_removes_what_it_made(tmp_path):
  """A Ctrl-C inside JAX was a KeyboardInterrupt traceback, then a segfault (exit 139); a SIGTERM left the input
  benchmark's temporary folder (megabytes of caches) behind."""
  code, lines = _stopped_by(
    signal.SIGINT, "benchmarks/train_step.py", "--steps=5", "--rounds=50", "--batch=8", "--nodes=1", "--local=1",
    after="compiling",
  )  # fmt: skip
  assert code == 130 and lines[-1] == "stopped by SIGINT while measuring: no result written", lines[-20:]
  code, lines = _stopped_by(
    signal.SIGTERM, "benchmarks/input_pipeline.py", "--images=20", "--rounds=3", after="JPEGs", TMPDIR=str(tmp_path)
  )
  assert code == 143 and lines[-1] == "stopped by SIGTERM while measuring: no result written", lines[-20:]
  assert not any("Traceback" in line for line in lines) and os.listdir(tmp_path) == []


STAND_IN_FAILING_TRAIN_PY = """
import os, sys
workdir = sys.argv[sys.argv.index("--workdir") + 1]
os.makedirs(os.path.join(workdir, "checkpoints", "8"))
print("error: data.data_dir=/nowhere holds no Fashion-MNIST")
sys.exit(2)
"""


def test_fault_drill_stops_at_a_failing_train_py_with_its_output_and_removes_its_temporary_root(tmp_path):
  """A copy of the drill in a repository root of its own, whose train.py fails as one without its data does."""
  (tmp_path / "root" / "benchmarks").mkdir(parents=True)
  for script in ("fault_drill.py", "train_runs.py"):
    shutil.copy(os.path.join(ROOT, "benchmarks", script), tmp_path / "root" / "benchmarks")
  (tmp_path / "root" / "train.py").write_text(STAND_IN_FAILING_TRAIN_PY)
  (tmp_path / "tmp").mkdir()
  script = str(tmp_path / "root" / "benchmarks" / "fault_drill.py")
  result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))  # fmt: skip
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "  | error: data.data_dir=/nowhere holds no Fashion-MNIST" in result.stderr  # train.py's own words
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "uninterrupted exited with 2" in errors[0], result.stderr[-3000:]
  assert os.listdir(tmp_path / "tmp") == []  # the runs' root, checkpoints and all


def test_fault_drill_keeps_a_folder_a_run_still_holds(tmp_path):
  """Two drills given the same --workdir: the second emptied the first's folders under its running train.py."""
  workdir = tmp_path / "drill" / "uninterrupted"
  workdir.mkdir(parents=True)
  (workdir / "metrics.jsonl").write_text("")
  with workdir_held(workdir) as holder:
    message = _fails("benchmarks/fault_drill.py", f"--workdir={tmp_path / 'drill'}")
  assert message.startswith(f"error: the drill: {workdir} is in use by a run still going (process {holder} on ")
  assert sorted(os.listdir(workdir)) == [".lock", "metrics.jsonl"]


def test_fault_drill_keeps_a_folder_of_the_users_own(tmp_path):
  """--workdir naming a folder whose uninterrupted/ held the user's files: they were deleted."""
  (tmp_path / "drill" / "uninterrupted").mkdir(parents=True)
  (tmp_path / "drill" / "uninterrupted" / "precious.txt").write_text("mine")
  message = _fails("benchmarks/fault_drill.py", f"--workdir={tmp_path / 'drill'}")
  assert message.startswith(
    f"error: the drill: {tmp_path / 'drill' / 'uninterrupted'} holds files no run of this program made (precious.txt;"
  )
  assert (tmp_path / "drill" / "uninterrupted" / "precious.txt").read_text() == "mine"


# Toy settings: without the checks these would run to the end in seconds, not minutes.
TOY_THROUGHPUT = ["--model=resnet8_small", "--image_size=8", "--batch_per_device=1", "--num_classes=2",
                  "--dtype=float32", "--steps=1", "--warmup=0"]  # fmt: skip


def test_throughputs_json_keeps_the_overrides_values_in_either_form():
  from light_jax import cli

  argv = ["--model=resnet8_small", "--config.comm.density", "0.05", "--config.seed=3", "--config.optimizer.name"]
  assert cli.config_overrides(argv) == [
    "--config.comm.density=0.05",
    "--config.seed=3",
    "--config.optimizer.name",
  ]


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--steps=0", "flag --steps=0: 0 is not a positive integer"),
    ("--warmup=-1", "flag --warmup=-1: -1 is not a non-negative integer"),
    ("--config.model.name=resnet18", "--config.model.name has no effect in this benchmark; set --model instead"),
    ("--config.mesh.nodes=2", "--config.mesh.nodes has no effect in this benchmark; set --nodes and --cpu_devices"),
    # The same check as mesh.nodes's and model.name's, other fields of its table:
    pytest.param("--config.global_batch_size=64", "--config.global_batch_size has no effect", marks=pytest.mark.slow),
    pytest.param("--config.data.image_size=32", "--config.data.image_size has no effect", marks=pytest.mark.slow),
    ("--nodes=2", "--nodes=2 does not divide the 1 devices; set --nodes to one of 1. (On CPU, --cpu_devices sets"),
    ("--batch_per_device=0", "flag --batch_per_device=0: 0 is not a positive integer"),  # a ZeroDivisionError
    # It timed step 0's program (the warm-up's density) under the strategy's name; the config was never checked.
    ("--strategy=hitopk@0.01 --config.comm.density_warmup_epochs=1", "a density schedule (comm.density_warmup_"),
    ("--config.comm.density=5", "invalid config: comm.density=5.0"),
    ("--strategy=diloco@8 --cpu_devices=2 --nodes=2", "--steps=1: with diloco@8, a multiple of 8 (whole sync periods)"),
    ("--profile_dir=/proc/nope/trace", "--profile_dir=/proc/nope/trace/trace: cannot make its folder"),  # after it all
  ],
)
def test_throughput_refuses_what_it_would_ignore_or_fail_on(flag, message):
  assert message in _fails("benchmarks/throughput.py", *TOY_THROUGHPUT, *flag.split())


def test_collectives_checks_its_variants_and_cost_model_before_measuring(tmp_path, monkeypatch, capsys):
  toy = ["--nodes=1", "--local=2", "--repeats=1", "--model=resnet8_small"]
  error = _refused(monkeypatch, capsys, "benchmarks/collectives.py", *toy, "--only=dense,hierarchcal")
  assert error.startswith("error: --only: no variant 'hierarchcal'; the variants are dense, hierarchical,")
  error = _fails("benchmarks/collectives.py", *toy, "--only=dense,hierarchical/adaptive", "--cost_model=v100")
  assert error.startswith("error: --cost_model: comm.cost_model='v100' is neither a preset")


@pytest.mark.parametrize(
  "script, flag, message",
  [  # tracebacks, or a table of an empty batch's timings
    ("benchmarks/update_step.py", "--image=0", "argument --image: 0 must be >= 1"),
    ("benchmarks/train_step.py", "--channels=0", "argument --channels: 0 must be >= 1"),
    ("benchmarks/collectives.py", "--device_tflops=0", "--device_tflops=0.0: must be a number > 0"),
    ("benchmarks/collectives.py", "--examples_per_device=0", "argument --examples_per_device: 0 must be >= 1"),
  ],
)
def test_benchmarks_refuse_sizes_of_zero(script, flag, message, monkeypatch, capsys):
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # update_step.py sets it where it is not set: kept to this test
  assert message in main_refuses(monkeypatch, capsys, script, flag)  # in this process: checked before any work


def test_benchmarks_refuse_a_mesh_that_does_not_fit(monkeypatch, capsys):
  assert "--nodes=0 --local=4: each must be >= 1" in _refused(
    monkeypatch, capsys, "benchmarks/train_step.py", "--nodes=0"
  )
  error = _refused(monkeypatch, capsys, "benchmarks/collectives.py", "--nodes=0", "--model=resnet8_small")
  assert "--nodes=0 --local=4: each must be >= 1" in error
  # 8,000 simulated CPU devices: after a minute "Multiprocess computations aren't implemented on the CPU backend".
  error = _refused(monkeypatch, capsys, "benchmarks/collectives.py", "--nodes=1000", "--local=8")
  assert error.endswith("8,000 devices; this benchmark runs on one machine's devices (on the CPU, simulated), at most "
                        "512: predict a larger cluster with scripts/simulate.py")  # fmt: skip
  # The other benchmarks went silent for minutes, their memory growing, before failing.
  for script, flags in [
    ("benchmarks/train_step.py", ["--nodes=100", "--local=1000"]),
    ("benchmarks/update_step.py", ["--local=100000"]),
  ]:
    error = _refused(monkeypatch, capsys, script, *flags)
    assert error.startswith(f"error: {' '.join(flags)}: ") and "at most 512: predict a larger cluster" in error, error
  error = _fails("benchmarks/throughput.py", "--cpu_devices=100000")  # absl's main: in a process of its own
  assert error.startswith("error: --cpu_devices=100000: 100,000 devices; this benchmark runs on one"), error
  toy = ["--model=resnet8_small", "--image=8", "--batch_per_device=1", "--rounds=1", "--local=4"]
  error = _fails("benchmarks/update_step.py", *toy, JAX_NUM_CPU_DEVICES="2")
  assert "--local=4: there are 2 devices here" in error


def test_benchmarks_check_what_their_mesh_can_run_before_measuring(monkeypatch, capsys):
  # A batch that does not split over 3 x 2 devices was a sharding traceback after the model was built.
  # In this process: checked before the script sets a device count (a toy run, should a check go missing).
  toy = ["--model=resnet8_small", "--steps=1", "--rounds=1"]
  error = _refused(monkeypatch, capsys, "benchmarks/train_step.py", *toy, "--nodes=3", "--local=2")
  assert error.startswith("error: --batch=256 does not divide over the 6 devices of --nodes x --local; use a multiple")
  error = _refused(monkeypatch, capsys, "benchmarks/train_step.py", *toy, "--micro_batches=3")
  assert "divide the 32 examples per device" in error
  # gtopk needs a power-of-two device count: named in --only, refused (it was a traceback mid-benchmark).
  error = _fails("benchmarks/collectives.py", "--nodes=3", "--local=2", "--model=resnet8_small", "--only=gtopk@0.01")
  assert error.startswith("error: --only=gtopk@0.01: comm.strategy='gtopk' pairs devices by the bits")


@pytest.mark.parametrize("script", ["collectives", "train_step", "update_step", "throughput"])
def test_benchmarks_check_the_model_name_first(script, monkeypatch, capsys):
  if script == "throughput":  # absl's flags: its entry point, as a subprocess
    error = _fails(f"benchmarks/{script}.py", "--model=nope")
  else:
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # update_step.py sets it where it is not set: kept to this test
    error = _refused(monkeypatch, capsys, f"benchmarks/{script}.py", "--model=nope")
  assert error.startswith("error: --model=nope: no such model; use one of")


def test_benchmark_counts_must_be_positive():
  for script, flag in (("update_step", "--rounds=0"), ("train_step", "--steps=0"), ("fault_drill", "--kills=-1")):
    result = subprocess.run([sys.executable, f"benchmarks/{script}.py", flag], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"argument {flag.split('=')[0]}: {flag.split('=')[1]} must be >= " in result.stderr


def test_collectives_counts_the_bytes_of_the_filled_mesh():
  args = ["--model=resnet8_small", "--repeats=1", "--only=hitopk@0.01"]  # the count of every variant alike
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "benchmarks/collectives.py", "--nodes=1", "--local=-1", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
  assert result.returncode == 0, result.stderr[-2000:]
  rows = json.loads(result.stdout.strip().splitlines()[-1])
  # One device (--local -1 filled to 1): nothing is sent; the accounting had taken local = -1.
  assert rows and all(r["intra_node_bytes"] == 0 and r["inter_node_bytes"] == 0 for r in rows.values()), rows


def test_prepare_image_folder_checks_the_folder_before_making_out(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(absl_logging, "set_verbosity", lambda level: None)  # main() sets INFO: not for this worker
  refused = functools.partial(_refused, monkeypatch, capsys)  # in this process (its entry point: the test above)
  error = refused("scripts/prepare_image_folder.py", f"--folder={tmp_path / 'typo'}", f"--out={tmp_path / 'out'}")
  assert not (tmp_path / "out").exists()
  assert error.endswith("typo does not exist; give the folder that holds train/CLASS_NAME/*.jpg and val/...")
  (tmp_path / "a_file").write_text("")  # it said "it has no train/ folder" of both
  error = refused("scripts/prepare_image_folder.py", f"--folder={tmp_path / 'a_file'}", f"--out={tmp_path / 'out'}")
  assert "a_file is a file; give the folder" in error
  (tmp_path / "typo").mkdir()
  error = refused("scripts/prepare_image_folder.py", f"--folder={tmp_path / 'typo'}", f"--out={tmp_path / 'out'}")
  assert "typo: it has no train/ folder" in error
  for split in ("train", "val"):  # no class folders: the conversion's own check, after --out was made
    (tmp_path / "folder" / split).mkdir(parents=True)
  error = refused("scripts/prepare_image_folder.py", f"--folder={tmp_path / 'folder'}", f"--out={tmp_path / 'out'}")
  assert not (tmp_path / "out").exists()
  assert "has no class sub-folders" in error
  # An empty split name wrote a hidden .array_record and an info.json split named "", and exited 0.
  for splits in ("train,,val", "../train"):
    args = [f"--folder={tmp_path / 'folder'}", f"--out={tmp_path / 'out'}", f"--splits={splits}"]
    assert "give distinct split names, each a folder's name" in refused("scripts/prepare_image_folder.py", *args)
    assert not (tmp_path / "out").exists()
  # --out inside a split: its staging folder was then called a class that the first split lacks.
  args = [f"--folder={tmp_path / 'folder'}", f"--out={tmp_path / 'folder' / 'val' / 'out'}"]
  assert "is inside --folder's val/ folder" in refused("scripts/prepare_image_folder.py", *args)
  # Every image undecodable: it wrote empty splits and exited 0.
  for split in ("train", "val"):
    (tmp_path / "folder" / split / "cat").mkdir()
    (tmp_path / "folder" / split / "cat" / "bad.jpg").write_bytes(b"not a jpeg")
  error = refused("scripts/prepare_image_folder.py", f"--folder={tmp_path / 'folder'}", f"--out={tmp_path / 'out'}")
  assert "folder/train: no image decodes (1 skipped, named in the log above)" in error
  assert not (tmp_path / "out").exists()
  real_convert = records.convert_image_folder
  # Ctrl-C during the conversion: one line and exit 130 (a traceback before), the --out it made removed.

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(records, "convert_image_folder", interrupted)
  monkeypatch.setattr(sys, "path", list(sys.path))  # the script's own sys.path.insert, undone afterwards
  argv = ["prepare_image_folder.py", f"--folder={tmp_path / 'folder'}", f"--out={tmp_path / 'out'}"]
  monkeypatch.setattr(sys, "argv", argv)
  with pytest.raises(SystemExit) as stopped:
    load_script("scripts/prepare_image_folder.py").main()
  assert stopped.value.code == 130 and capsys.readouterr().err == "stopped by Ctrl-C: nothing written\n"
  assert not (tmp_path / "out").exists()
  # A SIGTERM (a job killed): the same (it left a partial copy in --out's staging folder, and no word).

  def terminated(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)  # the handler raises before this ends

  monkeypatch.setattr(records, "convert_image_folder", terminated)
  handler = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as stopped:
    load_script("scripts/prepare_image_folder.py").main()
  assert stopped.value.code == 143 and capsys.readouterr().err == "stopped by SIGTERM: nothing written\n"
  assert not (tmp_path / "out").exists() and signal.getsignal(signal.SIGTERM) == handler  # put back
  # Another conversion into the same new --out, started at the same moment: both saw no --out, and the one refused
  # removed the other's folder, its work in progress with it.
  other = contextlib.ExitStack()

  def another_conversion_arrives(folder, out, splits):
    os.makedirs(os.path.join(out, ".converting_other"))
    other.enter_context(file_locked(os.path.join(out, ".conversion.lock")))
    return real_convert(folder, out, splits)

  monkeypatch.setattr(records, "convert_image_folder", another_conversion_arrives)
  with other, pytest.raises(SystemExit) as stopped:
    load_script("scripts/prepare_image_folder.py").main()
  assert stopped.value.code == 2 and "is being written by another conversion" in capsys.readouterr().err
  assert (tmp_path / "out" / ".converting_other").is_dir()


def test_prepare_image_folder_on_unreadable_input_or_output(tmp_path):
  """Permissions were PermissionError tracebacks, and the --out the run made was left behind. Root drops its
  override of file permissions (setpriv), as a normal user would be."""
  from tests.image_folder_fixture import make_image_folder

  without_override = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
  if without_override and not shutil.which("setpriv"):
    pytest.skip("as root, needs setpriv to be refused by file permissions")
  make_image_folder(str(tmp_path / "folder"), num_classes=2, train_per_class=2, val_per_class=1, bad=False)

  def run(out):
    command = [*without_override, sys.executable, os.path.join(ROOT, "scripts", "prepare_image_folder.py")]
    command += [f"--folder={tmp_path / 'folder'}", f"--out={out}"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)

  unreadable = tmp_path / "folder" / "train" / "class_01"
  image = sorted(unreadable.iterdir())[0]
  image.chmod(0)  # skipped and listed, like an undecodable image
  result = run(tmp_path / "out")
  assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert f"class_01/{image.name}: cannot read it (Permission denied)" in result.stderr
  assert json.loads((tmp_path / "out" / "info.json").read_text())["splits"]["train"]["skipped"] == [
    f"class_01/{image.name}"
  ]
  unreadable.chmod(0)  # a class folder: refused, and the --out this run made is removed
  result = run(tmp_path / "new_out")
  unreadable.chmod(0o755)
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert errors == [f"error: {unreadable}: cannot read it (Permission denied); make it readable, or move it out of "
                    "--folder"]  # fmt: skip
  assert not (tmp_path / "new_out").exists()
  (tmp_path / "read_only").mkdir(mode=0o555)
  result = run(tmp_path / "read_only")
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert errors == [f"error: {tmp_path / 'read_only'}: cannot write there (Permission denied); choose another --out"]
  assert (tmp_path / "read_only").exists() and not os.listdir(tmp_path / "read_only")  # not this run's: kept


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


@pytest.mark.parametrize(
  "argv, code, message",
  [
    (["--help"], 0, "usage: bash benchmarks/gpu_check.sh OUT_DIR [--toy]"),
    (["--toy"], 2, "error: the first argument is the output folder, not --toy"),  # it ran on, writing to /
    (["OUT", "--tooy"], 2, "error: unexpected arguments after OUT_DIR: --tooy"),
    (["OUT", "--toy", "--budget", "30"], 2, "error: --budget '30': give whole seconds, at least 55"),
    (["OUT", "--toy", "--budget", "1e3"], 2, "error: --budget '1e3': give whole seconds, at least 55"),
    (["OUT", "--toy", "--budget", ""], 2, "error: --budget '': give whole seconds"),
    (["OUT", "--toy", "--budget", "99999999999999999999"], 2, "give whole seconds"),
    (["OUT", "--toy", "--wheels"], 2, "error: --wheels needs a folder of wheels"),
    (["OUT", "--toy", "--wheels", "."], 2, "error: --wheels . holds no .whl file; download them"),
  ],
)
def test_gpu_check_refuses_a_flag_for_its_output_folder(tmp_path, argv, code, message):
  argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
  script = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
  result = subprocess.run(["bash", script, *argv], cwd=tmp_path, capture_output=True, text=True)
  assert result.returncode == code and message in result.stdout + result.stderr, result
  assert os.listdir(tmp_path) == []  # nothing made, here or in the repository's root


def test_a_ctrl_c_stops_the_gpu_check_and_its_step(tmp_path):
  """`timeout` runs each step in a process group of its own, out of a terminal's Ctrl-C: the check went on with the
  next step and the next."""
  process = subprocess.Popen(
    ["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out"), "--toy"], cwd=ROOT, stdout=subprocess.PIPE,
    stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHON=sys.executable),
    # As from a terminal: pytest-xdist's workers ignore SIGINT, and a shell cannot trap a signal ignored at its start.
    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
  )  # fmt: skip
  assert process.stdout.readline().startswith("light_jax GPU check")
  for line in process.stdout:  # after the preflight
    if line.startswith("== throughput_float32_32_b8 "):  # the step has started
      break
  process.send_signal(signal.SIGINT)
  _, err = process.communicate(timeout=60)
  assert process.returncode == 130, err[-3000:]
  assert err.strip().splitlines()[-1] == (
    f"stopped by SIGINT during the step throughput_float32_32_b8; the steps before it are in {tmp_path}/out/steps.jsonl"
  )
  assert "== collectives" not in (tmp_path / "out" / "report.txt").read_text()


def test_the_gpu_check_skips_the_steps_its_budget_cannot_hold_and_leaves_what_it_measured(tmp_path):
  """A device machine's command runs at most 600 s, and the summary was written only after the last step: a check
  cut short there brought back no gpu_check.json. Now each step is bounded by the time left of --budget (25 s of it
  kept for the summary), the steps beyond it are recorded as skipped, and the summary and the logs' archive are
  written after every step."""
  out = tmp_path / "out"
  result = subprocess.run(
    ["bash", "benchmarks/gpu_check.sh", str(out), "--toy", "--budget", "55"], cwd=ROOT, capture_output=True,
    text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable),
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((out / "gpu_check.json").read_text())
  assert summary["preflight"]["devices"] >= 1 and summary["preflight"]["versions"]["jax"], summary["preflight"]
  assert set(summary["preflight"]["imports"].values()) == {"ok"}, summary["preflight"]["imports"]
  # The preflight had the first 30 s; every step after it found less than 30 s left.
  assert {"calibrate_links", "train", "update_step", "input_pipeline"} <= set(summary["skipped"]), summary["skipped"]
  assert summary["failed"] == []
  assert json.loads(result.stdout.strip().splitlines()[-1])["skipped"] == summary["skipped"]
  with tarfile.open(out / "logs.tar.gz") as archive:
    assert "logs/preflight.log" in archive.getnames()


def test_gpu_check_refused_leaves_an_earlier_runs_results_and_names_an_unwritable_folder(tmp_path):
  """It emptied report.txt and steps.jsonl before finding no GPU; a read-only folder gave 32 lines and a traceback."""
  script = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
  if shutil.which("nvidia-smi") is None:  # a GPU machine would run the check
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "report.txt").write_text("the earlier run's tables")
    result = subprocess.run(["bash", script, str(tmp_path / "earlier")], capture_output=True, text=True)
    assert result.returncode == 2 and "nvidia-smi not found" in result.stderr, result
    assert os.listdir(tmp_path / "earlier") == ["report.txt"]
    assert (tmp_path / "earlier" / "report.txt").read_text() == "the earlier run's tables"
  with tmpfs(tmp_path / "read_only", "ro,size=1m") as folder:
    result = subprocess.run(["bash", script, str(folder), "--toy"], capture_output=True, text=True)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result
  assert result.stderr.strip() == (
    f"error: cannot write in the output folder {folder} (permissions, or a read-only file system)"
  )
