"""Fit the alpha-beta cost of each link level of the current mesh from measured all-reduces.

  python benchmarks/calibrate_links.py --out runs/links.json [--nodes 2 --local 4]
  python train.py ... --config.comm.fusion=adaptive --config.comm.cost_model=runs/links.json

For each level, a psum over that mesh axis alone (``local``: inside a node; ``node``: across nodes,
among devices of the same local rank) at sizes from 4 KiB to 64 MiB, median of several runs; then
least squares of seconds against the bytes each device sends in a ring all-reduce, 2(g-1)/g x M. On
simulated CPU devices both levels are memory copies: the fit is real but describes this machine, not a
network. Run it on the cluster (one process per node) to calibrate a real one.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--max_mib", type=int, default=64)
  parser.add_argument("--out", default="runs/links.json")
  args = parser.parse_args()

  import jax

  if jax.config.jax_num_cpu_devices in (None, -1, 1):
    jax.config.update("jax_num_cpu_devices", args.nodes * args.local)
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from light_jax.parallel import cost_model, strategies
  from light_jax.parallel import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(args.nodes, args.local)
  sizes = [4 * 2**10 * 4**i for i in range(20) if 4 * 2**10 * 4**i <= args.max_mib * 2**20]
  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)
  levels = {"intra": (mesh_lib.LOCAL, args.local), "inter": (mesh_lib.NODE, args.nodes)}
  fits, rows = {}, []
  for level, (axis, group) in levels.items():
    sent, seconds = [], []
    if group == 1:
      fits[level] = cost_model.LinkCost(alpha=0.0, beta=0.0)
      continue
    for size in sizes:
      x = jax.device_put(jnp.ones((args.nodes, args.local, size // 4), jnp.float32), NamedSharding(mesh, per_device))
      f = jax.jit(
        jax.shard_map(
          lambda v: lax.psum(v, axis), mesh=mesh, in_specs=per_device, out_specs=per_device, check_vma=False
        )
      )
      jax.block_until_ready(f(x))
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
      sent.append(strategies.ring_allreduce_bytes(size, group))
      seconds.append(statistics.median(times))
      rows.append((level, size, sent[-1], seconds[-1]))
    fits[level] = cost_model.fit_link(sent, seconds)

  cost = cost_model.ClusterCost(intra=fits["intra"], inter=fits["inter"])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(cost.to_json())
  print(
    f"\nmesh {args.nodes} x {args.local} ({mesh.size} {jax.devices()[0].platform} devices), median of {args.repeats}"
  )
  print(f"{'level':<7}{'buffer (B)':>14}{'sent/dev (B)':>14}{'seconds':>11}{'fit (s)':>11}")
  for level, size, s, t in rows:
    print(f"{level:<7}{size:>14,}{s:>14,}{t:>11.6f}{fits[level].seconds(s):>11.6f}")
  for level, link in fits.items():
    bw = f"{1 / link.beta / 1e9:.2f} GB/s" if link.beta else "-"
    print(f"{level}: alpha {1e6 * link.alpha:.1f} us, 1/beta {bw}")
  print(f"wrote {args.out}")
  print(json.dumps({"intra": vars(fits["intra"]), "inter": vars(fits["inter"]), "out": args.out}))


if __name__ == "__main__":
  main()
