"""Convert an image folder (SPLIT/CLASS_NAME/*.jpg) to ArrayRecord for `data.dataset="image_folder"`.

  python scripts/prepare_image_folder.py --folder ~/data/flowers --out ~/data/flowers_ar

The folder holds `train/` and `val/`, each with one sub-folder per class (the same class names in
both). Labels are the sorted class names. Records are written in a fixed random order, so the first
N (`data.train_subset`, `data.eval_subset`) sample every class. Every file is checked with a
reduced-size decode: files that cannot be decoded or read are skipped and listed (log and OUT/info.json); CMYK,
greyscale and PNG-named-.jpg files are kept (the pipeline converts them). No TensorFlow needed. The
files are written in a hidden folder inside OUT (so OUT's disk needs room for a second copy) and moved over
OUT's at the end: a conversion that fails changes nothing in OUT (an OUT it made is removed). A class folder that
cannot be read, an OUT that cannot be written or that lies inside one of the splits, and a split with no image
file (before any decoding) or none that decodes, are refused in one line. Then train with

  python train.py --config configs/imagenet_resnet50.py:tiny --workdir runs/mine \\
      --config.data.dataset=image_folder --config.data.data_dir=OUT

(:tiny fits one machine; the config without a variant is Light's 16 x 8 GPUs.)
"""

import argparse
import os
import shutil
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import logging  # noqa: E402

from light_jax import cli  # noqa: E402
from light_jax.data import DataError, records  # noqa: E402


class _Terminated(BaseException):
  """A SIGTERM (a job killed, a machine shut down): taken as a Ctrl-C is, the folder this run made removed."""


def _terminated(signum, frame):
  raise _Terminated


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--folder", required=True, help="folder with train/CLASS/*.jpg and val/CLASS/*.jpg")
  parser.add_argument("--out", required=True, help="output folder for train.array_record, val.array_record, info.json")
  parser.add_argument(
    "--splits",
    default="train,val",
    help="the splits to convert; others already in --out are kept if their classes are the same (else refused)",
  )
  args = parser.parse_args()
  logging.set_verbosity(logging.INFO)
  folder, splits = os.path.expanduser(args.folder), tuple(args.splits.split(","))
  bad = [s for s in splits if not s or s in (".", "..") or os.sep in s]  # each names a file in --out
  if bad or len(set(splits)) < len(splits):
    cli.fail(f"--splits={args.splits}: give distinct split names, each a folder's name, e.g. train,val")
  if not os.path.isdir(folder):  # it said "it has no train/ folder"
    what = "is a file" if os.path.exists(folder) else "does not exist"
    cli.fail(f"--folder={args.folder} {what}; give the folder that holds train/CLASS_NAME/*.jpg and val/...")
  for split in splits:  # before --out is made: a mistyped folder leaves nothing behind
    if not os.path.isdir(os.path.join(folder, split)):
      cli.fail(
        f"--folder={args.folder}: it has no {split}/ folder; it must hold "
        + " and ".join(f"{s}/CLASS_NAME/*.jpg" for s in splits)
      )
  out = os.path.expanduser(args.out)
  for split in splits:  # its staging folder would then be listed as one of the split's classes
    inside = os.path.realpath(os.path.join(folder, split))
    if os.path.realpath(out) == inside or os.path.realpath(out).startswith(inside + os.sep):
      cli.fail(f"--out={args.out} is inside --folder's {split}/ folder; choose a folder outside --folder's splits")
  new = not os.path.exists(out)
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:  # a file in its place or above it, no permission
    cli.fail(f"--out={args.out}: cannot create it ({e.strerror}); choose another directory")
  previous = signal.signal(signal.SIGTERM, _terminated)
  try:
    info = records.convert_image_folder(folder, out, splits)
  except BaseException as e:  # a Ctrl-C too: the folder this run made goes (an existing one stays as it was)
    if new and not isinstance(e, records.OutInUse):  # made by another conversion at the same moment: its own
      shutil.rmtree(out, ignore_errors=True)
    if isinstance(e, DataError):
      cli.fail(str(e))
    if isinstance(e, OSError):  # a failure of the file system (a full disk is a DataError)
      cli.fail(f"converting {folder} to {out} failed: {e}")
    if isinstance(e, (KeyboardInterrupt, _Terminated)):
      by, code = ("Ctrl-C", 130) if isinstance(e, KeyboardInterrupt) else ("SIGTERM", 143)  # 128 + the signal
      print(f"stopped by {by}: {'nothing written' if new else f'{args.out} left as it was'}", file=sys.stderr)
      sys.exit(code)
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
  print(f"{len(info['classes'])} classes -> {args.out}")
  for split, counts in info["splits"].items():
    print(
      f"  {split:<6} {counts['examples']:>9,} images, {len(counts['skipped'])} skipped, "
      f"{len(counts['empty_classes'])} empty classes"
    )


if __name__ == "__main__":
  main()
