"""Mesh lab: measured step time per strategy and inter-node bandwidth, on an emulated cluster.

  python benchmarks/mesh_lab.py --nodes 2 --local 4 --bandwidth 50mbit,unshaped \\
      --strategies hierarchical,hitopk@0.001 --steps 30

Each "machine" is a network namespace whose egress is shaped with tc to the bandwidth
(light_jax/emulated_cluster.py; needs root). For each bandwidth and strategy the lab runs the real
multi-process path, `train.py` on --nodes processes (one per namespace, --local simulated CPU devices
each, jax.distributed over gloo on the namespace addresses), with a config (default
configs/fashion_mnist.py) and --set overrides, for --warmup + --steps steps with
`train.time_steps=True` (a step's seconds leave out the evaluations and saves after it), and one step more,
whose record is left out (the run's end, which syncs DiLoCo's machines off their period).
From the per-step records of process 0 it reports, after dropping the warm-up steps: the median step seconds
(for diloco the mean over its whole sync periods, since one step in sync_every crosses the machines), the
inter-node bytes per device per step from our accounting, and the bytes node 0 really sent over its link per
step (`wire_bytes_per_step`, from the kernel's counters, all of its devices together: --local times the
per-device figure, plus protocol overhead).

--loopback (no root or iproute2 needed): the processes run on this machine's 127.0.0.1 instead of in
namespaces, --bandwidth unshaped only; the wire bytes are not measured there (null), since every process
shares the loopback interface.

`predicted_step_seconds`: the simulator's step (light_jax/simulation.py) on the cost model of
`comm.fusion="adaptive"` (light_jax/parallel/cost_model.py), calibrated on these links: before the
cells of a bandwidth, benchmarks/calibrate_links.py runs on the cluster at that shaping and fits
alpha/beta per level. A cell's prediction is the step time measured unshaped for the same strategy,
less the modelled time of that step's collectives (its `comm_buckets` in summary.json) at the unshaped
fit, plus the modelled time of the cell's own at the shaped fit, without overlap (XLA on CPU runs
collectives in line; for diloco, whose collectives across machines run one step in sync_every, 1/sync_every
of that change); null without an unshaped cell. `link_seconds` is the measured difference from the unshaped step:
the time the step waits on the shaped link. No latency is
added (the kernel has no sch_netem). All processes share this machine's CPU cores, which inflates
compute time with --nodes x --local devices.

Strategies: NAME or NAME@DENSITY (powersgd@RANK, diloco@STEPS_BETWEEN_SYNCS), with "/bfloat16" for the
bfloat16 wire dtype ("hierarchical/bfloat16") and "/compact" for compact pairs ("hitopk@0.01/compact");
"auto" (or auto@DENSITY) chooses per bucket from the links calibrated at that bandwidth.
What every cell's train.py would refuse (a config field, a strategy the mesh cannot run, a missing dataset) is
refused before the first calibration. A cell whose run fails (or a bandwidth whose calibration fails, with its
cells) is named in one line and the others go on; the table and the JSON line then hold the cells that finished,
and the lab exits 1.
--plot FILE draws predicted against measured step seconds for every cell. The last line is one JSON
object keyed "<strategy>@<bandwidth>" (e.g. "hitopk@0.001@50mbit"); each cell also holds `inter_link`,
the calibrated alpha (seconds) and beta (seconds per byte) of a machine's link at that bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from calibrate_links import calibrate_on_cluster  # noqa: E402  (benchmarks/, this script's directory)

from light_jax import cli, simulation  # noqa: E402
from light_jax import config as config_lib  # noqa: E402
from light_jax.emulated_cluster import (  # noqa: E402
  ClusterError,
  EmulatedCluster,
  LoopbackCluster,
  check_privileges,
  free_port,
  parse_rate,
  report_failure,
)
from light_jax.parallel import cost_model  # noqa: E402
from light_jax.parallel.reducer import DILOCO  # noqa: E402


def parse_strategy(text: str) -> tuple[str, list[str]]:
  """ "hitopk@0.001" -> ("hitopk@0.001", its comm overrides): NAME@VALUE sets the density of the top-k
  strategies, the rank of powersgd, the steps between syncs of diloco; "/bfloat16" sends the dense hops
  in bfloat16 (comm.dtype): "hierarchical/bfloat16"; "/compact" sets comm.compact_pairs. Raises ValueError
  (config.ConfigError) for an unknown name or a bad value, before any run."""
  return text, [f"--config.comm.{field}={value}" for field, value in config_lib.strategy_fields(text).items()]


def train_on_cluster(
  cluster: EmulatedCluster | LoopbackCluster,
  local: int,
  config: str,
  overrides: list[str],
  workdir: str,
  peer_timeout: float,
  timeout: float,
) -> None:
  """Runs `train.py --config config` on every node of ``cluster`` (one process each, ``local`` simulated
  devices) with ``overrides``, as a multi-machine run over jax.distributed; raises if a process fails."""
  argv = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config, "--workdir", workdir,
          *cluster_mesh(cluster.nodes, local), *overrides, f"--coordinator={cluster.coordinator}:{free_port()}",
          f"--num_processes={cluster.nodes}", f"--peer_timeout={peer_timeout}"]  # fmt: skip
  cluster.run_everywhere(argv, timeout, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def set_overrides(args) -> list[str]:
  """The train.py overrides of --set FIELD=VALUE, which come after every other (they win)."""
  return [f"--config.{s}" for s in args.set]


def cluster_mesh(nodes: int, local: int) -> list[str]:
  """train.py's mesh on the emulated cluster: a process per machine, ``local`` devices each."""
  return [f"--config.mesh.cpu_devices={nodes * local}", "--config.mesh.nodes=-1", "--config.mesh.local=-1"]


def check_run(config: str, overrides: list[str], nodes: int, local: int) -> ml_collections.ConfigDict:
  """The run's config; raises ValueError with train.py's own reason where it would refuse ``overrides`` on the
  emulated cluster (an override naming no field, a strategy its mesh cannot run): before any calibration or run,
  not in every cell. Checked in ROOT, where the runs' train.py reads the config's relative paths (a calibration
  file)."""
  with contextlib.chdir(ROOT):
    resolved = cli.resolve_config(config, [*cluster_mesh(nodes, local), *overrides])
    config_lib.validate(resolved, num_devices=nodes * local, num_processes=nodes)
  return resolved


def check_data(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError with the data loader's reason where the runs' dataset is missing or unreadable: before the
  link calibrations, not in the first cell. Opened as train.py opens it in ROOT, without building a decoded cache."""
  from light_jax import data as data_lib

  data_config = config.data.copy_and_resolve_references()
  data_config.cache = "none"
  with contextlib.chdir(ROOT):
    try:
      data_lib.load_dataset(data_config)
    except data_lib.DataError as e:
      raise ValueError(f"the runs' data: {e}") from None


def run_cell(
  cluster: EmulatedCluster | LoopbackCluster, args, strategy_overrides: list[str], workdir: str, links: str
) -> dict:
  """One short timed training run on the cluster; returns its median step and bytes from process 0's records
  (DiLoCo's: the means over its whole sync periods). ``links``: the calibration file of the current shaping, the
  cost model of comm.strategy=auto and adaptive fusion."""
  overrides = [
    # One step more than measured, left out: the run's end, which syncs DiLoCo's machines off their period.
    f"--config.max_steps={args.warmup + args.steps + 1}",
    f"--config.comm.cost_model={links}",
    "--config.train.time_steps=True",
    "--config.checkpoint.every_steps=0",
    "--config.data.eval_subset=1000",  # one evaluation at the end: keep it short
    *strategy_overrides,
    *set_overrides(args),
  ]
  train_on_cluster(cluster, args.local, args.config, overrides, workdir, args.peer_timeout, args.timeout)
  with open(os.path.join(workdir, "step_times.jsonl")) as f:
    timed = [json.loads(line) for line in f]
  if len(timed) < args.warmup + args.steps + 1:  # the config's whole run is shorter: a median of fewer steps
    raise RuntimeError(
      f"the run took {len(timed)} steps, fewer than --warmup {args.warmup} + --steps {args.steps} + 1: lower them, or "
      "lengthen the run (--set num_epochs=N, --set data.train_subset=N)"
    )
  steps = timed[args.warmup : args.warmup + args.steps]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  comm = summary["config"]["comm"]
  diloco = comm["strategy"] == DILOCO
  average = statistics.median
  if diloco:
    # One step in sync_every crosses the machines: the median would be a step without it. Whole periods
    # (steps k H + 1 .. (k + 1) H, counted from 1), averaged; check_args makes --steps hold one at least.
    every = comm["sync_every"]
    first = next(i for i, s in enumerate(steps) if s["step"] % every == 1 % every)
    last = max(i for i, s in enumerate(steps) if s["step"] % every == 0)
    steps, average = steps[first : last + 1], statistics.fmean
  return {
    "step_seconds": average(s["seconds"] for s in steps),
    "inter_node_bytes_per_step": summary["inter_node_bytes_per_step"],
    # On 127.0.0.1 every process shares the loopback interface: no per-machine count.
    "wire_bytes_per_step": average(s["sent_bytes"] for s in steps) if cluster.measures_wire else None,
    "comm_buckets": summary["comm_buckets"],
    "wire_itemsize": 2 if comm["dtype"] == "bfloat16" else 4,
    "compact_pairs": comm["compact_pairs"],
    "strategy": comm["strategy"],
    "sync_every": comm["sync_every"] if diloco else None,
  }


def predict_step(unshaped: dict, cell: dict, unshaped_fit: dict, shaped_fit: dict, nodes: int, local: int) -> float:
  """The simulator's step (light_jax/simulation.py, no overlap) for ``cell``: the unshaped step of the same
  strategy less its collectives at the unshaped links' fit, plus ``cell``'s collectives at the shaped fit (the
  buckets may differ: adaptive fusion and auto plan them from each bandwidth's calibration). The links inside
  a machine are not shaped: both keep the unshaped intra-node fit. DiLoCo's collectives across machines (its
  comm_buckets: a sync step's all-reduce) run one step in sync_every, and its step is the mean over whole sync
  periods: they move by 1/sync_every of a sync's time per step."""
  measured_on = cost_model.ClusterCost.from_dict(unshaped_fit)
  moved_to = cost_model.ClusterCost(intra=measured_on.intra, inter=cost_model.LinkCost(**shaped_fit["inter"]))

  def buckets(c: dict) -> list[simulation.BucketComm]:
    return [simulation.BucketComm(s, n, k, compact_pairs=c["compact_pairs"]) for s, n, k in c["comm_buckets"]]

  moved = simulation.move_measured_step(
    unshaped["step_seconds"], buckets(unshaped), measured_on, moved_to, nodes, local, cell["wire_itemsize"],
    moved_buckets=buckets(cell),
  )  # fmt: skip
  every = cell.get("sync_every") or 1  # set for DiLoCo's cells only
  return unshaped["step_seconds"] + (moved - unshaped["step_seconds"]) / every


def run_mesh(
  args, rates: dict[str, int | None], requested: list[tuple[str, list[str]]]
) -> tuple[dict[str, dict], dict[str, dict], list[str]]:
  """Every (bandwidth, strategy) cell on one emulated cluster of args.nodes x args.local; returns the cells that
  finished, the link calibration per bandwidth, and the names of the cells and calibrations that failed."""
  results, calibration, links, failed = {}, {}, {}, []
  order = sorted(rates.items(), key=lambda item: item[1] is not None)  # unshaped first
  cluster = LoopbackCluster(args.nodes) if args.loopback else EmulatedCluster(args.nodes)
  with cluster, tempfile.TemporaryDirectory(prefix="mesh_lab_") as tmp:
    for text, rate in order:
      cluster.shape(rate)
      print(f"calibrating the links at {text} ...", file=sys.stderr, flush=True)
      links[text] = os.path.join(tmp, f"links_{text}.json")
      try:
        calibration[text], _ = calibrate_on_cluster(cluster, args.local, links[text])
      except RuntimeError as e:  # a failed job: this bandwidth's cells are left out (no cost model for them)
        report_failure(f"the calibration at {text}", e)
        failed.append(f"calibration@{text}")
    # Strategy by strategy, its unshaped cell right before its shaped ones: the unshaped step is the
    # compute part of their prediction, and this shared machine's speed drifts over minutes.
    for label, strategy_overrides in requested:
      for text, rate in order:
        if text not in calibration:
          continue
        cluster.shape(rate)
        print(f"running {label} at {text} on {args.nodes} x {args.local} ...", file=sys.stderr, flush=True)
        workdir = os.path.join(tmp, f"{label}@{text}".replace("/", "_"))
        try:
          cell = run_cell(cluster, args, strategy_overrides, workdir, links[text])
        except RuntimeError as e:  # a failed or timed-out run: the other cells do not depend on it
          report_failure(f"{label}@{text}", e)
          failed.append(f"{label}@{text}")
          continue
        unshaped = results.get(f"{label}@unshaped")
        cell["link_seconds"] = cell["step_seconds"] - unshaped["step_seconds"] if unshaped else None
        cell["predicted_step_seconds"] = (
          predict_step(unshaped, cell, calibration["unshaped"], calibration[text], args.nodes, args.local)
          if unshaped
          else None
        )
        cell["inter_link"] = calibration[text]["inter"]  # the fitted alpha (s) and beta (s/B) of a machine's link
        results[f"{label}@{text}"] = cell
  for cell in results.values():
    del cell["comm_buckets"], cell["wire_itemsize"], cell["compact_pairs"], cell["strategy"]
  return results, calibration, failed


def plot_predictions(results: dict[str, dict], path: str) -> None:
  """Predicted against measured step seconds, one labelled point per shaped cell."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  cells = {k: c for k, c in results.items() if c["predicted_step_seconds"] is not None}
  if not cells:  # no cell had an unshaped cell of its strategy to predict from
    print(f"no predicted step times to plot: {path} not written", file=sys.stderr)
    return
  values = [v for c in cells.values() for v in (c["step_seconds"], c["predicted_step_seconds"])]
  low, high = 0.7 * min(values), 1.4 * max(values)
  fig, ax = plt.subplots(figsize=(6.5, 6))
  ax.plot([low, high], [low, high], color="gray", lw=1, label="exact")
  ax.fill_between([low, high], [0.8 * low, 0.8 * high], [1.2 * low, 1.2 * high], color="gray", alpha=0.15,
                  label="within 20%")  # fmt: skip
  for key, c in cells.items():
    ax.scatter(c["step_seconds"], c["predicted_step_seconds"], s=18)
    ax.annotate(key, (c["step_seconds"], c["predicted_step_seconds"]), fontsize=7, xytext=(4, -8),
                textcoords="offset points")  # fmt: skip
  ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step seconds",
         ylabel="predicted step seconds (calibrated cost model)",
         title="Mesh lab: predicted against measured step time")  # fmt: skip
  ticks = [t for t in (0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20) if low <= t <= high]
  for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.legend(loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}", file=sys.stderr)


def load_experiment(spec: str, args) -> list[tuple[int, int]]:
  """Applies a mesh experiment config (FILE[:VARIANT], e.g. configs/mesh_experiments.py) to ``args``;
  returns its mesh shapes."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(os.path.join(ROOT, path)):
    raise ValueError(f"no such file: {path}; give a mesh experiment config such as configs/mesh_experiments.py")
  module_spec = importlib.util.spec_from_file_location("mesh_experiment", os.path.join(ROOT, path))
  if module_spec is None or not path.endswith(".py"):
    raise ValueError(f"{path} is not a Python file; give a mesh experiment config such as configs/mesh_experiments.py")
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:  # not Python, or Python with a syntax error: the file and line, as train.py's --config
    raise ValueError(
      f"{path}, line {e.lineno}: {e.msg} ({(e.text or '').strip()[:60]!r}); see configs/mesh_experiments.py"
    ) from None
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"{path} has no get_config(variant=None); see configs/mesh_experiments.py")
  try:
    experiment = module.get_config(variant or None)  # ValueError for an unknown variant
  except TypeError as e:  # a get_config that takes no variant
    raise ValueError(f"{path}: get_config(variant=None) is called with the variant: {e}") from None
  missing = [
    f for f in ("meshes", "bandwidths", "strategies", "steps", "warmup", "config", "overrides") if f not in experiment
  ]
  if missing:
    raise ValueError(
      f"{path} is not a mesh experiment config (it has no {', '.join(missing)}); see configs/mesh_experiments.py"
    )
  args.bandwidth = ",".join(experiment.bandwidths)
  args.strategies = ",".join(experiment.strategies)
  args.steps, args.warmup, args.config = experiment.steps, experiment.warmup, experiment.config
  args.set = [*experiment.overrides, *args.set]
  meshes = list(experiment.meshes)
  if not meshes:  # it ran nothing, printed an empty table and exited 0
    raise ValueError(f"{path}: meshes is empty; give at least one [nodes, devices per node], e.g. [[2, 4]]")
  for mesh in meshes:
    if not (isinstance(mesh, (list, tuple)) and len(mesh) == 2 and all(type(n) is int for n in mesh)):
      raise ValueError(f"{path}: meshes holds {mesh!r}; each mesh is [nodes, devices per node], two integers")
  return [tuple(mesh) for mesh in meshes]


def parse_bandwidths(text: str) -> dict[str, int | None]:
  """ "50mbit, Unshaped" -> {"50mbit": 50_000_000, "unshaped": None}: each label as parse_rate reads it (lower
  case, no spaces), since the cells' keys and the lookups of the unshaped cell and fit use the label."""
  return {label.strip().lower(): parse_rate(label) for label in text.split(",")}


def check_args(args, meshes: list[tuple[int, int]]) -> tuple[dict[str, int | None], list[tuple[str, list[str]]]]:
  """The rates per bandwidth label and the strategies (parse_strategy) ``args`` asks for; raises ValueError for
  what would otherwise fail only after runs."""
  for nodes, local in meshes:
    if nodes < 1 or local < 1:
      raise ValueError(f"a mesh of {nodes} x {local} (nodes x devices): each must be at least 1")
  cli.check_seconds(args, "peer_timeout", "timeout")  # else every cell fails after the calibrations
  if args.steps < 1:  # no step to take the median of, after a calibration and a whole run
    raise ValueError(f"--steps {args.steps} must be at least 1 (the measured steps per cell)")
  if args.warmup < 0:  # a negative slice would keep the wrong records
    raise ValueError(f"--warmup {args.warmup} must be at least 0 (the steps dropped before measuring)")
  for field_value in args.set:  # train.py's --config.FIELD=VALUE, without its --config.
    if not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*=.*", field_value, re.DOTALL) or field_value.startswith("config."):
      raise ValueError(f"--set {field_value!r}: give FIELD=VALUE without --config., e.g. --set num_epochs=3")
  rates = parse_bandwidths(args.bandwidth)
  shaped = [label for label, rate in rates.items() if rate is not None]
  if args.loopback and shaped:
    raise ValueError(f"the 127.0.0.1 mode cannot shape links ({', '.join(shaped)}: that needs root and tc, network "
                     "namespaces); use --loopback --bandwidth unshaped, or drop --loopback")  # fmt: skip
  if args.plot and (not shaped or len(shaped) == len(rates)):
    # A prediction moves the unshaped step's collectives to a shaped link: it needs one of each.
    raise ValueError("--plot draws predicted against measured step seconds, which needs an unshaped and a shaped "
                     "bandwidth, e.g. --bandwidth 50mbit,unshaped")  # fmt: skip
  requested = [parse_strategy(s) for s in args.strategies.split(",")]
  labels = [label for label, _ in requested]
  twice = sorted({label for label in labels if labels.count(label) > 1})
  if twice:  # each cell ran twice, and the table showed one row
    raise ValueError(f"--strategies names {', '.join(twice)} more than once; give each strategy once")
  for nodes, local in meshes:
    for label, strategy_overrides in requested:
      try:
        # As run_cell overrides: the cells plan with the calibration file that the lab writes (a preset here)
        cell = ["--config.comm.cost_model=v100_nvlink_25gbe", *strategy_overrides, *set_overrides(args)]
        resolved = check_run(args.config, cell, nodes, local)
      except ValueError as e:
        raise ValueError(f"{label} on {nodes} x {local}: {e}") from None
      if resolved.comm.strategy == "dense" and resolved.comm.dtype == "bfloat16" and (nodes, local) == meshes[0]:
        # docs/techniques.md section 1: XLA's CPU backend widens a bfloat16 psum to float32.
        print(f"warning: {label}: on CPU devices XLA carries dense's bfloat16 all-reduce as float32: twice the bytes "
              "its row counts and its prediction assumes", file=sys.stderr, flush=True)  # fmt: skip
      every = resolved.comm.sync_every
      if resolved.comm.strategy == DILOCO and args.steps < 2 * every - 1:
        raise ValueError(
          f"{label}: --steps {args.steps} may hold no whole period of {every} steps (one outer step each); a "
          f"DiLoCo cell's step is the mean over whole periods: use --steps {2 * every - 1} or more"
        )
  check_data(resolved)  # the cells differ only in their mesh and comm fields: one dataset
  return rates, requested


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--bandwidth", default="50mbit,unshaped", help="comma-separated rates per node link")
  parser.add_argument("--strategies", default="hierarchical,hitopk@0.001")
  parser.add_argument("--steps", type=int, default=30, help="measured steps per cell")
  parser.add_argument("--warmup", type=int, default=5, help="steps dropped before measuring")
  parser.add_argument("--config", default="configs/fashion_mnist.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config override")
  parser.add_argument("--experiment", metavar="FILE[:VARIANT]",
                      help="a mesh experiment config (meshes, bandwidths, strategies, steps, config): replaces "
                           "--nodes to --config; --set still adds overrides")  # fmt: skip
  parser.add_argument("--loopback", action="store_true",
                      help="the unshaped 127.0.0.1 mode: no namespaces or root; --bandwidth unshaped")  # fmt: skip
  parser.add_argument("--peer_timeout", type=float, default=60.0)
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
  parser.add_argument("--plot", metavar="FILE.png", help="draw predicted against measured step seconds")
  args = parser.parse_args()
  if args.plot is not None:  # its folder now, not a traceback after the cells ("": refused)
    args.plot = cli.plot_path(args.plot, "--plot")
  try:
    meshes = load_experiment(args.experiment, args) if args.experiment else [(args.nodes, args.local)]
  except (OSError, ValueError) as e:
    parser.error(f"--experiment {args.experiment}: {e}")
  try:
    rates, requested = check_args(args, meshes)
    if not args.loopback:  # no root or iproute2: bad input (exit 2), said before any cell
      check_privileges()
  except (ValueError, ClusterError) as e:
    parser.error(str(e))

  results, calibrations, failed = {}, {}, []
  for index, (nodes, local) in enumerate(meshes):
    mesh_args = copy.copy(args)
    mesh_args.nodes, mesh_args.local = nodes, local
    try:
      cells, calibration, mesh_failed = run_mesh(mesh_args, rates, requested)
    except KeyboardInterrupt:  # a traceback before; the mesh's processes and namespaces are gone (run_mesh's with)
      finished = ", ".join(f"{n} x {m}" for n, m in meshes[:index]) or "none"
      print(f"stopped by Ctrl-C during the {nodes} x {local} mesh; meshes finished before it: {finished}",
            file=sys.stderr)  # fmt: skip
      sys.exit(130)  # 128 + SIGINT, as a shell reports it
    except ClusterError as e:
      if not results:  # nothing ran (a namespace or link could not be made): the one line
        sys.exit(f"error: {e}")
      print(f"error: the {nodes} x {local} mesh failed: {e}", file=sys.stderr)  # the earlier meshes' cells stay
      failed.append(f"{nodes}x{local}")
      continue
    prefix = f"{nodes}x{local}:" if len(meshes) > 1 else ""  # keys stay "<strategy>@<bandwidth>" for one mesh
    failed += [prefix + name for name in mesh_failed]
    results.update({prefix + key: cell for key, cell in cells.items()})
    calibrations.update({prefix + key: fit for key, fit in calibration.items()})

  print(f"mesh lab: {args.steps} steps per cell after {args.warmup} warm-up; meshes (nodes x devices): "
        f"{', '.join(f'{n} x {m}' for n, m in meshes)}")  # fmt: skip
  print("link calibration (inter-node, per machine's link): " + ("; ".join(
    f"{key} alpha {1e3 * fit['inter']['alpha']:.2f} ms, {8e-6 / fit['inter']['beta']:,.1f} Mbit/s"
    for key, fit in calibrations.items() if fit["inter"]["beta"]) or "none (one machine)"))  # fmt: skip
  print(f"{'cell':<34}{'step s':>9}{'predicted s':>13}{'error':>8}{'link s':>9}{'inter-node B/dev':>18}"
        f"{'wire B/node':>14}")  # fmt: skip
  for key, cell in results.items():
    predicted, measured = cell["predicted_step_seconds"], cell["step_seconds"]
    error = f"{100 * (predicted / measured - 1):+.0f}%" if predicted is not None else "-"
    link = f"{cell['link_seconds']:.3f}" if cell["link_seconds"] is not None else "-"
    predicted = f"{predicted:.3f}" if predicted is not None else "-"
    wire = f"{cell['wire_bytes_per_step']:,.0f}" if cell["wire_bytes_per_step"] is not None else "-"
    print(f"{key:<34}{measured:>9.3f}{predicted:>13}{error:>8}"
          f"{link:>9}{cell['inter_node_bytes_per_step']:>18,}{wire:>14}")  # fmt: skip
  if args.plot:
    plot_predictions(results, args.plot)
  print(json.dumps(results))
  if failed:
    sys.exit(f"error: {', '.join(failed)} failed (see above); the table holds the cells that finished")


if __name__ == "__main__":
  main()
