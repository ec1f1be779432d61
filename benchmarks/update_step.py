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
a row's `share` is its update / (grad + update), the part of a step the update takes. The sharded update
(`optimizer.sharded_update`) is not a row: it runs across `local` devices, and on simulated CPU devices,
which share the cores, one device's part of it cannot be timed alone. The last line is one JSON object keyed by row.
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
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--image", type=int, default=224)
  parser.add_argument("--batch_per_device", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  import optax

  from configs import imagenet_resnet50
  from light_jax import optim
  from light_jax.models import create_model

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
    print(f"  round {r}: " + ", ".join(f"{n} {t[-1]:.4f} s" for n, t in times.items() if t), file=sys.stderr)

  median = {name: statistics.median(t) for name, t in times.items()}
  num = sum(x.size for x in jax.tree.leaves(params))
  print(f"\n{args.model} ({num:,} parameters, {len(jax.tree.leaves(params))} tensors) on one "
        f"{jax.devices()[0].platform} device, median of {args.rounds}; grad: {args.batch_per_device} images of "
        f"{args.image}px")  # fmt: skip
  print(f"{'row':<20}{'seconds':>10}{'vs lars':>9}{'share of step':>15}")
  result = {}
  for name, seconds in median.items():
    share = seconds / (median["grad"] + seconds) if name != "grad" else None
    ratio = f"{seconds / median['lars']:.2f}x" if name != "grad" else "-"
    print(f"{name:<20}{seconds:>10.4f}{ratio:>9}{'' if share is None else f'{100 * share:.1f}%':>15}")
    result[name] = {"seconds": seconds, "share_of_step": share}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
