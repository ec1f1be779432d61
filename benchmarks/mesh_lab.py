"""Mesh lab: measured step time per strategy and inter-node bandwidth, on an emulated cluster.

  python benchmarks/mesh_lab.py --nodes 2 --local 4 --bandwidth 50mbit,unshaped \\
      --strategies hierarchical,hitopk@0.001 --steps 30

Each "machine" is a network namespace whose egress is shaped with tc to the bandwidth
(light_jax/emulated_cluster.py; needs root). For each bandwidth and strategy the lab runs the real
multi-process path, `train.py` on --nodes processes (one per namespace, --local simulated CPU devices
each, jax.distributed over gloo on the namespace addresses), with a config (default
configs/fashion_mnist.py) and --set overrides, for --warmup + --steps steps with
`train.time_steps=True`. From the per-step records of process 0 it reports, after dropping the warm-up
steps: the median step seconds, the inter-node bytes per device per step from our accounting, and the
bytes node 0 really sent over its link per step (`wire_bytes_per_step`, from the kernel's counters,
all of its devices together: --local times the per-device figure, plus protocol overhead).

`predicted_step_seconds`: the step time measured unshaped for the same strategy (compute and local
traffic) plus the time node 0's link needs for the accounted inter-node bytes of its --local devices
(of one device for the flat collectives, whose accounting is the boundary device's traffic) at the
shaped rate; null when the strategy has no unshaped cell in the run. No latency is added (the kernel
has no sch_netem). All processes share this machine's CPU cores, which inflates compute time with
--nodes x --local devices.

Strategies: NAME or NAME@DENSITY, with "/bfloat16" for the bfloat16 wire dtype ("hierarchical/bfloat16").
The last line is one JSON object keyed "<strategy>@<bandwidth>" (e.g. "hitopk@0.001@50mbit").
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from light_jax.emulated_cluster import ClusterError, EmulatedCluster, parse_rate  # noqa: E402
from light_jax.parallel import strategies  # noqa: E402


def parse_strategy(text: str) -> tuple[str, list[str]]:
  """ "hitopk@0.001" -> ("hitopk@0.001", [strategy and density overrides]); a "/bfloat16" suffix sends the
  dense hops in bfloat16 (comm.dtype): "hierarchical/bfloat16"."""
  spec, _, wire = text.partition("/")
  name, _, density = spec.partition("@")
  overrides = [f"--config.comm.strategy={name}"]
  if density:
    overrides.append(f"--config.comm.density={float(density)}")
  if wire:
    overrides.append(f"--config.comm.dtype={wire}")
  return text, overrides


def strategy_name(label: str) -> str:
  return label.partition("/")[0].partition("@")[0]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_cell(cluster: EmulatedCluster, args, strategy_overrides: list[str], workdir: str) -> dict:
  """One training run on the cluster; returns its step records (process 0) and the accounted bytes."""
  overrides = [
    "--config.mesh.nodes=-1",
    "--config.mesh.local=-1",
    f"--config.mesh.cpu_devices={args.nodes * args.local}",
    f"--config.max_steps={args.warmup + args.steps}",
    "--config.train.time_steps=True",
    "--config.checkpoint.every_steps=0",
    "--config.data.eval_subset=1000",  # one evaluation at the end: keep it short
    *strategy_overrides,
    *(f"--config.{s}" for s in args.set),
  ]
  port = free_port()
  procs = [
    cluster.run(
      node,
      [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config",
        args.config,
        "--workdir",
        workdir,
        *overrides,
        f"--coordinator={cluster.coordinator}:{port}",
        f"--num_processes={args.nodes}",
        f"--process_id={node}",
        f"--peer_timeout={args.peer_timeout}",
      ],  # fmt: skip
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for node in range(args.nodes)
  ]
  outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
  for node, (proc, out) in enumerate(zip(procs, outputs)):
    if proc.returncode:
      raise RuntimeError(f"node {node} exited {proc.returncode}:\n{out[-3000:]}")
  with open(os.path.join(workdir, "step_times.jsonl")) as f:
    steps = [json.loads(line) for line in f][args.warmup :]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  return {
    "step_seconds": statistics.median(s["seconds"] for s in steps),
    "inter_node_bytes_per_step": summary["inter_node_bytes_per_step"],
    "wire_bytes_per_step": statistics.median(s["sent_bytes"] for s in steps),
  }


def run_mesh(args, rates: dict[str, int | None], requested: list[tuple[str, list[str]]]) -> dict[str, dict]:
  """Every (bandwidth, strategy) cell on one emulated cluster of args.nodes x args.local."""
  results = {}
  with EmulatedCluster(args.nodes) as cluster, tempfile.TemporaryDirectory(prefix="mesh_lab_") as tmp:
    # Unshaped cells first: their step time is the compute part of the shaped cells' prediction.
    for text, rate in sorted(rates.items(), key=lambda item: item[1] is not None):
      cluster.shape(rate)
      for label, strategy_overrides in requested:
        print(f"running {label} at {text} on {args.nodes} x {args.local} ...", file=sys.stderr, flush=True)
        cell = run_cell(cluster, args, strategy_overrides, os.path.join(tmp, f"{label}@{text}".replace("/", "_")))
        unshaped = results.get(f"{label}@unshaped")
        # A node's link carries what all its devices send across nodes, except for flat collectives
        # over every device (dense, topk), whose accounting already is the boundary device's whole traffic.
        flat = strategies.get(strategy_name(label)).flat
        node_bytes = cell["inter_node_bytes_per_step"] * (1 if flat else args.local)
        link_seconds = node_bytes * 8 / rate if rate else 0.0
        cell["predicted_step_seconds"] = unshaped["step_seconds"] + link_seconds if unshaped else None
        results[f"{label}@{text}"] = cell
  return results


def load_experiment(spec: str, args) -> list[tuple[int, int]]:
  """Applies a mesh experiment config (FILE[:VARIANT], e.g. configs/mesh_experiments.py) to ``args``;
  returns its mesh shapes."""
  path, _, variant = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("mesh_experiment", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  experiment = module.get_config(variant or None)
  args.bandwidth = ",".join(experiment.bandwidths)
  args.strategies = ",".join(experiment.strategies)
  args.steps, args.warmup, args.config = experiment.steps, experiment.warmup, experiment.config
  args.set = [*experiment.overrides, *args.set]
  return [tuple(mesh) for mesh in experiment.meshes]


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
  parser.add_argument("--peer_timeout", type=float, default=60.0)
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
  args = parser.parse_args()
  meshes = load_experiment(args.experiment, args) if args.experiment else [(args.nodes, args.local)]
  try:
    rates = {text: parse_rate(text) for text in args.bandwidth.split(",")}
  except ValueError as e:
    parser.error(str(e))
  requested = [parse_strategy(s) for s in args.strategies.split(",")]

  results = {}
  for nodes, local in meshes:
    mesh_args = copy.copy(args)
    mesh_args.nodes, mesh_args.local = nodes, local
    try:
      cells = run_mesh(mesh_args, rates, requested)
    except ClusterError as e:
      sys.exit(f"error: {e}")
    prefix = f"{nodes}x{local}:" if len(meshes) > 1 else ""  # keys stay "<strategy>@<bandwidth>" for one mesh
    results.update({prefix + key: cell for key, cell in cells.items()})

  print(f"mesh lab: {args.steps} steps per cell after {args.warmup} warm-up; meshes (nodes x devices): "
        f"{', '.join(f'{n} x {m}' for n, m in meshes)}")  # fmt: skip
  print(f"{'cell':<34}{'step s':>9}{'predicted s':>13}{'inter-node B/dev':>18}{'wire B/node':>14}")
  for key, cell in results.items():
    predicted = f"{cell['predicted_step_seconds']:.3f}" if cell["predicted_step_seconds"] is not None else "-"
    print(f"{key:<34}{cell['step_seconds']:>9.3f}{predicted:>13}{cell['inter_node_bytes_per_step']:>18,}"
          f"{cell['wire_bytes_per_step']:>14,.0f}")  # fmt: skip
  print(json.dumps(results))


if __name__ == "__main__":
  main()
