"""Light's claim in miniature, as time to accuracy: whole training runs on an emulated cluster.

  sudo .venv/bin/python benchmarks/time_to_accuracy.py --nodes 2 --local 4 --bandwidth 50mbit \\
      --strategies hierarchical,hitopk@0.01,hitopk@0.001,gtopk@0.01 --target 0.92 \\
      --plot docs/time_to_accuracy.png          (or: make time-to-accuracy)

For each strategy, the whole config (default configs/fashion_mnist.py, --set overrides for all runs)
trains on --nodes "machines" (network namespaces, one train.py process each with --local simulated CPU
devices, jax.distributed over gloo) whose links are shaped to --bandwidth (benchmarks/mesh_lab.py,
light_jax/emulated_cluster.py; needs root). Each run evaluates on the test set after every epoch;
the clock is `train_seconds` of metrics.jsonl, the training time since the start with the evaluations
left out. Reported per strategy: the training seconds and epochs until the first evaluation at or above
--target top-1 (null if never), the final top-1 and the mean seconds per step (training seconds / steps).
Runs are the same config but for comm.strategy and comm.density, one after the other on this machine's
shared cores.

--report_only reads the runs already in --workdir (a run cut short is shown as far as it got; one with no
evaluation yet says so; one made by another command, another bandwidth say, or whose config differs from what the
command gives now, the config file edited, is left out and named). Each run's
workdir (metrics.jsonl, summary.json, checkpoints) is kept under --workdir/<strategy>, and the table's figures
in --workdir/results.json (beside earlier commands' strategies on the same setting, but for those whose run's
config has changed since). Running the same command again reuses a finished run (unless its config has changed
since: then it runs again) and resumes one cut short from its last checkpoint, its clock going on from the
checkpoint's (benchmarks/train_runs.py prepare_workdir); a run of another command, or any with --rerun, starts
over. A run that fails is named in one line and the others go
on; the script then exits 1 after the table.
The last line is one JSON object keyed by strategy (those with an evaluation), each with
`seconds_to_target`, `epochs_to_target`, `final_top1`, `train_seconds` and `step_seconds`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import train_runs  # benchmarks/, this script's directory
from mesh_lab import check_data, check_run, cluster_mesh, parse_strategy, set_overrides, train_on_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from light_jax import cli  # noqa: E402
from light_jax.emulated_cluster import (  # noqa: E402
  ClusterError,
  EmulatedCluster,
  check_privileges,
  parse_rate,
  report_failure,
)
from light_jax.metrics import MetricsError  # noqa: E402


def time_to_target(records: list[dict], target: float) -> tuple[float | None, float | None]:
  """(training seconds, epoch) of the first evaluation at or above ``target`` top-1; (None, None) if none."""
  for record, seconds in zip(records, train_runs.elapsed(records)):
    if record["eval_top1"] >= target:
      return seconds, record["epoch"]
  return None, None


def plot_curves(runs: dict[str, list[dict]], target: float, title: str, path: str) -> None:
  """Test top-1 against training seconds, one line per strategy, the target as a dashed line."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  for label, records in runs.items():
    seconds = [0.0, *train_runs.elapsed(records)]
    top1 = [None] + [100 * r["eval_top1"] for r in records]
    (line,) = ax.plot(seconds[1:], top1[1:], marker="o", ms=3, label=label)
    reached, _ = time_to_target(records, target)
    if reached is not None:
      ax.axvline(reached, color=line.get_color(), ls=":", lw=1)
  ax.axhline(100 * target, color="gray", ls="--", lw=1, label=f"target {100 * target:g}%")
  ax.set(xlabel="training seconds (evaluations excluded)", ylabel="test top-1 (%)", title=title)
  ax.set_ylim(bottom=max(0, min(100 * r["eval_top1"] for rs in runs.values() for r in rs) - 2))
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}", file=sys.stderr)


def parse_args() -> tuple[argparse.Namespace, int | None, list[tuple[str, list[str]]]]:
  """(the flags, the link rate, the strategies with their overrides); a bad flag ends here, before any run."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--bandwidth", default="50mbit", help="rate of each machine's link, or 'unshaped'")
  parser.add_argument("--strategies", default="hierarchical,hitopk@0.01,hitopk@0.001,gtopk@0.01")
  parser.add_argument("--target", type=float, default=0.92, help="test top-1 to reach")
  parser.add_argument("--config", default="configs/fashion_mnist.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config override")
  parser.add_argument("--workdir", default="runs/time_to_accuracy")
  parser.add_argument("--plot", metavar="FILE.png")
  parser.add_argument("--peer_timeout", type=float, default=120.0)
  parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
  parser.add_argument("--rerun", action="store_true", help="start every run over, even a finished one")
  parser.add_argument("--report_only", action="store_true",
                      help="train nothing: report the runs already in --workdir (finished or not)")  # fmt: skip
  args = parser.parse_args()
  if args.nodes < 1 or args.local < 1:
    parser.error(f"--nodes {args.nodes} --local {args.local}: each must be at least 1")
  if not 0 < args.target <= 1:  # a fraction: 92 would never be reached, after hours of runs
    parser.error(f"--target {args.target:g} must be a top-1 fraction in (0, 1], e.g. 0.92")
  try:
    cli.check_seconds(args, "peer_timeout", "timeout")  # else every run fails, once the emulated cluster is up
    rate = parse_rate(args.bandwidth)
    labels = [parse_strategy(text) for text in args.strategies.split(",")]
  except ValueError as e:
    parser.error(str(e))
  for label, strategy_overrides in labels:  # what train.py would refuse, before hours of runs
    try:
      resolved = check_run(args.config, run_overrides(args, strategy_overrides), args.nodes, args.local)
    except ValueError as e:
      parser.error(f"{label}: {e}")
  if not args.report_only:  # a missing dataset: said now, not by the first run on the emulated cluster
    try:
      check_data(resolved)
    except ValueError as e:
      parser.error(str(e))
  if args.plot is not None:  # its folder now, not a traceback after hours of runs ("": refused)
    args.plot = cli.plot_path(args.plot, "--plot")
  train_runs.check_workdir(parser, args.workdir)
  if args.report_only and not os.path.isdir(args.workdir):  # it printed "no evaluation yet" for each, exit 0
    parser.error(f"--report_only: --workdir={args.workdir} does not exist; give the folder the runs are in")
  if not args.report_only:  # no root: said now, as bad input (exit 2), not after the checks as an error
    try:
      check_privileges()
    except ClusterError as e:
      parser.error(str(e))
  return args, rate, labels


def run_overrides(args, strategy_overrides: list[str]) -> list[str]:
  """A strategy's train.py overrides, then the --set ones."""
  return [*strategy_overrides, *set_overrides(args)]


def run_command(args, overrides: list[str]) -> str:
  """The text stamped in a run's workdir. The mesh and the link are part of the run: a clock resumed at another
  bandwidth would mix two, and a report must not show a run made at another under this command's title."""
  command = shlex.join(["train.py", f"--config={args.config}", *overrides])
  return command + f"  # on {args.nodes} x {args.local} at {args.bandwidth.strip().lower()}"


def train_all(args, rate: int | None, labels: list[tuple[str, list[str]]], workdirs: dict[str, str]) -> list[str]:
  """Trains each strategy in turn on one emulated cluster, reusing or resuming its workdir when it holds a run
  of the same command; returns the strategies whose run failed (the later ones still run)."""
  failed = []
  try:
    with EmulatedCluster(args.nodes, rate) as cluster:
      for label, strategy_overrides in labels:
        overrides = run_overrides(args, strategy_overrides)
        rerun = args.rerun
        changed = "" if rerun else stale(args, workdirs[label], overrides)
        if changed:  # the same command gives another run now (the config file changed): its result is stale
          train_runs.say_stale(label, changed)
          rerun = True
        try:
          if not train_runs.prepare_workdir(label, workdirs[label], run_command(args, overrides), rerun):
            continue
        except train_runs.UnusableWorkdir as e:
          print(f"error: {e}", file=sys.stderr, flush=True)
          failed.append(label)
          continue
        print(f"training with {label} on {args.nodes} x {args.local} at {args.bandwidth} ...", file=sys.stderr,
              flush=True)  # fmt: skip
        try:
          train_on_cluster(cluster, args.local, args.config, overrides, workdirs[label], args.peer_timeout,
                           args.timeout)  # fmt: skip
        except RuntimeError as e:  # a failed or timed-out run: the next strategy's does not depend on it
          report_failure(label, e)
          failed.append(label)
  except ClusterError as e:
    sys.exit(f"error: {e}")
  return failed


def stale(args, workdir: str, overrides: list[str]) -> str:
  """How the config of ``workdir``'s finished run differs from the one ``overrides`` give now (with the mesh flags
  train_on_cluster adds), where it can change the result (``train_runs.config_changed``); "" where it does not, or
  no finished run is readable."""
  return train_runs.finished_run_changed(workdir, args.config, [*cluster_mesh(args.nodes, args.local), *overrides])


def summarize(records: list[dict], target: float) -> dict:
  """A run's row of the table and the JSON line, from its evaluations so far (at least one)."""
  seconds, epoch = time_to_target(records, target)
  last, train_seconds = records[-1], train_runs.elapsed(records)[-1]
  return {
    "seconds_to_target": seconds,
    "epochs_to_target": epoch,
    "final_top1": last["eval_top1"],
    "train_seconds": train_seconds,
    "step_seconds": train_seconds / last["step"],
    "inter_node_bytes_per_step": train_runs.mean_per_step(records, "inter_node_bytes_per_step"),
    "finished": bool(last["final"]),
  }


def main() -> None:
  args, rate, labels = parse_args()
  workdirs = {label: os.path.abspath(os.path.join(args.workdir, label.replace("/", "_"))) for label, _ in labels}
  failed = [] if args.report_only else train_all(args, rate, labels, workdirs)

  runs, left_out = {}, []
  for label, strategy_overrides in labels:
    stamped = train_runs.stamped_command(workdirs[label])
    command = run_command(args, run_overrides(args, strategy_overrides))
    if stamped is not None and stamped != command:  # only --report_only reads a workdir it did not just stamp
      print(f"{label}: left out: {workdirs[label]} holds a run of another command: {stamped}", file=sys.stderr)
      left_out.append(label)
      continue
    changed = stale(args, workdirs[label], run_overrides(args, strategy_overrides))
    if changed:  # --report_only, after the config file changed: the run is not this command's now
      print(f"{label}: left out: its run's config differs from the command's now ({changed})", file=sys.stderr)
      left_out.append(label)
      continue
    try:
      runs[label] = train_runs.read_records(workdirs[label])
    except MetricsError as e:  # a damaged metrics.jsonl: the other runs are still reported
      print(f"error: {label}: {e}", file=sys.stderr)
      failed.append(label)
  results = {label: summarize(records, args.target) for label, records in runs.items() if records}

  title = f"{args.nodes} x {args.local} emulated machines at {args.bandwidth}: test top-1 against training time"
  print(f"\n{title} (target {100 * args.target:g}%)")
  print(f"{'strategy':<22}{'to target s':>13}{'epochs':>8}{'last top-1':>12}{'epochs run':>12}{'train s':>10}"
        f"{'s/step':>9}{'inter-node B/dev':>18}")  # fmt: skip
  for label, records in runs.items():
    if label not in results:  # no workdir yet, or cut short before its first evaluation
      print(f"{label:<22}{'no evaluation yet':>20}")
      continue
    r = results[label]
    reached = f"{r['seconds_to_target']:.0f}" if r["seconds_to_target"] is not None else "not reached"
    epochs = f"{r['epochs_to_target']:g}" if r["epochs_to_target"] is not None else "-"
    run = f"{records[-1]['epoch']:g}" + ("" if r["finished"] else " (cut)")
    print(f"{label:<22}{reached:>13}{epochs:>8}{100 * r['final_top1']:>11.2f}%{run:>12}{r['train_seconds']:>10.0f}"
          f"{r['step_seconds']:>9.3f}{r['inter_node_bytes_per_step']:>18,}")  # fmt: skip
  if args.plot and results:
    plot_curves({label: runs[label] for label in results}, args.target, title, args.plot)
  elif args.plot:
    print(f"no plot: no run has an evaluation to draw ({args.plot} not written)", file=sys.stderr)
  if not left_out and results:  # else results.json keeps the figures of the command that made the runs
    write_results(os.path.join(args.workdir, "results.json"), args, results, [label for label, _ in labels])
  print(json.dumps(results))
  if failed:
    sys.exit(f"error: {', '.join(failed)} failed (see above); the other strategies are reported")


def write_results(path: str, args, results: dict, asked: tuple[str, ...] | list[str] = ()) -> None:
  """results.json: these strategies' results, beside the other strategies' from earlier commands on the same
  cluster and target, config and --set (a command for one strategy, or --report_only for some, replaced the file
  with theirs alone; a smoke run's --set num_epochs=1 figures sat beside a whole run's). A strategy of this
  command (``asked``) without a result now (--rerun, and the new run failed before its first evaluation) loses its
  earlier figures: their run is gone."""
  setting = {
    "bandwidth": args.bandwidth,
    "mesh": [args.nodes, args.local],
    "target": args.target,
    "config": args.config,
    "set": set_overrides(args),
  }
  earlier = {}
  try:
    with open(path) as f:
      earlier = json.load(f)
  except (OSError, ValueError):  # none yet, or unreadable: written anew
    pass
  if not isinstance(earlier, dict) or any(earlier.get(k) != v for k, v in setting.items()):
    earlier = {}  # another cluster or target: its figures do not compare with these
  for label in [label for label in asked if label in earlier and label not in results]:
    print(f"{label}: its figures in {path} are dropped: its run has no evaluation now", file=sys.stderr)
    del earlier[label]
  for label in [label for label in earlier if label not in setting and label not in results]:
    try:  # an earlier strategy's run made before the config file changed is not this setting's now
      _, strategy_overrides = parse_strategy(label)
    except ValueError:
      changed = "not a strategy"
    else:
      workdir = os.path.abspath(os.path.join(args.workdir, label.replace("/", "_")))
      changed = stale(args, workdir, run_overrides(args, strategy_overrides))
    if changed:
      print(f"{label}: its figures in {path} are dropped: its run's config differs now ({changed})", file=sys.stderr)
      del earlier[label]
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({**earlier, **setting, **results}, f)


if __name__ == "__main__":
  main()
