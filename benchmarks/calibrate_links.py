"""Fit the alpha-beta cost of each link level from measured all-reduces, here or on an emulated cluster.

  python benchmarks/calibrate_links.py --out runs/links.json [--nodes 2 --local 4]
  sudo .venv/bin/python benchmarks/calibrate_links.py --emulate 10mbit --nodes 2 --local 4 --out runs/links_10mbit.json
  python train.py ... --config.comm.fusion=adaptive --config.comm.cost_model=runs/links.json

For each level, a psum over that mesh axis alone, at sizes from 4 KiB up, median of --repeats runs:
``local`` (inside a node) and ``node`` (across nodes, every device of a node at once with its partners
of the same local rank, as in the hierarchical all-reduce). Then least squares of seconds against the
bytes that cross the level's link in a ring all-reduce, 2(g-1)/g x M: per device inside a node, times
``local`` across nodes (the node's devices share its link; light_jax/parallel/cost_model.py).

Without --emulate, every device is a simulated device of this process and both levels are memory
copies: the fit is real but describes this machine. With --emulate RATE (root; the mesh lab's
light_jax/emulated_cluster.py), --nodes processes run this script in network namespaces joined by links
shaped to RATE ("unshaped" for none), one per node with --local devices, over jax.distributed (gloo):
the inter level then crosses the shaped links, and its sizes stop where one measurement would take
more than --max_seconds at RATE. To calibrate a real cluster, run one process per node with
--coordinator, --num_processes and --process_id.

It also measures the device's exact top-k selection rate, which ``comm.strategy=auto`` charges each strategy's
selections at (gtopk makes log2(P) + 1 per step): the reducer's selector (``compression.SELECTORS["exact"]``,
jit-compiled) on one device of the first process, on float32 vectors of 2^20, 2^22 and 2^24 elements (up to
--max_mib) at k = 0.1% and 1%, median of --repeats runs after a warm-up. The rate written is the slowest of
these, in elements of input per second: the planner charges a selection its elements / rate, with no fixed
part, so the slowest rate over the measured sizes charges none of them too little (smaller buckets, where a fixed
cost per selection weighs more, may be charged too little). On a CPU mesh the device is one
of the simulated devices, alone (in a train step all of them select at once on the same cores).

The file holds {"intra": {"alpha", "beta"}, "inter": {...}, "topk_elements_per_sec": RATE}; the last line
printed is the same object with "out": PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from light_jax import cli, coordinator, xla_flags  # noqa: E402
from light_jax.emulated_cluster import (  # noqa: E402
  ClusterError,
  EmulatedCluster,
  check_privileges,
  free_port,
  parse_rate,
  report_failure,
)
from light_jax.exit_codes import exit_now, signals_exit_at_once  # noqa: E402


def level_sizes(group_bytes_per_buffer_byte: float, max_bytes: int, link_bytes_budget: float | None) -> list[int]:
  """Buffer sizes 4 KiB, 8 KiB, ... up to ``max_bytes``, and while the bytes crossing the link (buffer size
  x ``group_bytes_per_buffer_byte``) stay within ``link_bytes_budget`` (None: no budget); at least the first two,
  since a line needs two sizes (one gave polyfit an arbitrary split of the time between alpha and beta)."""
  sizes, size = [], 4 * 2**10
  while size <= max_bytes and (link_bytes_budget is None or size * group_bytes_per_buffer_byte <= link_bytes_budget):
    sizes.append(size)
    size *= 2
  return sizes if len(sizes) >= 2 else [4 * 2**10, 8 * 2**10]


def median_seconds(run, repeats: int) -> float:
  """The median of ``repeats`` timed calls of ``run`` (a jitted call: timed to its result on the device), after one
  untimed call that compiles and warms up."""
  import jax

  jax.block_until_ready(run())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


TOPK_SIZES = (2**20, 2**22, 2**24)  # elements of a selection: buckets of 4 MiB to 64 MiB of float32
TOPK_DENSITIES = (0.001, 0.01)


def topk_sizes(max_bytes: int) -> list[int]:
  """The TOPK_SIZES whose float32 vector fits in ``max_bytes``; where none does, the largest power of two that
  does (at least 1,024 elements)."""
  return [n for n in TOPK_SIZES if 4 * n <= max_bytes] or [max(2 ** int(math.log2(max(max_bytes // 4, 1))), 1024)]


def measure_topk_rate(
  repeats: int, sizes: Sequence[int], densities: Sequence[float] = TOPK_DENSITIES
) -> tuple[float, list[tuple[int, float, int, float]]]:
  """The exact top-k selection rate of this process's first device (elements of input per second): the slowest
  of ``sizes`` x ``densities``, each the median of ``repeats`` timed runs after a warm-up. Returns (the rate, rows
  of (elements, density, k, seconds))."""
  import jax
  import numpy as np

  from light_jax.parallel import compression

  device = jax.local_devices()[0]
  # The reducer's call with comm.topk_selector="exact" (the default), on one flat vector as in a bucket.
  select = jax.jit(compression.SELECTORS["exact"], static_argnums=1)
  rows = []
  for size in sizes:
    x = jax.device_put(np.random.default_rng(0).standard_normal(size, dtype=np.float32), device)
    for density in densities:
      k = compression.num_selected(size, density)
      rows.append((size, density, k, median_seconds(lambda: select(x, k), repeats)))
  return min(size / seconds for size, _, _, seconds in rows), rows


def measure(nodes: int, local: int, repeats: int, max_mib: int, rate_bits: int | None, max_seconds: float):
  """Times psums over each mesh axis on all devices (of all processes); returns (ClusterCost, rows)."""
  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from light_jax.parallel import cost_model, strategies
  from light_jax.parallel import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(nodes, local)
  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)
  sharding = NamedSharding(mesh, per_device)
  budget = rate_bits / 8 * max_seconds if rate_bits else None
  # level: (mesh axis, group size, devices sharing the level's link, whether the shaped link carries it)
  levels = {"intra": (mesh_lib.LOCAL, local, 1, False), "inter": (mesh_lib.NODE, nodes, local, True)}
  fits, rows = {}, []
  for level, (axis, group, sharing, shaped) in levels.items():
    if group == 1:  # no such link on this mesh: no cost (beta 0, so readers must not divide by it)
      fits[level] = cost_model.LinkCost(alpha=0.0, beta=0.0)
      continue
    link_bytes_per_buffer_byte = sharing * 2 * (group - 1) / group
    sizes = level_sizes(link_bytes_per_buffer_byte, max_mib * 2**20, budget if shaped else None)
    psum = jax.jit(
      jax.shard_map(lambda v: lax.psum(v, axis), mesh=mesh, in_specs=per_device, out_specs=per_device, check_vma=False)
    )
    sent, seconds = [], []
    for size in sizes:
      shape = (nodes, local, size // 4)
      x = jax.make_array_from_callback(
        shape, sharding, lambda index: np.ones([len(range(*s.indices(d))) for s, d in zip(index, shape)], np.float32)
      )
      sent.append(sharing * strategies.ring_allreduce_bytes(size, group))
      seconds.append(median_seconds(lambda: psum(x), repeats))
      rows.append((level, size, sent[-1], seconds[-1]))
    fits[level] = cost_model.fit_link(sent, seconds)
  return cost_model.ClusterCost(intra=fits["intra"], inter=fits["inter"]), rows


def report(cost, rows, topk_rows, header: str) -> None:
  print(f"\n{header}")
  print(f"{'level':<7}{'buffer (B)':>14}{'link (B)':>14}{'seconds':>11}{'fit (s)':>11}")
  for level, size, sent, seconds in rows:
    print(f"{level:<7}{size:>14,}{sent:>14,}{seconds:>11.6f}{getattr(cost, level).seconds(sent):>11.6f}")
  for level in ("intra", "inter"):
    link = getattr(cost, level)
    bandwidth = f"{8 / link.beta / 1e6:,.1f} Mbit/s" if link.beta else "-"
    print(f"{level}: alpha {1e6 * link.alpha:,.1f} us, 1/beta {bandwidth}")
  print(f"\n{'top-k':<7}{'elements':>14}{'density':>9}{'k':>10}{'seconds':>11}{'elements/s':>12}")
  for size, density, k, seconds in topk_rows:
    print(f"{'exact':<7}{size:>14,}{density:>9g}{k:>10,}{seconds:>11.6f}{size / seconds:>12.3g}")
  print(f"top-k: {cost.topk_elements_per_sec:.3g} elements/s (the slowest row)")


def calibrate_on_cluster(
  cluster: EmulatedCluster,
  local: int,
  out: str,
  repeats: int = 3,
  max_seconds: float = 1.0,
  max_mib: int = 16,
  timeout: float = 600,
) -> tuple[dict, str]:
  """Runs this script on every node of ``cluster`` (``local`` devices each) at its current shaping; returns
  (the fitted cost as a dict, node 0's output)."""
  argv = [sys.executable, os.path.abspath(__file__), f"--nodes={cluster.nodes}", f"--local={local}",
          f"--repeats={repeats}", f"--max_seconds={max_seconds}", f"--max_mib={max_mib}", f"--out={out}",
          f"--coordinator={cluster.coordinator}:{free_port()}", f"--num_processes={cluster.nodes}",
          f"--rate_bits={cluster.bandwidth_bits or 0}"]  # fmt: skip
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(local))
  outputs = cluster.run_everywhere(argv, timeout, cwd=ROOT, env=env)
  with open(out) as f:
    return json.load(f), outputs[0]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nodes", type=cli.int_at_least(1), default=2)
  parser.add_argument("--local", type=cli.int_at_least(1), default=4)
  parser.add_argument("--repeats", type=cli.int_at_least(1), default=5)
  parser.add_argument("--max_mib", type=cli.int_at_least(1), default=64,
                      help="largest buffer per device (psums, top-k vectors)")  # fmt: skip
  parser.add_argument("--max_seconds", type=float, default=1.0, help="longest inter-node measurement at the rate")
  parser.add_argument("--emulate", metavar="RATE", help="calibrate on an emulated cluster with links shaped to RATE")
  parser.add_argument("--coordinator", help="HOST:PORT of process 0 (one process per node)")
  parser.add_argument("--num_processes", type=cli.int_at_least(1), default=1)
  parser.add_argument("--process_id", type=cli.int_at_least(0), default=0)
  parser.add_argument("--rate_bits", type=cli.int_at_least(0), default=0,
                      help="the inter-node rate, bits/s, to size the tests (0: not sized)")  # fmt: skip
  parser.add_argument("--out", default="runs/links.json")
  args = parser.parse_args()
  try:  # 0 or nan measured from 2 sizes instead of 9, without a word
    cli.check_seconds(args, "max_seconds")
    if args.coordinator:
      coordinator.parse(args.coordinator)
  except (ValueError, coordinator.CoordinatorError) as e:
    cli.fail(str(e))
  if args.process_id >= args.num_processes:
    cli.fail(f"--process_id={args.process_id}: the processes are numbered 0 to --num_processes - 1 "
             f"({args.num_processes - 1})")  # fmt: skip
  args.out = os.path.abspath(cli.output_path(args.out, "--out"))

  if args.emulate:
    try:
      rate = parse_rate(args.emulate)
    except ValueError as e:
      cli.fail(f"--emulate={args.emulate}: {e}")
    try:  # no root or iproute2: bad input (exit 2), not an error
      check_privileges()
    except ClusterError as e:
      cli.fail(str(e))
    try:
      with EmulatedCluster(args.nodes, rate) as cluster:
        cost, output = calibrate_on_cluster(cluster, args.local, args.out, args.repeats, args.max_seconds, args.max_mib)
    except (ClusterError, ValueError) as e:
      sys.exit(f"error: {e}")
    except RuntimeError as e:  # a node's calibration failed: its output, then one line
      report_failure(f"the calibration at {args.emulate}", e)
      sys.exit(1)
    print(output.rstrip())
    return

  # Measuring, a signal ends the process at once (a KeyboardInterrupt inside JAX: a traceback); the exit handlers
  # (the --out folder made) run in a process of its own only: jax.distributed's wait for every process.
  with signals_exit_at_once("measuring the links", exit_handlers=not args.coordinator):
    calibrate(args)


def calibrate(args):
  """Measures the links and the top-k rate on this process's devices (of a cluster: ``args.coordinator``), and writes
  the fitted cost model to ``args.out`` (process 0)."""
  import jax

  from light_jax.parallel import mesh as mesh_lib

  if args.coordinator:
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
  elif jax.config.jax_num_cpu_devices in (None, -1, 1):
    jax.config.update("jax_num_cpu_devices", args.nodes * args.local)
  try:  # measure() builds it again; here a mesh that does not fit the devices is one line, before any work
    mesh_lib.make_mesh(args.nodes, args.local, names=("--nodes", "--local"))
  except mesh_lib.MeshError as e:
    cli.fail(str(e))
  cost, rows = measure(args.nodes, args.local, args.repeats, args.max_mib, args.rate_bits or None, args.max_seconds)
  if jax.process_index() == 0:  # the rate it writes; the other processes stay out of its way (on one host too)
    rate, topk_rows = measure_topk_rate(args.repeats, topk_sizes(args.max_mib * 2**20))
    cost = dataclasses.replace(cost, topk_elements_per_sec=rate)
    with open(args.out, "w") as f:
      f.write(cost.to_json())
    where = f"{jax.process_count()} processes" if jax.process_count() > 1 else "one process"
    devices = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    report(cost, rows, topk_rows, f"mesh {args.nodes} x {args.local} ({devices}, {where}), median of {args.repeats}")
    print(f"wrote {args.out}")
    if args.nodes == args.local == 1:  # benchmarks/gpu_check.sh on a one-GPU machine: for the top-k rate
      print("one device: no link measured (the links' alpha and beta are 0 in the file); only the top-k rate is")
    print(json.dumps({**json.loads(cost.to_json()), "out": args.out}))


if __name__ == "__main__":
  xla_flags.apply()  # before JAX starts: the flags train.py runs with (light_jax/xla_flags.py)
  try:
    main()
  except KeyboardInterrupt:  # on an emulated cluster, passed on once its namespaces are gone
    exit_now("stopped by SIGINT: nothing written", 130, exit_handlers=True)
