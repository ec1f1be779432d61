"""Predict a training run's time on a cluster from its config (light_jax/simulation.py).

  python scripts/simulate.py --config configs/imagenet_resnet50.py:light --cluster v100x128_25gbe \\
      --strategies hierarchical,hitopk@0.01,hitopk@0.001,gtopk@0.01
  python scripts/simulate.py --config configs/imagenet_resnet50.py:light --cluster v100x128_25gbe \\
      --sweep bandwidth --plot docs/simulated_bandwidth.png       (1 to 400 Gbps between machines)
  python scripts/simulate.py ... --sweep devices --plot docs/simulated_devices.png   (8 to 1,024 GPUs)

The cluster: a preset (--cluster), changed by --nodes, --devices_per_node, --inter_gbps, --device and
--cost_model (a JSON file from benchmarks/calibrate_links.py); --input_images_per_sec sets each host's
input rate at 128 px. Strategies: NAME or NAME@DENSITY, "/bfloat16" for the bfloat16 wire, "/compact" for
compact pairs (comm.compact_pairs), as in the mesh lab: "hitopk@0.01,hitopk@0.01/compact" compares the two in
one run; without --strategies the config's own. Config fields: --config.FIELD=VALUE.

Prints, per strategy, each phase's step split (compute, exposed communication, update, and the input wait: the
time the step waits for its input beyond the rest, 0 where the input is hidden) and seconds, then a summary. The
last line is one JSON object: `seconds`, `phases`, `exposed_comm_fraction` (and the rest of the simulation) of
the first strategy, and `strategies` with every strategy's totals;
with --sweep, `sweep` holds the seconds per strategy at each point. The config is checked as train.py checks
it, on the cluster: what the trainer would refuse there is an error; a sweep point it would refuse (a batch
that does not divide over that many devices) is left out, with the reason on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from light_jax import cli  # noqa: E402
from light_jax import config as config_lib  # noqa: E402
from light_jax.parallel import cost_model  # noqa: E402

_CONFIG = cli.define_config_file("config", "training config file[:variant]")
_CLUSTER = flags.DEFINE_string("cluster", "v100x128_25gbe", "a preset of light_jax/simulation.py CLUSTERS")
_STRATEGIES = flags.DEFINE_list("strategies", [], "strategies to compare (default: the config's)")
_NODES = flags.DEFINE_integer("nodes", None, "machines (default: the preset's)", lower_bound=1)
_DEVICES_PER_NODE = flags.DEFINE_integer(
  "devices_per_node", None, "devices per machine (default: the preset's)", lower_bound=1
)
_INTER_GBPS = flags.DEFINE_float("inter_gbps", None, "Ethernet rate between machines, Gbit/s (> 0)")
_DEVICE = flags.DEFINE_string("device", None, "a DEVICES profile (default: the preset's)")
_COST_MODEL = flags.DEFINE_string("cost_model", None, "a cost_model preset or calibrate_links.py JSON")
_INPUT_RATE = flags.DEFINE_float("input_images_per_sec", None, "input images/s per host at 128 px (> 0)")
_NO_OVERLAP = flags.DEFINE_bool("no_overlap", False, "communication after the backward pass, not during it")
_SWEEP = flags.DEFINE_enum("sweep", None, ["bandwidth", "devices"], "time to train against a cluster property")
_PLOT = flags.DEFINE_string("plot", None, "PNG of the sweep")

for _rate in ("inter_gbps", "input_images_per_sec"):
  flags.register_validator(_rate, lambda value: value is None or value > 0, message=f"--{_rate} must be > 0")

BANDWIDTHS_GBPS = (1, 2, 5, 10, 25, 50, 100, 200, 400)
DEVICE_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)


def with_strategy(config, text: str):
  """A copy of ``config`` with "NAME[@VALUE][/OPTION...]" as its comm strategy (config.strategy_fields)."""
  from light_jax import config as config_lib

  config = config.copy_and_resolve_references()
  config.comm.update(config_lib.strategy_fields(text))
  return config


def make_cluster():
  from light_jax import simulation
  from light_jax.parallel import cost_model

  try:
    cluster = simulation.CLUSTERS[_CLUSTER.value]
  except KeyError:
    cli.fail(f"--cluster={_CLUSTER.value!r}: known presets {sorted(simulation.CLUSTERS)}")
  changes = {}
  if _DEVICES_PER_NODE.value:
    changes["devices_per_node"] = _DEVICES_PER_NODE.value
  if _DEVICE.value:
    if _DEVICE.value not in simulation.DEVICES:
      cli.fail(f"--device={_DEVICE.value!r}: known profiles {sorted(simulation.DEVICES)}")
    changes["device"] = simulation.DEVICES[_DEVICE.value]
  if _COST_MODEL.value:
    try:
      changes["cost"] = cost_model.load(_COST_MODEL.value)
    except ValueError as e:
      cli.fail(f"--cost_model={_COST_MODEL.value}: {e}")
  if _INPUT_RATE.value:
    changes["input_images_per_sec"] = _INPUT_RATE.value
  cluster = dataclasses.replace(cluster, **changes)
  return simulation.with_link(cluster, _NODES.value, _INTER_GBPS.value)


def gbps(link, digits: int) -> str:
  """A link's 1/beta in Gbit/s; calibrate_links.py writes beta 0 (no cost per byte) for a level the calibrated
  mesh lacks (one node, or one device per node)."""
  return f"{8e-9 / link.beta:.{digits}f} Gbit/s" if link.beta else "unlimited (beta 0)"


def print_run(label: str, result: dict) -> None:
  exposed, efficiency = 100 * result["exposed_comm_fraction"], 100 * result["scaling_efficiency"]
  print(f"\n{label}: {result['seconds']:.1f} s ({result['train_seconds']:.1f} s training, "
        f"{result['eval_seconds']:.1f} s evaluation); exposed communication {exposed:.1f}% of training; "
        f"scaling efficiency {efficiency:.1f}%")  # fmt: skip
  # A density column only where the density warm-up or the final density split the run.
  densities = len({p["density"] for p in result["phases"]}) > 1
  print(f"  {'epochs':<9}{'px':>5}{'batch':>8}{'steps':>7}" + (f"{'density':>9}" if densities else "") +
        f"{'buckets':>8}{'compute ms':>12}{'exposed ms':>12}{'update ms':>11}{'input wait ms':>15}{'step ms':>9}"
        f"{'seconds':>9}")  # fmt: skip
  for p in result["phases"]:
    s = p["step"]
    epochs = f"{p['first_epoch']}-{p['last_epoch']}"
    print(f"  {epochs:<9}{p['image_size']:>5}{p['global_batch']:>8,}{p['steps']:>7}" +
          (f"{p['density']:>9.3g}" if densities else "") +
          f"{p['buckets']:>8}{1e3 * s['compute']:>12.1f}{1e3 * s['exposed_comm']:>12.1f}{1e3 * s['update']:>11.2f}"
          f"{1e3 * s['input_wait']:>15.1f}{1e3 * s['total']:>9.1f}{p['train_seconds']:>9.1f}")  # fmt: skip


def plot_sweep(sweep: dict, xlabel: str, title: str, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  for label, points in sweep.items():
    xs = sorted(points, key=float)
    ax.plot([float(x) for x in xs], [points[x] for x in xs], marker="o", ms=3, label=label)
  ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="simulated time to train (s)", title=title)
  for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  fig.tight_layout()
  try:
    fig.savefig(path, dpi=120)
  except OSError as e:  # checked before the work (cli.plot_path), but the disk may have filled up since
    cli.fail(f"--plot={path}: cannot write it ({e.strerror})")
  print(f"wrote {path}", file=sys.stderr)


def main(argv):
  del argv
  from light_jax import simulation

  if _CONFIG.value is None:
    cli.fail("--config is required, e.g. --config configs/imagenet_resnet50.py:light")
  try:  # a mesh experiment, a search space: not a training config (a traceback deep inside before)
    config_lib.check_fields(_CONFIG.value)
  except config_lib.ConfigError as e:
    cli.fail(f"--config: {e}")
  if _PLOT.value:
    if not _SWEEP.value:
      cli.fail("--plot draws a sweep: add --sweep bandwidth or --sweep devices")
    plot = cli.plot_path(_PLOT.value, "--plot")
  cluster = make_cluster()
  labels = _STRATEGIES.value or [_CONFIG.value.comm.strategy]
  try:
    configs = {label: with_strategy(_CONFIG.value, label) for label in labels}
    for config in configs.values():  # what the trainer would refuse on this cluster: before any output
      simulation.check(config, cluster)
  except config_lib.ConfigError as e:  # checked on the cluster's mesh: say which flags set it
    cli.fail(
      f"{e} (Checked on the cluster's mesh: --nodes={cluster.nodes} machines x --devices_per_node="
      f"{cluster.devices_per_node} devices, the preset's unless given.)"
    )
  except ValueError as e:
    cli.fail(str(e))
  overlap = not _NO_OVERLAP.value
  print(f"cluster {_CLUSTER.value}: {cluster.nodes} x {cluster.devices_per_node} {cluster.device.name}, inter-node "
        f"{gbps(cluster.cost.inter, 1)} goodput (alpha {1e6 * cluster.cost.inter.alpha:.0f} us), intra "
        f"{gbps(cluster.cost.intra, 0)}; input {cluster.input_images_per_sec:,.0f} images/s per host at "
        f"{cluster.input_image_size} px; communication {'during' if overlap else 'after'} the backward")  # fmt: skip
  device = cluster.device
  print(f"device {device.name}: {device.images_per_sec:,.0f} training images/s of {device.model} at "
        f"{device.image_size} px ({device.source})")  # fmt: skip
  model = _CONFIG.value.model
  _, _, num_classes, channels = simulation.DATASETS[_CONFIG.value.data.dataset]
  ratio = simulation.model_cost_ratio(model, num_classes, channels, device)
  if ratio != 1:
    print(f"model {model.name}: {ratio:.3g} x {device.model}'s backward FLOPs per image at {device.image_size} px, "
          f"so {ratio:.3g} x its compute time")  # fmt: skip
  planned = [label for label in labels if cost_model.needs_cost(configs[label].comm)]
  if planned:  # the trainer's plan (adaptive fusion, auto), from the trainer's inputs: say them
    tflops, suits = _CONFIG.value.comm.device_tflops, simulation.device_tflops(device)
    rate = cluster.cost.topk_elements_per_sec
    print(f"planned as the trainer plans ({', '.join(planned)}): comm.device_tflops={tflops:g}, "
          + (f"top-k at {rate:.3g} elements/s" if cluster.cost.has_topk_rate else "link time alone (the cost "
             "model has no top-k rate)"))  # fmt: skip
    if not 0.8 <= tflops / suits <= 1.25:
      print(f"note: {device.name}'s profile runs at {suits:.0f} TFLOP/s in comm.device_tflops's sense: "
            f"--config.comm.device_tflops={suits:.0f} plans for it")  # fmt: skip
  results = {}
  for label in labels:
    try:
      results[label] = simulation.simulate(configs[label], cluster, overlap)
    except ValueError as e:
      cli.fail(str(e))
    print_run(label, results[label])

  width = max(24, *(len(label) + 2 for label in labels))
  print(f"\n{'strategy':<{width}}{'seconds':>10}{'exposed comm':>14}{'efficiency':>12}")
  for label, r in results.items():
    print(f"{label:<{width}}{r['seconds']:>10.1f}{100 * r['exposed_comm_fraction']:>13.1f}%"
          f"{100 * r['scaling_efficiency']:>11.1f}%")  # fmt: skip
  output = {**results[labels[0]], "strategies": {label: {k: v for k, v in r.items() if k != "phases"}
                                                 for label, r in results.items()}}  # fmt: skip

  if _SWEEP.value:
    sweep = {}
    bandwidth = _SWEEP.value == "bandwidth"
    xlabel, unit = ("inter-node bandwidth (Gbit/s)", "Gbit/s") if bandwidth else ("devices", "devices")
    for label in labels:
      config = configs[label]
      if bandwidth:
        points = {g: simulation.with_link(cluster, inter_gbps=g) for g in BANDWIDTHS_GBPS}
      else:
        # Whole machines: with 3 devices per node, 8 requested is 2 machines, so the point is 6 devices.
        nodes = [max(n // cluster.devices_per_node, 1) for n in DEVICE_COUNTS]
        points = {m * cluster.devices_per_node: simulation.with_link(cluster, nodes=m) for m in nodes}
      sweep[label] = {}
      for x, c in points.items():
        try:
          sweep[label][str(x)] = simulation.simulate(config, c, overlap)["seconds"]
        except ValueError as e:  # a point the trainer would refuse (a batch that does not divide there): left out
          print(f"sweep: {label} at {x} {unit} left out: {e}", file=sys.stderr)
    xs = sorted({x for points in sweep.values() for x in points}, key=float)
    if not xs:
      cli.fail(f"--sweep {_SWEEP.value}: the trainer would refuse every point (stderr says why)")
    print(f"\nsweep over {xlabel}: simulated seconds to train (-: left out)")
    print(f"{'strategy':<{width}}" + "".join(f"{x:>9}" for x in xs))
    for label, points in sweep.items():
      print(f"{label:<{width}}" + "".join(f"{points[x]:>9.1f}" if x in points else f"{'-':>9}" for x in xs))
    output["sweep"] = sweep
    if _PLOT.value:
      plot_sweep(sweep, xlabel, f"{_CONFIG.value.model.name}, {cluster.device.name}: simulated time to train", plot)
  print(json.dumps(output))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_CONFIG))
