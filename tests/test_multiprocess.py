"""Two real processes (2 x 4 CPU devices, jax.distributed over gloo on 127.0.0.1) train like one process with 8."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from light_jax.data import records
from light_jax.emulated_cluster import free_port
from light_jax.exit_codes import ExitCode
from light_jax.metrics import read_metrics
from tests.helpers import flip_bytes, tmpfs
from tests.image_folder_fixture import make_image_folder

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  # Each train.py process sets its own device count; keep the other flags (the tests' optimisation level).
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return env


def _run(num_processes, out, strategy, *extra):
  port = free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        WORKER,
        "--num_processes",
        str(num_processes),
        "--process_id",
        str(i),
        "--port",
        str(port),
        "--strategy",
        strategy,
        "--out",
        str(out),
        *extra,
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      env=_env(),
      text=True,
    )
    for i in range(num_processes)
  ]
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


# All slow (~20 s to 1.5 min each): each compares every array of the state, the reducer's per-device residuals
# included, after a few steps. In the fast suite, hitopk across processes is
# test_train_py_on_two_processes_matches_one_process below (train.py; its loss, evaluation and bytes after six steps,
# which a wrong residual or gathered pair would move); dense and hierarchical are psums over one or both axes, the
# same collectives across processes.
# "hitopk+compact" (slow, as all the +compact ones: one process tests compact pairs on 8 devices,
# tests/test_collectives.py): its pairs as bfloat16 values and uint16 indices across processes (gloo), on a
# model of 308,074 parameters in one bucket, so that each device's shard (77,019 entries) is over 65,536 and the
# indices travel as offsets in 65,536-entry blocks with per-block counts. "topk+compact": the same for flat
# top-k, whose whole bucket (308,074 entries, five blocks) is the vector each device selects from.
COMPACT_LONG = ("--width", "32", "--bucket_bytes", str(2**21))
# "hitopk+ef21": EF21's estimates (comm.feedback), each receiver's sum of every sender's estimate.
SLOW = ("gtopk", "powersgd", "diloco", "hitopk+compact", "topk+compact", "gtopk+compact", "hitopk+ef21")


@pytest.mark.parametrize(
  "strategy",
  [pytest.param(s, marks=pytest.mark.slow) for s in ("hitopk", *SLOW)],
)
def test_two_processes_match_one_process(tmp_path, strategy):
  extra = COMPACT_LONG if strategy.endswith("+compact") else ()
  single = _run(1, tmp_path / "one.npz", strategy, *extra)
  multi = _run(2, tmp_path / "two.npz", strategy, *extra)
  assert single.keys() == multi.keys() and len(single) > 10
  residuals = [k for k in single if k.startswith("residual/")]
  assert bool(residuals)  # every strategy here keeps per-device state
  assert all(single[key].shape[:2] == (2, 4) for key in residuals)
  # Some buckets stay exactly zero: behind a zero-initialised BatchNorm scale that top-k has not sent
  # yet, a residual branch has no gradient at all. Others must carry what top-k held back.
  assert not residuals or any(np.abs(single[key]).max() > 0 for key in residuals)
  for key in single:
    np.testing.assert_allclose(multi[key], single[key], atol=1e-5, rtol=1e-5, err_msg=key)
  assert np.isfinite(single["__loss"]).all()


def _train_py(workdir, extra, port=None, process_id=None, stdout=subprocess.PIPE, runner=None, **popen):
  """train.py's command line, or ``runner``'s (Python code that runs train.py) with train.py's arguments."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  args = [
    sys.executable,
    *(["-c", runner] if runner else ["train.py"]),
    "--config",
    "configs/fashion_mnist.py",
    "--workdir",
    str(workdir),
    "--config.data.train_subset=1024",
    "--config.data.eval_subset=500",
    "--config.max_steps=6",
    "--config.global_batch_size=128",
    "--config.data.eval_batch_size=96",
    "--config.model.width=8",  # resnet8_fast's own is 32: what these tests check does not depend on it
    *extra,
  ]
  if port is not None:
    args += [f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={process_id}"]
  return subprocess.Popen(args, cwd=root, env=_env(), stdout=stdout, stderr=subprocess.STDOUT, text=True, **popen)


# hitopk: its top-k pairs gathered across processes (gloo), its residuals kept per device.
TWO_NODES = ["--config.mesh.nodes=-1", "--config.mesh.local=-1", "--config.comm.strategy=hitopk"]


def test_train_py_on_two_processes_matches_one_process(tmp_path):
  """The CLI path: train.py --coordinator/--num_processes/--process_id, each process one node."""
  port = free_port()
  procs = [_train_py(tmp_path / "two", TWO_NODES, port, i) for i in range(2)]
  procs.append(_train_py(tmp_path / "one", TWO_NODES[2:]))
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == 0, text[-3000:]
  assert "process 0 of 2, 8 devices (4 local)" in outputs[0]
  assert "mesh node x local = 2 x 4 (8 cpu devices, 2 process(es))" in outputs[0]
  # One record each (max_steps=6 ends mid-epoch), written by process 0 alone.
  [two], [one] = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
  assert two["step"] == one["step"] == 6
  for key in ("train_loss", "eval_top1", "eval_top5", "eval_loss"):
    assert abs(two[key] - one[key]) < 1e-5, (key, two[key], one[key])
  assert two["eval_examples"] == one["eval_examples"] == 500
  assert two["inter_node_bytes_per_step"] == one["inter_node_bytes_per_step"] < two["intra_node_bytes_per_step"] / 50


@pytest.mark.slow
def test_a_checkpoint_one_process_cannot_restore_is_passed_over_by_every_process(tmp_path):
  """Each process reads its own devices' shards: process 1's of the newest checkpoint damaged, it alone failed to
  restore it and fell back to the one before, and the first collective aborted both (exit 134 and 4, every rerun
  alike). Now both fall back, say why, and the run ends as one never damaged."""
  extra = [*TWO_NODES, "--config.checkpoint.every_steps=3"]  # checkpoints at steps 3 and 6
  port = free_port()
  procs = [_train_py(tmp_path / "two", extra, port, i) for i in range(2)]
  procs.append(_train_py(tmp_path / "one", extra[2:]))
  for p in procs:
    text = p.communicate(timeout=400)[0]
    assert p.returncode == 0, text[-3000:]
  shards = tmp_path / "two" / "checkpoints" / "6" / "state" / "ocdbt.process_1" / "d"
  for path in shards.iterdir():
    data = bytearray(path.read_bytes())
    for at in range(100, len(data) - 100, 97):
      data[at] ^= 0xFF
    path.write_bytes(data)
  port = free_port()
  procs = [_train_py(tmp_path / "two", extra, port, i) for i in range(2)]
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == 0, text[-3000:]
    assert "resumed from the checkpoint at step 3" in text, text[-3000:]
  assert "checkpoint at step 6 in" in outputs[1] and "cannot be restored (Exception: " in outputs[1]
  assert "cannot be restored (it failed on process 1: see its log); falling back" in outputs[0]
  [two], [one] = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
  assert two["step"] == one["step"] == 6
  for key in ("train_loss", "eval_top1", "eval_top5", "eval_loss"):
    assert abs(two[key] - one[key]) < 1e-5, (key, two[key], one[key])


def _image_folder_pair(workdir, data_dirs):
  """train.py on two processes, each reading its own copy of a converted image folder (``data_dirs``)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = free_port()
  return [
    subprocess.Popen(
      [
        sys.executable,
        "train.py",
        "--config",
        "configs/imagenet_resnet50.py:tiny",
        "--workdir",
        str(workdir),
        "--config.data.dataset=image_folder",
        f"--config.data.data_dir={data_dir}",
        "--config.data.image_size=24",
        "--config.data.resolution_schedule=",
        "--config.num_epochs=1",
        "--config.mesh.nodes=-1",
        "--config.mesh.local=-1",
        f"--coordinator=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ],
      cwd=root,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )  # fmt: skip
    for i, data_dir in enumerate(data_dirs)
  ]


@pytest.mark.slow
def test_an_evaluation_split_one_process_cannot_read_saves_the_steps_on_every_process(tmp_path):
  """Process 1's copy of the evaluation split is damaged (its records fail their checksum when read). Its
  evaluation failed alone, process 0 waited in the evaluation's collectives until the watchdog ended it, and the
  steps since the last checkpoint were lost. Now the processes agree on each evaluation batch: both save the steps,
  process 1 says what is damaged (exit 2), process 0 names process 1 (exit 4), and once the copy is mended the
  same command evaluates the saved step and finishes."""
  make_image_folder(str(tmp_path / "raw"), num_classes=4, train_per_class=24, val_per_class=24, bad=False)
  good, damaged = tmp_path / "good", tmp_path / "damaged"
  records.convert_image_folder(str(tmp_path / "raw"), str(good))
  shutil.copytree(good, damaged)
  flip_bytes(damaged / "val.array_record")  # the file opens; its first records' reads fail
  procs = _image_folder_pair(tmp_path / "run", [good, damaged])
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  assert procs[1].returncode == ExitCode.BAD_INPUT, outputs[1][-3000:]
  assert "val.array_record is damaged or unreadable" in outputs[1] and "steps are saved" in outputs[1], outputs[1][
    -3000:
  ]
  assert procs[0].returncode == ExitCode.PEER_FAILURE, outputs[0][-3000:]
  assert "error: stopping process 0 of 2: process 1 failed: " in outputs[0], outputs[0][-3000:]
  assert "val.array_record is damaged or unreadable" in outputs[0]
  steps = sorted(int(n) for n in os.listdir(tmp_path / "run" / "checkpoints") if n.isdigit())
  assert steps == [3]  # 96 training images in batches of 32: the epoch's (the run's) last step
  procs = _image_folder_pair(tmp_path / "run", [good, good])
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == 0, text[-3000:]
    assert "resumed from the checkpoint at step 3" in text
  [record] = read_metrics(tmp_path / "run")
  assert record["step"] == 3 and record["final"] and record["eval_examples"] == 96


# train.py whose process 1 cannot read its 5th training batch (a damaged record of its machine's copy, say).
_TRAINING_INPUT_FAILING_IN_PROCESS_1 = """
import runpy, sys
from light_jax import data
if "--process_id=1" in sys.argv:
  read = data.TrainBatches.iterator
  def iterator(self, *args, **kwargs):
    for index, batch in enumerate(read(self, *args, **kwargs)):
      if index == 4:
        raise data.DataError("shard 3 of the training split is damaged")
      yield batch
  data.TrainBatches.iterator = iterator
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_training_batch_one_process_cannot_read_saves_the_steps_on_every_process(tmp_path):
  """Process 1 cannot read its 5th training batch. It raised alone, process 0 waited in the step's collectives until
  the watchdog ended it, and the steps since the checkpoint at step 3 were lost. Now the processes agree on each
  batch before it is placed: both save step 4, process 1 says what failed (exit 2), process 0 names process 1
  (exit 4), and the same command, once mended, resumes at step 4 and finishes."""
  port = free_port()
  settings = [*TWO_NODES[:2], "--config.checkpoint.every_steps=3"]
  procs = [_train_py(tmp_path / "run", settings, port, i, runner=_TRAINING_INPUT_FAILING_IN_PROCESS_1) for i in (0, 1)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert procs[1].returncode == ExitCode.BAD_INPUT, outputs[1][-3000:]
  assert (
    "error: shard 3 of the training split is damaged (the run's 4 steps are saved: once mended, rerun" in outputs[1]
  )
  assert procs[0].returncode == ExitCode.PEER_FAILURE, outputs[0][-3000:]
  assert "error: stopping process 0 of 2: process 1 failed: shard 3 of the training split is damaged" in outputs[0]
  steps = sorted(int(n) for n in os.listdir(tmp_path / "run" / "checkpoints") if n.isdigit())
  assert steps == [3, 4]
  port = free_port()
  procs = [_train_py(tmp_path / "run", settings, port, i) for i in (0, 1)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == 0, text[-3000:]
    assert "resumed from the checkpoint at step 4" in text
  [record] = read_metrics(tmp_path / "run")
  assert record["step"] == 6 and record["final"]


# train.py with check_shared_directory waiting 1 s, not 10, for the file process 0 wrote: here it never comes.
_SHORT_SHARED_WAIT = """
import functools, runpy, sys
from light_jax import checkpoint
checkpoint.check_shared_directory = functools.partial(checkpoint.check_shared_directory, wait_seconds=1.0)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_workdir_of_each_machines_own_is_refused_before_training(tmp_path):
  """Orbax commits a multi-process save only where every process sees the others' files: with a local folder per
  machine no checkpoint was ever committed, and the run stalled for minutes. Both processes refuse it at once."""
  port = free_port()
  own = ["--config.mesh.nodes=-1", "--config.mesh.local=-1"]  # the default --peer_timeout: see the next test
  procs = [_train_py(tmp_path / f"own{i}", own, port, i, runner=_SHORT_SHARED_WAIT) for i in range(2)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == ExitCode.BAD_INPUT, text[-3000:]
    assert "is not one directory for every process: process(es) [1] do not see the file process 0 wrote" in text
    assert "Traceback" not in text
  assert not os.path.exists(tmp_path / "own0" / "checkpoints") and os.listdir(tmp_path / "own0") == []


def test_processes_started_with_other_settings_both_stop_at_once_naming_them(tmp_path):
  """Started by hand with another batch size, the two processes trained on silently, each with its own (another
  max_steps: both hung at the step one did not take). Both refuse at once, naming the field."""
  port = free_port()
  # The default --peer_timeout: at 5 (a watchdog tick a second), process 1 was once stopped on process 0's published
  # refusal (exit 4) before its own comparison refused (exit 2).
  base = ["--config.mesh.nodes=-1", "--config.mesh.local=-1", "--config.data.num_workers=0"]
  procs = [
    _train_py(tmp_path / "run", base, port, 0),
    _train_py(tmp_path / "run", [*base, "--config.global_batch_size=256", "--config.data.num_workers=1"], port, 1),
  ]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == ExitCode.BAD_INPUT and "Traceback" not in text, text[-3000:]
  assert (
    outputs[0]
    .strip()
    .splitlines()[-1]
    .startswith(
      "error: process 0 was started with other settings than process 1: global_batch_size=128 here, 256 on process 1. "
    )
  )
  assert "error: process 1 was started with other settings than process 0: global_batch_size=256 here" in outputs[1]
  assert "data.num_workers" not in outputs[1].split("settings than process 0:")[1].split(". Start")[0]  # a machine's


def _fashion_mnist_with_a_short_test_split(folder, images: int) -> str:
  """A copy of Fashion-MNIST (Debian's IDX files) whose test split holds its first ``images`` images only."""
  import gzip

  source = "/usr/share/datasets/fashion-mnist"
  os.makedirs(folder)
  for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
    os.symlink(os.path.join(source, name), os.path.join(folder, name))
  for name, header in (("t10k-images-idx3-ubyte.gz", 16), ("t10k-labels-idx1-ubyte.gz", 8)):
    with gzip.open(os.path.join(source, name)) as f:
      data = bytearray(f.read())
    per_item = (len(data) - header) // int.from_bytes(data[4:8], "big")
    data[4:8] = images.to_bytes(4, "big")
    with gzip.open(os.path.join(folder, name), "wb") as f:
      f.write(data[: header + images * per_item])
  return str(folder)


def test_machines_whose_dataset_copies_differ_both_stop_naming_what_differs(tmp_path):
  """Each machine reads its own data.data_dir. A copy with a shorter test split took another number of evaluation
  collectives: both processes hung at the first evaluation until --step_timeout, then blamed gloo (exit 4)."""
  short = _fashion_mnist_with_a_short_test_split(tmp_path / "short", 400)
  port = free_port()
  procs = [
    _train_py(tmp_path / "run", [], port, 0),
    _train_py(tmp_path / "run", [f"--config.data.data_dir={short}"], port, 1),
  ]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, text in zip(procs, outputs):
    assert p.returncode == ExitCode.BAD_INPUT and "Traceback" not in text, text[-3000:]
  assert outputs[0].strip().splitlines()[-1] == (
    "error: process 0 loaded another dataset than process 1: eval examples=500 here, 400 on process 1. Every "
    "machine's data.data_dir (/usr/share/datasets/fashion-mnist here) must hold the same dataset: copy it from one "
    "machine, or share it"
  )
  assert (
    "error: process 1 loaded another dataset than process 0: eval examples=400 here, 500 on process 0. Every "
    f"machine's data.data_dir ({short} here)" in outputs[1]
  )


def test_a_process_whose_coordinator_never_answers_says_so_and_stops_at_init_timeout(tmp_path):
  """Process 1 alone, or at a wrong address: 300 s of silence, then a C++ abort blaming a dead peer (134)."""
  start = time.monotonic()
  # And a compilation cache folder that cannot be made: a warning, the run goes on (to its coordinator's check).
  unusable = ["--init_timeout=1", "--compilation_cache_dir=/proc/light_jax_nope/cache"]
  process = _train_py(tmp_path / "run", unusable, free_port(), 1)
  text = process.communicate(timeout=120)[0]
  assert process.returncode == ExitCode.BAD_INPUT and "Traceback" not in text, text[-3000:]
  assert "compilation cache off: /proc/light_jax_nope/cache cannot be made (No such file or directory)" in text
  assert "waiting for process 0 at 127.0.0.1:" in text
  assert text.strip().splitlines()[-1].startswith("error: nothing answered at --coordinator=127.0.0.1:")
  assert time.monotonic() - start < 60


def test_a_process_refused_before_joining_leaves_the_others_one_line_at_init_timeout(tmp_path):
  """Process 1's override does not parse: it stops before joining. Process 0 waited for it until --init_timeout, and
  JAX then aborted it some seconds later with a C++ stack blaming "another task died" (134)."""
  start, port = time.monotonic(), free_port()
  waiting = _train_py(tmp_path / "run", ["--init_timeout=1"], port, 0)
  refused = _train_py(tmp_path / "run", ["--config.optimizer.no_such_field=1"], port, 1)
  assert refused.wait(timeout=60) == ExitCode.BAD_INPUT
  text = waiting.communicate(timeout=60)[0]
  assert waiting.returncode == ExitCode.PEER_FAILURE and "Check failure" not in text, text[-3000:]
  last = text.strip().splitlines()[-1]
  assert last.startswith("error: not every process joined within --init_timeout=1 s: one was not started, or stopped")
  assert time.monotonic() - start < 60


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_ctrl_c_while_waiting_for_the_others_to_join_stops_at_once(tmp_path, process_id):
  """Process 0: JAX waits for every process in C++, where the Ctrl-C was not seen: up to --init_timeout (300 s), then
  an abort. Process 1, waiting for process 0 to answer: a KeyboardInterrupt traceback, or nothing (SIGINT ignored).
  Started with SIGINT ignored, as a script's background job is (CI's): it is taken all the same."""
  ignored = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
  port = free_port()
  process = _train_py(tmp_path / "run", [], port, process_id, preexec_fn=ignored)
  waiting = ["waiting for the other 1 process(es) to join", "waiting for process 0 at"][process_id]
  for line in process.stdout:
    if waiting in line:
      break
  time.sleep(1)
  start = time.monotonic()
  process.send_signal(signal.SIGINT)
  text = process.communicate(timeout=60)[0]
  assert process.returncode == 128 + signal.SIGINT and time.monotonic() - start < 10, text[-3000:]
  assert (
    text.strip().splitlines()[-1]
    == [
      "stopped by SIGINT while waiting for the other processes to join; nothing to save.",
      f"stopped by SIGINT while waiting for process 0 at --coordinator=127.0.0.1:{port}; nothing to save.",
    ][process_id]
  )


def test_a_process_0_whose_port_is_in_use_refuses_at_once(tmp_path):
  """gRPC binds with SO_REUSEPORT: a second run's process 0 on the same port bound it too, and both runs, the one
  already training included, aborted when their processes met the wrong coordinator."""
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    process = _train_py(tmp_path / "run", [], port, 0)
    text = process.communicate(timeout=120)[0]
  assert process.returncode == ExitCode.BAD_INPUT, text[-3000:]
  assert text.strip().splitlines()[-1] == (
    f"error: --coordinator: port {port} is in use on this machine (another run's coordinator, or another program); "
    "choose another port, the same in --coordinator on every process"
  )


# Slow (~20 s). In the fast suite: a save that fails at once raised while orbax still reports it saving (the fix
# here: test_a_save_that_fails_at_once_is_raised_while_orbax_still_reports_it_saving, tests/test_checkpoint.py), and
# the other process stopping on a published reason (test_survivor_stops_with_the_reason_when_a_process_fails).
@pytest.mark.slow
def test_a_disk_that_fills_up_stops_both_processes_at_once_with_the_reason(tmp_path):
  """Process 0's writes failed (no space left), process 1's went through: orbax's save threads then waited at two
  different barriers, and both processes sat 10 minutes until step_timeout blamed a stuck collective. Now the
  failing process stops at once with the reason, and the other on the reason it published."""
  port = free_port()
  # A checkpoint of this run takes over 424 KB (du; the hierarchical run's, without hitopk's residuals); the same run
  # as test_train_py_on_two_processes_matches_one_process,
  # whose compiled programs it reads from the tests' compilation cache.
  with tmpfs(tmp_path / "disk", "size=256k") as disk:
    procs = [_train_py(disk / "run", TWO_NODES, port, i) for i in range(2)]
    try:
      outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
      for p in procs:
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  assert ExitCode.BAD_INPUT in codes and set(codes) <= {ExitCode.BAD_INPUT, ExitCode.PEER_FAILURE}, outputs
  for text in outputs:
    assert f"saving the checkpoint at step 6 in {disk / 'run' / 'checkpoints'} failed: No space left on device" in text
    assert "Traceback" not in text, text[-3000:]


# --- Process faults: one process dies or fails; the other stops with a clear message, in bounded time ---

# train.py sets JAX's heartbeat backstop (a C++ abort) to four times this (twice, before); at 6 s a survivor sharing
# two cores with another pytest-xdist worker was once aborted by it before its watchdog thread got to run.
PEER_TIMEOUT = 10


def _start_pair(tmp_path, extra_per_process):
  port = free_port()
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  procs = [
    _train_py(
      tmp_path / "run",
      [
        "--config.mesh.nodes=-1",
        "--config.mesh.local=-1",
        "--config.max_steps=0",
        "--config.log_every_steps=1",
        "--config.num_epochs=1000",
        f"--peer_timeout={PEER_TIMEOUT}",
        *extra_per_process[i],
      ],
      port,
      i,
      stdout=open(logs[i], "w"),
    )
    for i in range(2)
  ]
  return procs, logs


def _wait_for(path, text, procs, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if text in path.read_text():
      return
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.5)
  for p in procs:
    p.kill()
  pytest.fail(f"{text!r} never appeared in {path}:\n{path.read_text()[-3000:]}")


def _exit_within(proc, bound, log):
  start = time.time()
  try:
    proc.wait(timeout=bound)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail(f"the survivor was still running {bound} s after its peer died:\n{log.read_text()[-3000:]}")
  return time.time() - start


# Process 0 (the coordinator) dying is JAX's own case: its client ends the others at once ("another task
# died"); checked by hand, not here, to keep the suite short.
# Both slow (~25 s each). The watchdog's part, a peer that stops giving signs of life, is
# test_a_peer_silent_for_peer_timeout_stops_this_process_with_the_reason below, in one process whose main thread
# sleeps; only these show it ending a process whose main thread is blocked in a gloo collective, with train.py's
# --peer_timeout.
@pytest.mark.slow
@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (1, signal.SIGSTOP)])
def test_survivor_stops_when_a_process_dies_or_hangs(tmp_path, victim, sig):
  procs, logs = _start_pair(tmp_path, [[], []])
  _wait_for(logs[0], "step compiled", procs)
  time.sleep(2)  # some steps in, collectives in flight
  procs[victim].send_signal(sig)
  survivor = 1 - victim
  try:
    seconds = _exit_within(procs[survivor], PEER_TIMEOUT + 30, logs[survivor])
  finally:
    procs[victim].kill()
  out = logs[survivor].read_text()
  assert procs[survivor].returncode == ExitCode.PEER_FAILURE, out[-3000:]
  assert "error: stopping process 0 of 2: " in out and "rerun the same command on every machine" in out
  assert seconds < PEER_TIMEOUT + 15
  if sig == signal.SIGKILL:
    # The dead peer's sockets close: a collective in flight fails at once (gloo: connection reset), or,
    # if none notices, the watchdog ends the survivor after peer_timeout.
    assert (
      "a collective failed" in out
      and "another process probably died" in out
      or "process 1 has given no sign of life" in out
    ), out[-3000:]
  else:
    # A stopped peer keeps its sockets open and the collective hangs: the watchdog ends it.
    assert "process 1 has given no sign of life" in out, out[-3000:]
    # The watchdog counts from the last change it saw: one interval (2 s here) before the stop, or two when the
    # stopped process's heartbeat thread was held up just before it on a loaded machine. Not much earlier.
    assert seconds > PEER_TIMEOUT - 4.5


@pytest.mark.slow
def test_a_stuck_collective_with_every_process_alive_stops_both_after_step_timeout(tmp_path):
  """Process 0 stops stepping but stays alive (its liveness counter moves): the peer watchdog sees nothing
  wrong, the step-progress clock does (the gtopk time-to-accuracy run hung so in gloo)."""
  hang = ["--config.train.inject_hang_at_step=3", "--step_timeout=20"]  # steps take seconds under CI load
  procs, logs = _start_pair(tmp_path, [hang, hang])
  for i in (0, 1):
    _exit_within(procs[i], 300, logs[i])
  out = logs[0].read_text()
  assert "process 0 hangs after step 3" in out, out[-3000:]
  assert procs[0].returncode == ExitCode.PEER_FAILURE, out[-3000:]
  assert "no training step has finished for" in out and "a collective is probably stuck" in out, out[-3000:]
  # Process 1 stops the same way, or, if process 0 (the coordinator) left first, JAX ends it at once.
  out = logs[1].read_text()
  assert procs[1].returncode != 0, out[-3000:]
  assert "no training step has finished for" in out or "another task died" in out, out[-3000:]


# Process 1 (this process stands in for it) publishes one sign of life, then none.
_SILENT_PEER = """
import sys, time, jax
from light_jax import liveness
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
liveness.client().key_value_set("light_jax/liveness/1", "1")
liveness.PeerWatchdog(0, 2, 2.5, sys.argv[2]).start()  # ticks every 0.5 s
time.sleep(60)  # a main thread stuck in a collective: only the watchdog ends it
"""


def test_a_peer_silent_for_peer_timeout_stops_this_process_with_the_reason(tmp_path):
  """The watchdog's half of test_survivor_stops_when_a_process_dies_or_hangs (slow): a peer whose liveness counter
  stops moving (a stopped or hung machine keeps its sockets open, so no collective fails) ends this process with
  exit 4 after --peer_timeout, naming the peer and how to resume."""
  process = subprocess.run([sys.executable, "-c", _SILENT_PEER, str(free_port()), str(tmp_path)], env=_env(),
                           timeout=120, capture_output=True, text=True)  # fmt: skip
  text = process.stdout + process.stderr
  assert process.returncode == ExitCode.PEER_FAILURE, text[-3000:]  # exit 0 after the sleep: it never fired
  silent = re.search(
    r"error: stopping process 0 of 2: process 1 has given no sign of life for (\d+) s \(peer_timeout 2.5 s\)", text
  )
  assert silent and int(silent[1]) >= 3, text[-3000:]  # not before the timeout (> 2.5 s, at a 0.5 s tick)
  assert f"{tmp_path}/checkpoints are intact: rerun the same command on every machine" in text


# Process 0 joins, then stops (SIGSTOP: alive, its sockets open, its key-value store answering nothing); process 1
# runs the watchdog with train.py's heartbeat backstop (four times the peer timeout).
_STOPPED_COORDINATOR = """
import os, signal, sys, time, jax
from light_jax import liveness
index, timeout = int(sys.argv[2]), 5.0
heartbeat = liveness.heartbeat_timeout(timeout)  # train.py's backstop
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", 2, index, heartbeat_timeout_seconds=heartbeat)
store = liveness.client()
if index == 0:  # once process 1 is through its join, whose last answer comes from this process
  store.blocking_key_value_get("joined", 60_000)
  os.kill(os.getpid(), signal.SIGSTOP)
liveness.PeerWatchdog(index, 2, timeout, sys.argv[3]).start()
store.key_value_set("joined", "1")  # its answer may never come: the watchdog runs already
time.sleep(60)  # a main thread stuck in a collective: only the watchdog ends it
"""


def test_a_coordinator_that_stops_answering_stops_the_others_with_the_reason(tmp_path):
  """The watchdog's calls to process 0's key-value store have no deadline: they waited as long as process 0 was
  stopped, and JAX's heartbeat aborted this process (exit 134, "another task died"). Now it stops after
  peer_timeout, exit 4, saying so."""
  port = str(free_port())
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _STOPPED_COORDINATOR, port, str(i), str(tmp_path)],
      env=_env(),
      stdout=subprocess.PIPE if i else subprocess.DEVNULL,
      stderr=subprocess.STDOUT,
      text=True,
    )  # fmt: skip
    for i in (0, 1)
  ]
  try:
    text = procs[1].communicate(timeout=120)[0]
  finally:
    for p in procs:
      p.kill()
      p.wait()
  assert procs[1].returncode == ExitCode.PEER_FAILURE, text[-3000:]
  assert re.search(
    r"error: stopping process 1 of 2: lost contact with the coordination service in process 0 for \d+ s \(no "
    r"answer\): process 0 probably died or hangs",
    text,
  ), text[-3000:]


# Process 0's key-value store, slow: each round of the watchdog (a write, a read) takes 0.7 s, more than its 0.5 s
# tick. Process 1 (this process stands in for it) gives signs of life throughout.
_SLOW_STORE = """
import sys, time, jax
from light_jax import liveness
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
store = liveness.client()

class Slow:
  def key_value_set(self, *args, **kwargs):
    time.sleep(0.6)
    store.key_value_set(*args, **kwargs)

  def key_value_dir_get(self, *args):
    time.sleep(0.1)
    return store.key_value_dir_get(*args)

liveness.client = Slow
watchdog = liveness.PeerWatchdog(0, 2, 2.5, sys.argv[2]).start()
for beat in range(20):
  store.key_value_set("light_jax/liveness/1", str(beat), allow_overwrite=True)
  time.sleep(0.3)
watchdog.close("bad input")  # a round may be in flight: its late counter must not replace the reason
time.sleep(1)
print("published:", store.key_value_try_get("light_jax/liveness/0"))
"""


def test_a_slow_coordination_service_is_not_taken_for_a_lost_one(tmp_path):
  """A round that ended between two ticks was dropped unread, and the next one started: with rounds of 1-2 ticks no
  answer was ever read, and the watchdog stopped the process for lost contact with a service that answered every
  call. The reason a process closes with is published after its round in flight, not overwritten by it."""
  process = subprocess.run([sys.executable, "-c", _SLOW_STORE, str(free_port()), str(tmp_path)], env=_env(),
                           timeout=120, capture_output=True, text=True)  # fmt: skip
  text = process.stdout + process.stderr
  assert process.returncode == 0 and "lost contact" not in text, text[-3000:]
  assert "published: failed: bad input" in process.stdout, text[-3000:]


def test_survivor_stops_with_the_reason_when_a_process_fails(tmp_path):
  """Process 1 cannot read its data (a bad path on that machine): process 0 stops at once and says why."""
  procs, logs = _start_pair(tmp_path, [[], [f"--config.data.data_dir={tmp_path}/missing"]])
  for i in (1, 0):
    _exit_within(procs[i], 120, logs[i])
  assert procs[1].returncode == ExitCode.BAD_INPUT
  out = logs[0].read_text()
  assert procs[0].returncode == ExitCode.PEER_FAILURE, out[-3000:]
  assert "error: stopping process 0 of 2: process 1 failed: Fashion-MNIST" in out, out[-3000:]


def test_a_process_that_cannot_use_its_workdir_joins_and_tells_the_others(tmp_path):
  """A workdir one machine cannot write (a file there, another user's folder) was refused before the join: the
  other processes waited for it until --init_timeout (300 s), then JAX aborted them (134) blaming a dead peer."""
  (tmp_path / "a_file").write_text("not a folder")
  port = free_port()
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  workdirs = [tmp_path / "run", tmp_path / "a_file" / "run"]
  start = time.monotonic()
  procs = [_train_py(workdirs[i], [], port, i, stdout=open(logs[i], "w")) for i in range(2)]
  for i in (1, 0):
    _exit_within(procs[i], 120, logs[i])
  seconds = time.monotonic() - start
  outs = [log.read_text() for log in logs]
  refused = f"--workdir={workdirs[1]}: {tmp_path / 'a_file'} is a file, not a directory; choose another path"
  assert procs[1].returncode == ExitCode.BAD_INPUT and f"error: {refused}." in outs[1], outs[1][-3000:]
  assert procs[0].returncode == ExitCode.PEER_FAILURE, outs[0][-3000:]
  assert f"error: stopping process 0 of 2: process 1 failed: {refused}" in outs[0], outs[0][-3000:]
  assert "Traceback" not in outs[0] + outs[1] and seconds < 60
  assert not (tmp_path / "run").exists()  # process 0 made nothing


_HOLDS_ITS_REASON = """
import sys, jax
from light_jax import liveness
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
watchdog = liveness.PeerWatchdog(0, 2, 60.0, ".").start()  # as process 0 of two
print("failing", flush=True)
watchdog.close("bad input")  # process 0 keeps the key-value store up until process 1 has read the reason
"""


def test_a_ctrl_c_while_process_0_keeps_its_reason_up_leaves_at_once():
  """After a failure (or a stop in set-up) process 0 stays up about 6 s for the others to read why: an impatient
  second Ctrl-C there was a KeyboardInterrupt traceback."""
  process = subprocess.Popen([sys.executable, "-c", _HOLDS_ITS_REASON, str(free_port())], env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
  assert process.stdout.readline() == "failing\n"
  time.sleep(1)  # inside the hold
  process.send_signal(signal.SIGINT)
  text = process.communicate(timeout=60)[0]
  assert process.returncode == 128 + signal.SIGINT and "Traceback" not in text, text[-3000:]
  assert text.strip().splitlines()[-1] == (
    "stopped by SIGINT while keeping this process's reason up for the others; they stop on their own."
  )


# As process 1 of two (process 0 keeps a failure's reason up for seconds), with process 0's failure published.
_OWN_ERROR_FIRST = """
import sys, threading, time, jax
from light_jax import liveness
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
liveness.client().key_value_set("light_jax/liveness/0", "failed: a workdir of its own")
read = threading.Event()


class Watchdog(liveness.PeerWatchdog):
  def _failed_peer(self, published):
    failure = super()._failed_peer(published)
    if failure:
      read.set()
    return failure


watchdog = Watchdog(1, 2, 5.0, ".").start()  # ticks every second; a second's grace
assert read.wait(30)
watchdog.close("its own error")  # this thread's own error, reported within the grace: no exit
print("closed by its own error", flush=True)
read.clear()
watchdog = Watchdog(1, 2, 5.0, ".").start()
assert read.wait(30)
print("read again")  # left in stdout's buffer (a file or pipe: no PYTHONUNBUFFERED): os._exit dropped it
if sys.argv[2] == "ended":
  watchdog.close()  # the run ended well meanwhile: the peer's failure is still the news
else:
  time.sleep(60)  # a thread stuck in a collective never closes it
"""


@pytest.mark.parametrize("then", ["stuck", "ended"])
def test_a_peers_published_failure_gives_this_process_a_second_to_report_its_own(then):
  """A check every process makes alike (a workdir of each machine's own) fails in all of them at once: process 0's
  watchdog once read process 1's published failure first and ended process 0 with exit 4 instead of its own exit
  2. The watchdog now stops on the peer's reason only if this process does not report an error of its own within
  a second; a run that ended well meanwhile stops on the peer's reason. Its stdout is flushed before it exits."""
  env = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}
  process = subprocess.run([sys.executable, "-c", _OWN_ERROR_FIRST, str(free_port()), then], env=env,
                           timeout=120, capture_output=True, text=True)  # fmt: skip
  text = process.stdout + process.stderr
  assert process.returncode == ExitCode.PEER_FAILURE, text[-3000:]
  assert process.stdout.splitlines() == ["closed by its own error", "read again"], text[-3000:]
  stops = [line for line in process.stderr.splitlines() if line.startswith("error: stopping process 1 of 2: ")]
  assert [line.split(". Committed")[0] for line in stops] == [
    "error: stopping process 1 of 2: process 0 failed: a workdir of its own"
  ], text


# Runs train.py late to the settings' comparison, the first wait for the other processes after the join (a slow
# machine): it sleeps there first.
_LATE = """
import runpy, sys, time
from light_jax import same_settings
check = same_settings.check
def late(*args, **kwargs):
  print("late to compare the settings", flush=True)
  time.sleep(60)
  return check(*args, **kwargs)
same_settings.check = late
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_signal_while_waiting_for_a_late_process_stops_set_up(tmp_path):
  """A signal between the join and the trainer stops set-up at once, with one line, and the other process on its
  reason. A SIGTERM there killed the process without a word (exit -15), and the other took --peer_timeout (60 s)
  to call it dead; a Ctrl-C waited in C++ for the late process (up to --init_timeout), then was a traceback."""
  port = free_port()
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  fast = ["--peer_timeout=5"]  # the watchdogs' ticks: 1 s (process 0 keeps its reason up for 4 s)
  procs = [
    _train_py(tmp_path / "run", fast, port, 0, stdout=open(logs[0], "w")),
    _train_py(tmp_path / "run", fast, port, 1, stdout=open(logs[1], "w"), runner=_LATE),
  ]
  _wait_for(logs[1], "late to compare the settings", procs)
  _wait_for(logs[0], "waiting for process 1 to compare its settings", procs)
  procs[0].send_signal(signal.SIGTERM)
  seconds = _exit_within(procs[0], 30, logs[0])
  _exit_within(procs[1], 30, logs[1])
  outs = [log.read_text() for log in logs]
  assert procs[0].returncode == ExitCode.OK and seconds < 15, outs[0][-3000:]
  assert outs[0].strip().splitlines()[-1] == (
    "stopped by SIGTERM during set-up, before the first step: nothing to save; run the same command again to start "
    "(or resume) the run."
  )
  assert procs[1].returncode == ExitCode.PEER_FAILURE, outs[1][-3000:]
  assert "process 0 failed: stopped by SIGTERM during set-up" in outs[1]
  assert "Traceback" not in outs[0] + outs[1]


def test_sigterm_to_one_process_stops_both_after_the_same_step_with_a_checkpoint(tmp_path):
  """Preemption through train.py: the processes agree on the signal (an all-gather every log step), so
  both save the same step and exit 0; rerunning the same command would resume there."""
  procs, logs = _start_pair(tmp_path, [[], []])
  _wait_for(logs[1], "training from step 0", procs)  # set-up is over: a signal before would stop it at once
  time.sleep(1)  # some steps in
  procs[1].send_signal(signal.SIGTERM)
  for i in (1, 0):
    _exit_within(procs[i], 60, logs[i])
  outs = [log.read_text() for log in logs]
  assert [p.returncode for p in procs] == [ExitCode.OK, ExitCode.OK], outs[0][-3000:] + outs[1][-3000:]
  assert "received SIGTERM" in outs[1] and "received SIGTERM" not in outs[0]
  stopped = {int(out.split("preempted after step ")[1].split(":")[0]) for out in outs}
  assert len(stopped) == 1, stopped  # the same step on both
  assert stopped <= {int(name) for name in os.listdir(tmp_path / "run" / "checkpoints") if name.isdigit()}


def test_a_peers_own_failure_is_named_before_one_that_stopped_because_of_another():
  """With 3 processes, process 2 killed: process 1's collective failed and it published that; process 0 then named
  process 1, a survivor, as the one that failed. A failure of a process's own comes first; a stop because of
  another process is named as such."""
  from light_jax import liveness

  watchdog = liveness.PeerWatchdog(0, 3, 60.0, ".")  # not started: no distributed runtime needed
  lost = {"light_jax/liveness/1": "lost: a collective failed (Connection reset)", "light_jax/liveness/2": "beat 7"}
  assert (
    watchdog._failed_peer(lost)
    == "process 1 stopped because of another process: a collective failed (Connection reset)"
  )
  own = {**lost, "light_jax/liveness/2": "failed: RuntimeError: out of memory (see its log)"}
  assert watchdog._failed_peer(own) == "process 2 failed: RuntimeError: out of memory (see its log)"
  assert (
    watchdog._failed_peer({"light_jax/liveness/0": "failed: this one's own", "light_jax/liveness/1": "done"}) is None
  )
