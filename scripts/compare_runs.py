"""Plot several runs' curves in one figure and print their final accuracies.

python scripts/compare_runs.py --out docs/hitopk_vs_dense.png \
    hierarchical=runs/fashion_mnist hitopk=runs/fashion_mnist_hitopk
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from light_jax import cli, metrics  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("runs", nargs="+", help="LABEL=WORKDIR")
  parser.add_argument("--out", required=True)
  parser.add_argument("--title", default="")
  args = parser.parse_args()
  args.out = cli.plot_path(args.out, "--out")
  runs = {}
  for spec in args.runs:
    label, _, workdir = spec.partition("=")
    if not label or not workdir:
      cli.fail(f"{spec!r} is not LABEL=WORKDIR; e.g. dense=runs/fashion_mnist")
    if label in runs:  # the second would replace the first's row and curve
      cli.fail(f"{spec}: the label {label!r} is given twice; give each run its own label")
    try:
      runs[label] = metrics.read_metrics(workdir)
    except (FileNotFoundError, NotADirectoryError):
      cli.fail(f"{spec}: no {os.path.join(workdir, 'metrics.jsonl')}; give the workdir of a train.py run")
    except metrics.MetricsError as e:
      cli.fail(f"{spec}: {e}")
    except OSError as e:  # a folder in its place, no permission
      cli.fail(f"{spec}: cannot read {os.path.join(workdir, 'metrics.jsonl')} ({e.strerror})")
    fields = ("epoch", "train_loss", "eval_top1", "eval_top5", "inter_node_bytes_per_step")
    missing = sorted({f for r in runs[label] for f in fields if not isinstance(r.get(f), (int, float))})
    if missing:  # an older train.py's records, or another program's
      cli.fail(
        f"{spec}: {os.path.join(workdir, 'metrics.jsonl')} holds records without a number in "
        f"{', '.join(missing)}; give the workdir of a run of this train.py"
      )
    if not runs[label]:
      cli.fail(f"{spec}: {os.path.join(workdir, 'metrics.jsonl')} holds no evaluation yet; give a run that has one")
  metrics.plot_comparison(runs, args.out, args.title)
  finals = {label: records[-1] for label, records in runs.items()}
  width = max(16, *(len(label) + 2 for label in finals))
  # The last evaluation's bytes per step: a density warm-up's early epochs sent more (summary.json holds the mean).
  print(f"{'run':<{width}}{'epochs':>8}{'test top-1':>12}{'test top-5':>12}{'B/step at the end':>20}")
  for label, r in finals.items():
    cut = "" if r.get("final") else "  (not finished)"  # the last record of a run still going, or killed
    print(
      f"{label:<{width}}{r['epoch']:>8.2f}{100 * r['eval_top1']:>11.2f}%{100 * r['eval_top5']:>11.2f}%"
      f"{r['inter_node_bytes_per_step']:>20,}{cut}"
    )
  print(f"plot: {args.out}", file=sys.stderr)
  print(
    json.dumps(
      {
        label: {
          "eval_top1": r["eval_top1"],
          "eval_top5": r["eval_top5"],
          "inter_node_bytes_per_step": r["inter_node_bytes_per_step"],
        }
        for label, r in finals.items()
      }
    )
  )


if __name__ == "__main__":
  main()
