"""Step time of our shard_map train step (dense, hierarchical) against plain jit data parallelism.

  python benchmarks/train_step.py [--model resnet8_fast --batch 256 --steps 20 --rounds 5]
  python benchmarks/train_step.py --batch 4096 --micro_batches 8 --steps 2 --rounds 3

"dense" and "hierarchical" pack the gradients into 25 MiB buckets (comm.fusion="fixed", the default);
the "_unfused" rows reduce tensor by tensor (comm.fusion="none"). Same model, batch, optimizer and
semantics in all variants: per-device BatchNorm statistics, mean
gradient over the global batch. "plain_jit" is what XLA does by itself: the model is vmapped over
a leading device axis of the batch (sharded over node x local), parameters are replicated, and XLA
inserts the gradient all-reduce. Variants run interleaved (A B C A B C ...) so machine noise hits
all of them alike; the table gives the median step time and the ratio to plain jit.
With --micro_batches M, two more rows run hierarchical with gradient accumulation (each device's share
in M slices, one reduction per step): the slices as XLA's loop ("rolled", what accelerators run) and
unrolled (what the CPU runs). Their BatchNorm normalises per slice, so their parameters differ from
plain jit's after a step (not checked).
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
  parser.add_argument("--model", default="resnet8_fast")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--image", type=cli.int_at_least(1), default=28)
  parser.add_argument("--channels", type=cli.int_at_least(1), default=1)
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--steps", type=cli.int_at_least(1), default=20, help="steps per timed round")
  parser.add_argument("--rounds", type=cli.int_at_least(1), default=5)
  parser.add_argument("--micro_batches", type=int, default=1, help="> 1: add gradient-accumulation rows")
  args = parser.parse_args()
  cli.check_model(args.model)
  if args.nodes < 1 or args.local < 1:
    cli.fail(f"--nodes={args.nodes} --local={args.local}: each must be >= 1")
  devices = args.nodes * args.local
  cli.check_device_count(devices, f"--nodes={args.nodes} --local={args.local}")
  if args.batch < devices or args.batch % devices:
    lower = max(args.batch // devices, 1) * devices
    cli.fail(f"--batch={args.batch} does not divide over the {devices} devices of --nodes x --local; use a multiple "
             f"of {devices} (e.g. {lower} or {lower + devices})")  # fmt: skip
  if args.micro_batches < 1 or (args.batch // devices) % args.micro_batches:
    cli.fail(f"--micro_batches={args.micro_batches} must be >= 1 and divide the {args.batch // devices} examples "
             "per device (--batch / (--nodes x --local))")  # fmt: skip

  import jax

  jax.config.update("jax_num_cpu_devices", args.nodes * args.local)
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from light_jax import optim
  from light_jax import train_step as step_lib
  from light_jax.data import DatasetInfo
  from light_jax.models import create_model
  from light_jax.parallel import mesh as mesh_lib
  from light_jax.parallel import reducer as reducer_lib

  try:
    mesh = mesh_lib.make_mesh(args.nodes, args.local, names=("--nodes", "--local"))
  except mesh_lib.MeshError as e:  # on GPUs: one process, nodes x local is not the device count
    cli.fail(str(e))
  devices = mesh.size
  info = DatasetInfo(num_classes=10, image_shape=(args.image, args.image, args.channels), mean=(127.5,), std=(64.0,))
  model = create_model(args.model, info.num_classes)
  tx = optax.sgd(0.01, momentum=0.9, nesterov=True)
  sharding = mesh_lib.batch_sharding(mesh)
  rng = np.random.default_rng(0)
  images = jax.device_put(rng.integers(0, 256, (args.batch, *info.image_shape), dtype=np.uint8), sharding)
  labels = jax.device_put(rng.integers(0, 10, args.batch).astype(np.int32), sharding)

  count = 5 + 2 * (args.micro_batches > 1)
  print(f"compiling {count} variants (state and step each), then {args.rounds} rounds x {args.steps} steps of each",
        file=sys.stderr, flush=True)  # fmt: skip
  variants = {}
  ours = {
    "dense": ("dense", "fixed"),
    "hierarchical": ("hierarchical", "fixed"),
    "dense_unfused": ("dense", "none"),
    "hierarchical_unfused": ("hierarchical", "none"),
  }
  for name, (strategy, fusion) in ours.items():
    reducer = reducer_lib.make_gradient_reducer(strategy, args.nodes, args.local, fusion)
    state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
    step = step_lib.make_train_step(model, tx, reducer, mesh, info, label_smoothing=0.1)
    variants[name] = [step, state, lambda step, state: step(state, images, labels)]
  micro = {}
  if args.micro_batches > 1:
    for rolled in (True, False):
      name = f"hierarchical_micro{args.micro_batches}_{'rolled' if rolled else 'unrolled'}"
      reducer = reducer_lib.make_gradient_reducer("hierarchical", args.nodes, args.local, "fixed")
      state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
      step = step_lib.make_train_step(
        model, tx, reducer, mesh, info, 0.1, micro_batches=args.micro_batches, unroll_micro_batches=not rolled
      )
      micro[name] = [step, state, lambda step, state: step(state, images, labels)]

  # Plain jit: XLA partitions the step and inserts the all-reduce itself.
  reducer = reducer_lib.make_gradient_reducer("dense", args.nodes, args.local)
  state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
  grouped = NamedSharding(mesh, P(mesh_lib.AXES))
  g_images = jax.device_put(images.reshape(devices, -1, *info.image_shape), grouped)
  g_labels = jax.device_put(labels.reshape(devices, -1), grouped)

  def plain_step(state, images, labels):
    # Each device's own BatchNorm running statistics, as in our step (TrainState.batch_stats).
    own_stats = jax.tree.map(lambda s: s.reshape(devices, *s.shape[2:]), state.batch_stats)

    def loss_fn(params):
      def per_device(x, y, stats):
        logits, upd = model.apply(
          {"params": params, "batch_stats": stats},
          step_lib.normalize(x, info.mean, info.std),
          train=True,
          mutable=["batch_stats"],
        )
        return optim.cross_entropy(logits, y, info.num_classes, 0.1), upd["batch_stats"]

      losses, stats = jax.vmap(per_device)(images, labels, own_stats)
      return losses.mean(), stats

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return state.replace(
      step=state.step + 1,
      params=optax.apply_updates(state.params, updates),
      batch_stats=jax.tree.map(lambda s, old: s.reshape(old.shape), batch_stats, state.batch_stats),
      opt_state=opt_state,
    ), loss

  replicated = mesh_lib.replicated(mesh)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  plain = jax.jit(plain_step, donate_argnums=0, out_shardings=(state_shardings, replicated))
  variants["plain_jit"] = [plain, state, lambda step, state: step(state, g_images, g_labels)]
  variants.update(micro)

  # Same maths: after one step, all three hold the same parameters.
  firsts = {}
  for name, v in variants.items():
    v[1], _ = v[2](v[0], v[1])
    firsts[name] = jax.tree.leaves(jax.device_get(v[1].params))
  for name in ours:
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(firsts[name], firsts["plain_jit"]))
    assert diff < 1e-4, f"{name} and plain_jit disagree after one step: {diff}"

  # One more untimed step each: the state now has the step's output shardings, which may differ from the
  # ones it was created with, and jit compiles again for them (plain_jit did, inside its first timed round).
  for v in variants.values():
    v[1], loss = v[2](v[0], v[1])
  jax.block_until_ready(loss)

  times = {name: [] for name in variants}
  for _ in range(args.rounds):
    for name, v in variants.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        v[1], loss = v[2](v[0], v[1])
      jax.block_until_ready(loss)
      times[name].append((time.perf_counter() - start) / args.steps)

  base = statistics.median(times["plain_jit"])
  print(
    f"\n{args.model}, global batch {args.batch}, mesh {args.nodes} x {args.local} "
    f"({devices} {jax.devices()[0].platform} devices), {args.rounds} rounds x {args.steps} steps, interleaved"
  )
  names = ("plain_jit", *ours, *micro)
  width = max(22, *(len(n) + 2 for n in names))  # a long variant name shifted every column after it
  print(f"{'variant':<{width}}{'median step (ms)':>18}{'min (ms)':>10}{'images/s':>10}{'vs plain jit':>14}")
  result = {}
  for name in names:
    med = statistics.median(times[name])
    print(
      f"{name:<{width}}{1e3 * med:>18.1f}{1e3 * min(times[name]):>10.1f}{args.batch / med:>10.0f}{med / base:>13.3f}x"
    )
    result[name] = {
      "step_seconds": med,
      "step_seconds_min": min(times[name]),  # the rounds' spread: this machine's noise
      "step_seconds_max": max(times[name]),
      "ratio_to_plain_jit": med / base,
    }
  print(json.dumps(result))


if __name__ == "__main__":
  xla_flags.apply()  # before JAX starts: the flags train.py runs with (light_jax/xla_flags.py)
  with cli.measuring("a smaller --batch or --image"):
    main()
