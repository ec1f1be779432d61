"""Fault drill: kill -9 a short Fashion-MNIST run N times at random steps, resume each time, and
compare the end result with an uninterrupted run of the same config. Every other kill lands while a save is
being written (its folder STEP.orbax-checkpoint-tmp is there), so the resume must discard it whole.

  python benchmarks/fault_drill.py [--kills 10 --seed 0]

Reports kills survived, steps lost per kill (steps done after the last checkpoint before the kill,
which the resumed run repeats: at most checkpoint.every_steps, plus the steps run while the save
that was in flight at the kill had not committed yet), whether the final parameters are
bitwise equal and the metrics equal, and the checkpoint overhead: the time the training loop spent
blocked starting asynchronous saves, as a fraction of the loop time, in the uninterrupted run.
"""

import argparse
import atexit
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_runs  # noqa: E402  benchmarks/, this script's directory

from light_jax import child_process, cli  # noqa: E402
from light_jax.exit_codes import signals_exit_at_once  # noqa: E402

TOTAL_STEPS = 192  # the drill's run: 4096 images / 128 = 32 steps per epoch, 6 epochs


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--kills", type=cli.int_at_least(1), default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--every_steps", type=cli.int_at_least(1), default=8)
  parser.add_argument("--workdir", default="")
  args = parser.parse_args()
  if args.every_steps > TOTAL_STEPS // 3:  # a kill lands before the last two checkpoint periods
    parser.error(
      f"--every_steps {args.every_steps} leaves no room for kills in the drill's {TOTAL_STEPS}-step run "
      f"(each lands before its last two checkpoint periods); use at most {TOTAL_STEPS // 3}"
    )
  problem = args.workdir and cli.unwritable_folder(args.workdir)
  if problem:  # it named the runs' folders inside a file, in train.py's words
    parser.error(f"--workdir={args.workdir}: {problem}")
  if args.workdir:  # train.py runs in ROOT: a relative workdir would be read here and written there.
    run_drill(args, os.path.abspath(args.workdir))
  else:  # two runs' checkpoints, removed at the end
    with tempfile.TemporaryDirectory(prefix="fault_drill_", ignore_cleanup_errors=True) as root:
      run_drill(args, root)


def last_step_done(step_times: str) -> int:
  """The last step a killed run's ``step_times.jsonl`` records (a line the kill cut short is left out)."""
  steps = [0]
  if os.path.exists(step_times):
    with open(step_times) as f:
      for line in f:
        try:
          steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
          continue
  return max(steps)


def run_drill(args, root):
  """The two runs under ``root`` (``uninterrupted`` and ``drill``), then the comparison and the report."""
  import jax

  jax.config.update("jax_num_cpu_devices", 8)  # the checkpoints hold arrays sharded over 8 devices
  import orbax.checkpoint as ocp

  # 4096 images / 128 = 32 steps per epoch, 6 epochs = 192 steps.
  config = [
    "--config",
    "configs/fashion_mnist.py:hitopk",
    "--config.data.train_subset=4096",
    "--config.data.eval_subset=1000",
    "--config.num_epochs=6",
    "--config.global_batch_size=128",
    "--config.data.eval_batch_size=200",
    f"--config.checkpoint.every_steps={args.every_steps}",
    "--config.log_every_steps=4",
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  started = []  # the train.py processes: a drill stopped (a signal, an error) kills the one still going first

  def kill_the_runs():  # os's calls, not Popen's: a signal may have come inside Popen.wait, which holds a lock
    for proc in started:
      if proc.returncode is None:
        with contextlib.suppress(OSError):  # reaped already by the wait the signal interrupted
          os.kill(proc.pid, signal.SIGKILL)
          os.waitpid(proc.pid, 0)

  atexit.register(kill_the_runs)

  def start(workdir, *extra):
    started.append(
      subprocess.Popen(
        [sys.executable, "train.py", "--workdir", workdir, *config, *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=child_process.bound_to_this_process(),  # killed with the drill, even by SIGKILL
      )
    )
    return started[-1]

  def finish(proc, workdir):
    """Waits for a run that was not killed; one that failed ends the drill with the tail of its output."""
    out, _ = proc.communicate()
    if proc.returncode:
      print("\n".join(f"  | {line}" for line in out.splitlines()[-20:]), file=sys.stderr)
      how = f"exited with {proc.returncode}" if proc.returncode > 0 else f"was killed by signal {-proc.returncode}"
      print(f"error: train.py --workdir {workdir} {how}; the end of its output is above", file=sys.stderr)
      sys.exit(proc.returncode if proc.returncode > 0 else 1)

  def progress(workdir):
    d = os.path.join(workdir, "checkpoints")
    return max((int(n) for n in os.listdir(d) if n.isdigit()), default=0) if os.path.isdir(d) else 0

  def saving(workdir):  # a save in flight: orbax writes it in STEP.orbax-checkpoint-tmp until it commits
    d = os.path.join(workdir, "checkpoints")
    return os.path.isdir(d) and any(".orbax-checkpoint-tmp" in n for n in os.listdir(d))

  def empty(workdir):  # a drill's own folder, unless a run is still going there or it holds files of the user's
    try:
      train_runs.empty_workdir("the drill", workdir)
    except train_runs.UnusableWorkdir as e:
      cli.fail(str(e))
    train_runs.stamp(workdir, shlex.join(["train.py", "--workdir", workdir, *config]))

  clean, drill = os.path.join(root, "uninterrupted"), os.path.join(root, "drill")
  for folder in (clean, drill):  # both before the first run: a refusal costs no minutes
    empty(folder)
  print("uninterrupted run ...", file=sys.stderr)
  finish(start(clean), clean)
  summary = json.load(open(os.path.join(clean, "summary.json")))

  rng = random.Random(args.seed)
  lost, kills, mid_save = [], 0, 0
  while kills < args.kills:
    # Each kill lands a random moment after the first checkpoint past a random point ahead.
    resumed_from = progress(drill)
    target = resumed_from + rng.randint(1, args.every_steps)
    if target >= TOTAL_STEPS - 2 * args.every_steps:
      print(f"run too short for more kills after {kills}", file=sys.stderr)
      break
    proc = start(drill, "--config.train.time_steps=True")  # a record per step: where the kill landed
    while proc.poll() is None and progress(drill) < target:
      time.sleep(0.02)
    if kills % 2:  # every other kill lands while the next save is being written: it must be discarded whole
      while proc.poll() is None and not saving(drill):
        time.sleep(0.002)
      time.sleep(rng.uniform(0.0, 0.02))
    else:  # anywhere in the next checkpoint period (about 0.1-0.2 s per step here)
      time.sleep(rng.uniform(0.0, args.every_steps * 0.15))
    in_flight = saving(drill)
    if proc.poll() is not None:
      finish(proc, drill)
      print(f"run finished before the kill at {target}", file=sys.stderr)
      break
    proc.kill()
    proc.wait()
    kills += 1
    mid_save += in_flight
    # Steps lost: the run kept going for a moment after the checkpoint that triggered the kill; its step
    # records (train.time_steps; the resumed run drops those after its checkpoint) end at the last step done.
    proc.stdout.read()
    reached = last_step_done(os.path.join(drill, "step_times.jsonl"))
    saved = progress(drill)
    lost.append(max(reached - saved, 0))
    print(
      f"kill {kills}: resumed from {resumed_from}, killed after checkpoint {saved} (step {reached} done"
      f"{', a save in flight' if in_flight else ''})",
      file=sys.stderr,
    )
  finish(start(drill), drill)

  def final_state(workdir):
    step = progress(workdir)
    return step, ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))

  step_a, state_a = final_state(clean)
  step_b, state_b = final_state(drill)
  leaves_a = jax.tree_util.tree_leaves_with_path(state_a)
  leaves_b = dict((jax.tree_util.keystr(k), np.asarray(v)) for k, v in jax.tree_util.tree_leaves_with_path(state_b))
  mismatched = [
    jax.tree_util.keystr(k)
    for k, v in leaves_a
    if not np.array_equal(np.asarray(v), leaves_b.get(jax.tree_util.keystr(k)))
  ]
  rec_a = [json.loads(line) for line in open(os.path.join(clean, "metrics.jsonl"))]
  rec_b = [json.loads(line) for line in open(os.path.join(drill, "metrics.jsonl"))]
  keys = ("step", "train_loss", "eval_top1", "eval_top5", "eval_loss")
  metrics_match = [{k: r[k] for k in keys} for r in rec_a] == [{k: r[k] for k in keys} for r in rec_b]
  result = {
    "kills": kills,
    "kills_during_a_save": mid_save,
    "kills_survived": kills if step_b == TOTAL_STEPS else 0,
    "steps_lost_max": max(lost, default=0),
    "steps_lost_mean": float(np.mean(lost)) if lost else 0.0,
    "every_steps": args.every_steps,
    "final_step": step_b,
    "params_mismatches": len(mismatched),
    "metrics_match": metrics_match,
    "final_eval_top1": rec_b[-1]["eval_top1"] if rec_b else None,
    "checkpoint_overhead_fraction": summary["checkpoint_overhead_fraction"],
  }
  print(
    f"\nfault drill: {kills} kill -9 at random steps, checkpoint every {args.every_steps} steps, {TOTAL_STEPS} steps"
  )
  print(f"{'kills survived':<32}{result['kills_survived']} ({mid_save} while a save was being written)")
  print(f"{'steps lost per kill (max, mean)':<32}{result['steps_lost_max']}, {result['steps_lost_mean']:.1f}")
  print(f"{'final step':<32}{step_b} (uninterrupted: {step_a})")
  print(f"{'state arrays that differ':<32}{len(mismatched)} {mismatched[:3]}")
  print(f"{'metrics.jsonl equal':<32}{metrics_match}")
  overhead = 100 * result["checkpoint_overhead_fraction"]
  print(f"{'checkpoint overhead':<32}{overhead:.2f}% of the loop time (uninterrupted run)")
  print(json.dumps(result))


if __name__ == "__main__":
  # A signal ends the drill at once: its train.py killed, its temporary root removed (the exit handlers).
  with signals_exit_at_once("the drill: nothing reported", exit_handlers=True):
    main()
