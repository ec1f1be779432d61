"""Accuracy against inter-node bytes: the compressed reductions beside the dense one on Fashion-MNIST.

  python benchmarks/compression_accuracy.py --workdir runs/compression --plot docs/compression_accuracy.png
  python benchmarks/compression_accuracy.py --only hierarchical,powersgd@4 --report_only

Every run is a whole `train.py` run of configs/fashion_mnist.py (8 epochs, batch 256, SGD, 2 x 4 mesh),
the same config but for the reduction, one after the other on this machine's cores (RUNS below).
PowerSGD and DiLoCo are each paired with hitopk at about the same inter-node bytes per step (rank 4 with
density 3%, rank 1 with 1%, 8 local steps with 6%), so the table compares what each buys with the same
traffic. Reported per run: final test top-1 and top-5, the difference in top-1 points to the dense run,
inter- and intra-node bytes per device per step (the project's accounting), training seconds. A run whose
workdir already holds the summary of the same command is reused (--rerun to force). The last line is one
JSON object keyed by label.
"""

from __future__ import annotations

import sys

import train_runs  # benchmarks/, this script's directory

BASE = "configs/fashion_mnist.py"
POWERSGD = "--config.comm.strategy=powersgd"
HITOPK = "--config.comm.strategy=hitopk"
DILOCO = "--config.comm.strategy=diloco"
# label -> (config, overrides, what it shows)
RUNS = {
  "hierarchical": (BASE, [], "dense: hierarchical all-reduce (the default)"),
  "powersgd@4": (BASE, [POWERSGD, "--config.comm.rank=4"], "PowerSGD rank 4, error feedback"),
  "diloco@8": (BASE, [DILOCO, "--config.comm.sync_every=8"], "DiLoCo: 8 local steps, outer Nesterov lr 0.7"),
  "hitopk@0.03": (BASE, [HITOPK, "--config.comm.density=0.03"], "hitopk 3%: about powersgd@4's inter-node bytes"),
  "hitopk@0.06": (BASE, [HITOPK, "--config.comm.density=0.06"], "hitopk 6%: about diloco@8's inter-node bytes"),
  "local_sgd@8": (
    BASE,
    [DILOCO, "--config.comm.sync_every=8", "--config.comm.outer_lr=1.0", "--config.comm.outer_momentum=0.0"],
    "diloco@8 with outer lr 1, no momentum: the machines' mean",
  ),
  "powersgd@1": (BASE, [POWERSGD, "--config.comm.rank=1"], "PowerSGD rank 1, error feedback"),
  "hitopk@0.01": (BASE, [HITOPK, "--config.comm.density=0.01"], "hitopk 1%: about powersgd@1's inter-node bytes"),
}
DENSE = "hierarchical"


def report(results: dict[str, dict], stopped: dict[str, list[dict]], reference: float | None) -> None:
  """The table of finished runs; ``reference``: the dense run's top-1, for the "vs dense" column."""
  for label, records in stopped.items():
    print(f"{label}: stopped after epoch {records[-1]['epoch']:g} (top-1 {100 * records[-1]['eval_top1']:.2f}%)")
  header = ("run", "top-1", "vs dense", "top-5", "inter B/step", "intra B/step", "train s")
  print("{:17} {:>7} {:>8} {:>7} {:>13} {:>13} {:>8}  what".format(*header))
  for label, r in results.items():
    delta = f"{100 * (r['top1'] - reference):+.2f}" if reference is not None else ""
    print(
      f"{label:17} {100 * r['top1']:6.2f}% {delta:>8} {100 * r['top5']:6.2f}% {r['inter_node_bytes_per_step']:13,d} "
      f"{r['intra_node_bytes_per_step']:13,d} {r['train_seconds']:8.0f}  {RUNS[label][2]}"
    )


def plot(results: dict[str, dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.6))
  for label, r in results.items():
    records = r["records"]
    by_epoch.plot([x["epoch"] for x in records], [100 * x["eval_top1"] for x in records], marker="o", ms=3, label=label)
    by_bytes.scatter(r["inter_node_bytes_per_step"], 100 * r["top1"], s=30)
    by_bytes.annotate(label, (r["inter_node_bytes_per_step"], 100 * r["top1"]), fontsize=8, xytext=(4, 4),
                      textcoords="offset points")  # fmt: skip
  by_epoch.set(xlabel="epoch", ylabel="test top-1 (%)", title="Fashion-MNIST, 8 epochs, 2 x 4 devices")
  by_epoch.set_ylim(80, 95)
  by_bytes.set(xscale="log", xlabel="inter-node bytes per device per step", ylabel="final test top-1 (%)",
               title="what the traffic buys")  # fmt: skip
  for ax in (by_epoch, by_bytes):
    ax.grid(alpha=0.3)
  by_epoch.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}", file=sys.stderr)


def main() -> None:
  args, results, stopped = train_runs.study(
    __doc__.split("\n\n")[0], RUNS, "runs/compression", "PNG: top-1 against epoch, final top-1 against inter-node bytes"
  )
  dense = train_runs.row_figures(DENSE, RUNS, args.workdir, results)  # this report's, or its finished run's
  report(results, stopped, dense["top1"] if dense else None)
  if args.plot and results:
    plot(results, args.plot)
  elif args.plot:
    print(f"no plot: no run has finished ({args.plot} not written)", file=sys.stderr)
  print(train_runs.figures(results))
  if args.failed:  # each named above in its own line
    sys.exit(1)


if __name__ == "__main__":
  main()
