"""Time and traffic of every gradient reduction strategy on a ResNet-50-sized gradient set.

  python benchmarks/collectives.py [--nodes 2 --local 4 --repeats 3 --only hierarchical,hitopk@0.01]

The gradients are 25,557,032 float32 in ResNet-50's real layer shapes (161 tensors, in backward
order; --model names another model), a different random
heavy-tailed set on each of the 8 simulated CPU devices (2 x 4 mesh). For each variant: median wall
time of one reduction (compiled, inputs already on the devices) and the exact bytes one device sends
per step inside its node and across nodes (from shapes). On simulated CPU devices every "link" is a
memory copy, so the seconds measure compute and collective overhead (top-k selection, scatter-add,
packing), not network time; the byte columns are what a real slow link would carry. The adaptive
plans are MG-WFBP groups for --cost_model (a preset or a calibrated JSON file) with 32 images per device
at 15 TFLOP/s. --local -1 takes every device here (on GPUs; CPU devices are simulated, nodes x local).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from light_jax import cli, xla_flags  # noqa: E402

VARIANTS = {
  # name: (strategy, fusion, density, selector); powersgd: (strategy, fusion, rank, None)
  "dense": ("dense", "fixed", 1.0, "exact"),
  "hierarchical": ("hierarchical", "fixed", 1.0, "exact"),
  "hierarchical/unfused": ("hierarchical", "none", 1.0, "exact"),
  "topk@0.01": ("topk", "fixed", 0.01, "exact"),
  "topk@0.001": ("topk", "fixed", 0.001, "exact"),
  "gtopk@0.01": ("gtopk", "fixed", 0.01, "exact"),
  "gtopk@0.001": ("gtopk", "fixed", 0.001, "exact"),
  "hitopk@0.01": ("hitopk", "fixed", 0.01, "exact"),
  "hitopk@0.001": ("hitopk", "fixed", 0.001, "exact"),
  "hitopk@0.01/mstopk": ("hitopk", "fixed", 0.01, "mstopk"),
  "hitopk@0.001/mstopk": ("hitopk", "fixed", 0.001, "mstopk"),
  "hitopk@0.001/unfused": ("hitopk", "none", 0.001, "exact"),
  # "/compact": comm.compact_pairs (bfloat16 values; uint16 offsets and per-block counts in these long buckets)
  "hitopk@0.01/compact": ("hitopk", "fixed", 0.01, "exact"),
  "hitopk@0.001/compact": ("hitopk", "fixed", 0.001, "exact"),
  "hierarchical/adaptive": ("hierarchical", "adaptive", 1.0, "exact"),
  "hitopk@0.001/adaptive": ("hitopk", "adaptive", 0.001, "exact"),
  "powersgd@1": ("powersgd", "fixed", 1, None),
  "powersgd@4": ("powersgd", "fixed", 4, None),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--repeats", type=cli.int_at_least(1), default=3)
  parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
  parser.add_argument(
    "--cost_model", default="v100_nvlink_25gbe", help="preset or calibrated JSON file for the adaptive plans"
  )
  parser.add_argument("--device_tflops", type=float, default=15.0)
  parser.add_argument("--examples_per_device", type=cli.int_at_least(1), default=32)
  parser.add_argument("--model", default="resnet50", help="whose gradient shapes (a smaller one for quick checks)")
  args = parser.parse_args()
  cli.check_model(args.model)
  if not 0 < args.device_tflops < float("inf"):  # the adaptive plans divide by it
    cli.fail(f"--device_tflops={args.device_tflops}: must be a number > 0 (the device's TFLOP/s)")
  if args.nodes < 1 or args.local == 0 or args.local < -1:
    cli.fail(f"--nodes={args.nodes} --local={args.local}: each must be >= 1 (--local may be -1: every device here)")
  cli.check_device_count(args.nodes * max(args.local, 1), f"--nodes={args.nodes} --local={args.local}")
  only = args.only.split(",") if args.only else list(VARIANTS)
  unknown = [n for n in only if n not in VARIANTS]
  if unknown:
    cli.fail(f"--only: no variant {', '.join(map(repr, unknown))}; the variants are {', '.join(VARIANTS)}")
  names = [n for n in VARIANTS if n in only]

  import jax

  if args.local > 0:  # -1: the devices there are (the CPU's default, one)
    jax.config.update("jax_num_cpu_devices", args.nodes * args.local)
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from light_jax.models import create_model
  from light_jax.parallel import cost_model
  from light_jax.parallel import fusion as fusion_lib
  from light_jax.parallel import mesh as mesh_lib

  try:
    cost = cost_model.load(args.cost_model)  # before any measurement: the adaptive variants use it
  except ValueError as e:
    cli.fail(f"--cost_model: {e}")
  try:
    mesh = mesh_lib.make_mesh(args.nodes, args.local, names=("--nodes", "--local"))
  except mesh_lib.MeshError as e:  # one process: nodes x local is not the device count
    cli.fail(str(e))
  devices = mesh.size
  nodes, local = mesh.devices.shape  # --local -1 filled
  model = create_model(args.model, 1000)
  profile = fusion_lib.profile_parameters(model, (224, 224, 3))  # real backward order, FLOPs per tensor
  shapes = profile.params
  num_elements = sum(s.size for s in jax.tree.leaves(shapes))
  # Every reducer before any measurement: a variant this mesh cannot run (gtopk on a device count that is no
  # power of two) is refused at once where --only names it, and left out, with its reason, from the full set.
  reducers = {}
  for name in names:
    try:
      reducers[name] = make_reducer(name, nodes, local, profile, cost, args)
    except ValueError as e:
      if args.only:
        cli.fail(f"--only={name}: {e}")
      print(f"  left out {name}: {e}", file=sys.stderr)

  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)
  batch_sharding = mesh_lib.batch_sharding(mesh)

  # Per-device local gradients: leading dim = device (node-major), heavy-tailed like real gradients.
  def make_grads(key):
    keys = jax.random.split(key, len(jax.tree.leaves(shapes)))
    # A log-normal scale mixture of normals: heavy tails, and cheap to draw (unlike Student-t).
    leaves = [
      jax.random.normal(k, (devices, *s.shape))
      * jnp.exp(jax.random.normal(jax.random.fold_in(k, 1), (devices, *s.shape)))
      * 1e-3
      for k, s in zip(keys, jax.tree.leaves(shapes))
    ]
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)

  grads = jax.jit(make_grads, out_shardings=batch_sharding)(jax.random.key(0))

  rows = {}
  for name, reducer in reducers.items():
    state = jax.device_put(reducer.init_state(shapes), NamedSharding(mesh, per_device))
    reduce = jax.jit(
      jax.shard_map(
        lambda g, s: reducer.reduce(jax.tree.map(lambda x: x[0], g), s),
        mesh=mesh,
        in_specs=(mesh_lib.BATCH_SPEC, per_device),
        out_specs=(P(), per_device),
        check_vma=False,
      )
    )
    start = time.perf_counter()
    out, state = reduce(grads, state)
    jax.block_until_ready(out)
    compile_seconds = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      out, state = reduce(grads, state)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - start)
    nbytes = reducer.bytes_per_step(shapes)
    rows[name] = {
      "seconds": statistics.median(times),
      "seconds_range": [min(times), max(times)],  # the noise: the variants run one after another, not interleaved
      "inter_node_bytes": nbytes.inter_node,
      "intra_node_bytes": nbytes.intra_node,
      "compile_seconds": compile_seconds,
    }
    rows[name]["buckets"] = len(reducer.bucket_plan(shapes))  # collectives per step
    print(f"  measured {name}: {rows[name]['seconds']:.3f} s ({min(times):.3f}-{max(times):.3f})", file=sys.stderr)
    del out, state

  base = rows.get("hierarchical")
  print(
    f"\n{args.model} gradients ({num_elements:,} float32), mesh {nodes} x {local} "
    f"({devices} {jax.devices()[0].platform} devices), median of {args.repeats} (each variant's repeats in a row; "
    "their min-max in the JSON line)"
  )
  print(
    f"{'variant':<24}{'buckets':>8}{'seconds':>9}{'inter-node B/dev':>18}{'intra-node B/dev':>18}"
    f"{'hier. / this (inter)':>22}"
  )
  for name, r in rows.items():
    ratio = f"{base['inter_node_bytes'] / r['inter_node_bytes']:.2f}x" if base and r["inter_node_bytes"] else "-"
    print(
      f"{name:<24}{r['buckets']:>8}{r['seconds']:>9.3f}{r['inter_node_bytes']:>18,}{r['intra_node_bytes']:>18,}"
      f"{ratio:>22}"
    )
  print(json.dumps(rows))


def make_reducer(name, nodes, local, profile, cost, args):
  """The reducer of variant ``name`` on a ``nodes`` x ``local`` mesh (ValueError if it cannot run there)."""
  from light_jax.parallel import cost_model
  from light_jax.parallel import reducer as reducer_lib

  strategy, fusion, density, selector = VARIANTS[name]
  if strategy == reducer_lib.POWERSGD:  # P and Q of every tensor in one all-reduce each: no buckets
    return reducer_lib.make_gradient_reducer(strategy, nodes, local, rank=density)
  reducer = reducer_lib.make_gradient_reducer(
    strategy,
    nodes,
    local,
    "fixed" if fusion == "adaptive" else fusion,
    density=density,
    selector=selector,
    order=profile.order,
    compact_pairs=name.endswith("/compact"),
  )
  if fusion == "adaptive":
    reducer = cost_model.plan_adaptive_fusion(
      reducer, profile, cost, args.device_tflops * 1e12, args.examples_per_device
    )
  return reducer


if __name__ == "__main__":
  xla_flags.apply()  # before JAX starts: the flags train.py runs with (light_jax/xla_flags.py)
  with cli.measuring("a smaller --model (its gradient is what the collectives carry)"):
    main()
