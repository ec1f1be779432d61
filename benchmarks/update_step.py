"""The optimizer update of ResNet-50 with LARS: norms tensor by tensor against fused, and the update's
share of a step.

  python benchmarks/update_step.py [--model resnet50 --batch_per_device 8 --rounds 5]

Every device applies the whole update to replicated parameters (the replicated update), so one device's
time is the figure. Variants, all jitted with the state donated, timed interleaved (A B C A B C ...) so
machine noise hits them alike, median over --rounds:
- `sgd`: momentum SGD with weight decay (no norms), the floor;
- `optax_lars`: `optax.lars` itself;
- `lars` / `lars_fused`: ours, the same steps (eta ||w|| / ||g + wd w||), norms per tensor / from packed
  buffers (`optimizer.fused_norms`, light_jax/optim.py `tensor_norms`);
- `lars_mlperf` / `lars_mlperf_fused`: the MLPerf trust ratio, the same two ways.
`grad` is the forward and backward pass of --batch_per_device images at --image pixels on the same device;
a row's `share` is its update / (grad + update), the part of a step the update takes.

Then the sharded update (`optimizer.sharded_update`) against the replicated one across --local devices of
one machine (a 1 x local mesh; on the CPU, --local simulated devices sharing the cores), both starting from
the shards of the summed gradient that the hierarchical reduce-scatter leaves (the same in both, so not
timed): `replicated_lars` gathers the gradient shards and every device updates all parameters;
`sharded_lars` updates each device's shard (norms from per-piece sums and a psum), gathers the updates and
adds them to the parameters (light_jax/parallel/sharded_update.py). `grad_local` is the forward and backward pass on all
--local devices at once, the step these rows are a share of. The last line is one JSON object keyed by row.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from light_jax import cli, xla_flags  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--image", type=cli.int_at_least(1), default=224)
  parser.add_argument("--batch_per_device", type=cli.int_at_least(1), default=8)
  parser.add_argument("--rounds", type=cli.int_at_least(1), default=5)
  parser.add_argument("--local", type=int, default=2, help="devices of the sharded-vs-replicated rows")
  args = parser.parse_args()
  if args.local < 1:
    cli.fail(f"--local={args.local}: must be >= 1")
  cli.check_device_count(args.local, f"--local={args.local}")
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.local))  # simulated CPU devices; no effect on GPUs
  cli.check_model(args.model)  # after: it imports JAX, which reads JAX_NUM_CPU_DEVICES once, at import

  import jax
  import jax.numpy as jnp
  import optax

  from configs import imagenet_resnet50
  from light_jax import optim
  from light_jax.models import create_model

  if args.local > len(jax.devices()) > 1:  # a 1 x local mesh of more devices than there are (one skips its rows)
    cli.fail(f"--local={args.local}: there are {len(jax.devices())} devices here; give at most that many")

  model = create_model(args.model, 1000)
  images = jnp.zeros((args.batch_per_device, args.image, args.image, 3))
  variables = jax.jit(lambda: model.init(jax.random.key(0), images[:1], train=False))()
  params, stats = variables["params"], variables["batch_stats"]
  labels = jnp.zeros((args.batch_per_device,), jnp.int32)
  schedule = optax.constant_schedule(1.0)

  def optimizer(name):
    opt = imagenet_resnet50.get_config().optimizer
    if name == "optax_lars":  # optax's own, the reference our LARS is tested equal to
      return optax.lars(schedule, weight_decay=opt.weight_decay, weight_decay_mask=optim.decay_mask,
                        trust_coefficient=opt.lars_eta, trust_ratio_mask=optim.decay_mask, momentum=opt.momentum,
                        nesterov=opt.nesterov)  # fmt: skip
    opt.name = "sgd" if name == "sgd" else "lars"
    opt.lars_trust = "mlperf" if "mlperf" in name else "optax"
    opt.fused_norms = name.endswith("_fused")
    return optim.build_optimizer(opt, schedule)

  def make_update(tx):
    def update(params, opt_state, grads):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(update, donate_argnums=(0, 1))

  def loss(p, x, y):
    logits, _ = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
    return optim.cross_entropy(logits, y, 1000, 0.1)

  grad = jax.jit(jax.grad(loss))
  grads = grad(params, images, labels)
  names = ["sgd", "optax_lars", "lars", "lars_fused", "lars_mlperf", "lars_mlperf_fused"]
  runs = {}
  for name in names:
    tx = optimizer(name)
    p = jax.tree.map(jnp.copy, params)
    runs[name] = [make_update(tx), p, tx.init(p)]
  times = {name: [] for name in ["grad", *names]}
  for r in range(args.rounds + 1):  # round 0 compiles and warms up
    start = time.perf_counter()
    jax.block_until_ready(grad(params, images, labels))
    if r:
      times["grad"].append(time.perf_counter() - start)
    for name in names:
      update, p, s = runs[name]
      start = time.perf_counter()
      p, s = update(p, s, grads)
      jax.block_until_ready(p)
      runs[name][1:] = [p, s]
      if r:
        times[name].append(time.perf_counter() - start)
    if any(times.values()):  # round 0 only compiles: nothing timed to print
      print(f"  round {r}: " + ", ".join(f"{n} {t[-1]:.4f} s" for n, t in times.items() if t), file=sys.stderr)

  num = sum(x.size for x in jax.tree.leaves(params))
  print(f"\n{args.model} ({num:,} parameters, {len(jax.tree.leaves(params))} tensors) on one "
        f"{jax.devices()[0].platform} device, median of {args.rounds}; grad: {args.batch_per_device} images of "
        f"{args.image}px")  # fmt: skip
  result = table(times, "grad", "lars")
  del runs
  if len(jax.devices()) >= 2 and args.local >= 2:
    local = sharded_vs_replicated(args, loss, params, images, labels, optimizer("lars"), schedule)
    print(f"\nacross {args.local} {jax.devices()[0].platform} devices (1 x {args.local} mesh), median of {args.rounds}")
    result |= table(local, "grad_local", "replicated_lars")
  else:
    print(f"\nsharded vs replicated: skipped, {len(jax.devices())} device(s) (needs --local >= 2 devices)")
  print(json.dumps(result))


def table(times: dict[str, list[float]], grad: str, reference: str) -> dict[str, dict]:
  """Prints the rows, each the median of its rounds: seconds, the rounds' spread, against ``reference``, share of
  a step (row / (``grad`` + row))."""
  median = {name: statistics.median(t) for name, t in times.items()}
  print(f"{'row':<20}{'seconds':>10}{'min-max':>18}{'vs ' + reference:>22}{'share of step':>15}")
  result = {}
  for name, seconds in median.items():
    share = seconds / (median[grad] + seconds) if name != grad else None
    ratio = f"{seconds / median[reference]:.2f}x" if name != grad else "-"
    spread = f"{min(times[name]):.4f}-{max(times[name]):.4f}"
    print(f"{name:<20}{seconds:>10.4f}{spread:>18}{ratio:>22}{'' if share is None else f'{100 * share:.1f}%':>15}")
    result[name] = {
      "seconds": seconds,
      "seconds_min": min(times[name]),
      "seconds_max": max(times[name]),
      "share_of_step": share,
    }
  return result


def sharded_vs_replicated(args, loss, params, images, labels, tx, schedule) -> dict[str, list[float]]:
  """The timed rounds' seconds of grad_local, replicated_lars and sharded_lars on a 1 x --local mesh (see the
  docstring)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from configs import imagenet_resnet50
  from light_jax.parallel import collectives
  from light_jax.parallel import fusion as fusion_lib
  from light_jax.parallel.mesh import LOCAL, NODE, make_mesh
  from light_jax.parallel.reducer import reducer_from_config
  from light_jax.parallel.sharded_update import sharded_update

  config = imagenet_resnet50.get_config()
  config.optimizer.name = "lars"
  mesh = make_mesh(1, args.local, jax.devices()[: args.local])
  base = reducer_from_config(config.comm, 1, args.local)
  sharded = sharded_update(base, params, config.optimizer, schedule, config.optimizer.momentum)
  per_device = NamedSharding(mesh, P(NODE, LOCAL))
  # On the mesh from the start: an input placed differently from the last call's would recompile the step.
  params = jax.device_put(params, NamedSharding(mesh, P()))
  keys = [f"bucket_{b:03d}" for b in range(len(sharded.buckets))]

  def shard_map(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

  # Every device's own images: the forward and backward pass of the whole 1 x local step.
  batch = jnp.concatenate([images] * args.local), jnp.concatenate([labels] * args.local)
  grad_local = shard_map(
    lambda p, x, y: jax.tree.map(lambda g: g[None], jax.grad(loss)(p, x, y)), (P(), P(LOCAL), P(LOCAL)), P(LOCAL)
  )
  grads = jax.tree.map(lambda g: g[0], grad_local(params, *batch))
  comm_state = jax.device_put(sharded.init_state(params), per_device)
  shards, comm_state = shard_map(sharded.reduce, (P(), P(NODE, LOCAL)), (P(LOCAL), P(NODE, LOCAL)))(grads, comm_state)

  def replicated(params, opt_state, shards):
    leaves, treedef = jax.tree.flatten(params)
    full = list(leaves)
    for key, bucket in zip(keys, sharded.buckets):
      members = [leaves[m] for m in bucket.members]
      for m, g in zip(bucket.members, fusion_lib.unpack(collectives.gather_local_shards(shards[key]), members)):
        full[m] = g
    updates, opt_state = tx.update(jax.tree.unflatten(treedef, full), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def on_shards(params, comm_state, shards):
    new, _, comm_state = sharded.apply(shards, params, optax.EmptyState(), comm_state)
    return new, comm_state

  arms = {
    "replicated_lars": [
      shard_map(replicated, (P(), P(), P(LOCAL)), (P(), P())),
      params,
      jax.device_put(tx.init(params), NamedSharding(mesh, P())),
    ],
    "sharded_lars": [shard_map(on_shards, (P(), P(NODE, LOCAL), P(LOCAL)), (P(), P(NODE, LOCAL))), params, comm_state],
  }
  times = {name: [] for name in ["grad_local", *arms]}
  for r in range(args.rounds + 1):  # round 0 compiles and warms up
    start = time.perf_counter()
    jax.block_until_ready(grad_local(params, *batch))
    if r:
      times["grad_local"].append(time.perf_counter() - start)
    for name, (step, p, s) in arms.items():
      start = time.perf_counter()
      p, s = jax.block_until_ready(step(p, s, shards))
      arms[name][1:] = [p, s]
      if r:
        times[name].append(time.perf_counter() - start)
    if any(times.values()):  # round 0 only compiles: nothing timed to print
      print(f"  round {r}: " + ", ".join(f"{n} {t[-1]:.4f} s" for n, t in times.items() if t), file=sys.stderr)
  # The same optimizer, so the same parameters after the same updates (a check on the comparison itself).
  diff = max(
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-12))
    for a, b in zip(jax.tree.leaves(arms["replicated_lars"][1]), jax.tree.leaves(arms["sharded_lars"][1]))
  )
  state_bytes = {name: sum(x.nbytes for x in jax.tree.leaves(arms[name][2])) for name in arms}
  print(f"  after {args.rounds + 1} updates: largest relative parameter difference {diff:.1e}; optimizer state "
        f"{state_bytes['replicated_lars']:,} B per device replicated, "
        f"{state_bytes['sharded_lars'] // args.local:,} B sharded", file=sys.stderr)  # fmt: skip
  return times


if __name__ == "__main__":
  xla_flags.apply()  # before JAX starts: the flags train.py runs with (light_jax/xla_flags.py)
  with cli.measuring("a smaller --batch_per_device or --image, or a smaller --model"):
    main()
