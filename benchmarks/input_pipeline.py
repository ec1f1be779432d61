"""Images/s per core of the training transform: naive baseline, our JPEG path, disk cache, memory cache.

  python benchmarks/input_pipeline.py [--images 200 --rounds 3 --seconds 2]

The benchmark writes its own ImageNet-like JPEGs (about 500 x 375, quality 90, about 100 KB: smooth
shapes, texture and noise), then measures one core (this process, one thread) per path and size:

- naive: full-size Pillow decode, random-resized crop, bilinear resize, flip (what a first version does);
- jpeg: our path, ``decode_crop_resize``: reduced-size JPEG decoding (DCT scaling) when the crop allows,
  and only the rows down to the crop's last one (the region decoder, _jpeg_region.c);
- jpeg_whole: the same without the region decoder (whole JPEGs through simplejpeg), same pixels;
- disk_cache: pixels pre-decoded at a shorter side of ``cache_px[size]`` in an ArrayRecord file on local
  disk (built before timing), random-resized crop + resize + flip; no decoding. The file was just written and is
  small, so its reads come from the page cache: the rate of a cache that fits in memory, not of a disk's reads;
- memory_cache: the same records held in memory.

All paths use random-resized crop with area scale 0.08-1 and a random flip. Rounds interleave the paths,
so a noisy neighbour hits all of them alike; the median round counts. Last line: JSON
{"128": {"naive": R, "jpeg": R, "jpeg_whole": R, "disk_cache": R, "memory_cache": R}, "224": {...},
"jpeg_over_naive_rounds": {"128": [...], "224": [...]}}, R in images/s per core; the last key holds each round's
jpeg / naive ratio at each size, whose spread is the noise of the median ratio.
"""

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from light_jax import cli  # noqa: E402
from light_jax.data import ImageSource, records, transforms  # noqa: E402
from light_jax.exit_codes import signals_exit_at_once  # noqa: E402

CACHE_PX = {128: 160, 224: 256}  # shorter side of the cached copy for each training size


def imagenet_like_jpeg(rng: np.random.Generator) -> bytes:
  """A 500 x 375-ish photo-like JPEG: blurred shapes on a gradient, fine texture and sensor noise."""
  width, height = int(rng.integers(440, 560)), int(rng.integers(330, 420))
  y, x = np.mgrid[0:height, 0:width].astype(np.float32)
  base = np.stack([c0 + c1 * x / width + c2 * y / height for c0, c1, c2 in rng.uniform(-80, 160, (3, 3))], -1)
  image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
  draw = ImageDraw.Draw(image)
  for _ in range(int(rng.integers(8, 20))):
    x0, y0 = rng.integers(0, width), rng.integers(0, height)
    box = [x0, y0, x0 + rng.integers(20, 200), y0 + rng.integers(20, 200)]
    (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
  image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.0))))
  texture = 18 * np.sin(x / rng.uniform(2, 6))[..., None] * np.sin(y / rng.uniform(2, 6))[..., None]
  pixels = np.asarray(image, np.float32) + texture + rng.normal(0, 16, (height, width, 3))
  buffer = io.BytesIO()
  Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
  return buffer.getvalue()


def rate(fn, n: int, seconds: float) -> float:
  """Images per second of fn(i) over consecutive i, for about ``seconds`` (at least one call)."""
  count, start = 0, time.perf_counter()
  while not count or time.perf_counter() - start < seconds:
    fn(count % n)
    count += 1
  return count / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--images", type=int, default=200)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--seconds", type=float, default=2.0, help="per path, size and round")
  parser.add_argument("--workdir", default="", help="where the cache files go (default: a temporary dir)")
  args = parser.parse_args()
  if args.images < 1 or args.rounds < 1 or not 0 < args.seconds < float("inf"):
    cli.fail(f"--images={args.images} --rounds={args.rounds} --seconds={args.seconds:g}: each must be > 0 (and finite)")
  if not args.workdir:
    with tempfile.TemporaryDirectory(prefix="input_bench_") as workdir:
      return run(args, workdir)
  problem = cli.unwritable_folder(args.workdir)  # before the minutes of work that end in it
  if problem:
    cli.fail(f"--workdir={args.workdir}: {problem}")
  os.makedirs(args.workdir, exist_ok=True)
  run(args, args.workdir)


def run(args, workdir: str):
  """Builds the JPEGs and the caches (in ``workdir``), times every path, prints the table and the JSON line."""
  if not transforms.region_decoding_available():
    print("warning: the JPEG region decoder was not built (see setup.py): 'jpeg' decodes whole images", file=sys.stderr)
  rng = np.random.default_rng(0)
  jpegs = [imagenet_like_jpeg(rng) for _ in range(args.images)]
  sizes = [Image.open(io.BytesIO(j)).size for j in jpegs]
  print(
    f"{len(jpegs)} JPEGs: mean {np.mean([s[0] for s in sizes]):.0f} x {np.mean([s[1] for s in sizes]):.0f} px, "
    f"mean {np.mean([len(j) for j in jpegs]) / 1e3:.0f} KB, quality 90",
    file=sys.stderr,
  )
  encoded = records.ListRecords([(j, i % 10, f"img_{i}.JPEG") for i, j in enumerate(jpegs)])

  paths = {}
  for size in (128, 224):
    cache_file = os.path.join(workdir, f"cache_{CACHE_PX[size]}.array_record")
    records.build_disk_cache(encoded, cache_file, CACHE_PX[size], workers=1)
    jpeg_source = ImageSource(encoded, 10, "jpeg")
    disk_source = ImageSource(records.DecodedCache(cache_file), 10, "disk")
    memory_source = ImageSource(records.DecodedCache(cache_file, in_memory=True), 10, "memory")
    example_rng = np.random.default_rng(1)
    paths[size] = {
      "naive": lambda i, s=size: transforms.naive_train_transform(jpegs[i], s, example_rng, example_rng.random() < 0.5),
      "jpeg": lambda i, s=size, src=jpeg_source: src.train_example(i, example_rng, s),
      # Our path without the region decoder (whole JPEGs through simplejpeg): what stopping early buys.
      "jpeg_whole": lambda i, s=size: transforms.decode_crop_resize(
        jpegs[i], s, example_rng, example_rng.random() < 0.5, region_decode=False
      ),
      "disk_cache": lambda i, s=size, src=disk_source: src.train_example(i, example_rng, s),
      "memory_cache": lambda i, s=size, src=memory_source: src.train_example(i, example_rng, s),
    }
  for size in paths:  # every path produces the right thing before it is timed
    for name, fn in paths[size].items():
      out = fn(0)
      assert out[0].shape == (size, size, 3) if isinstance(out, tuple) else out.shape == (size, size, 3), name

  measured = {size: {name: [] for name in paths[size]} for size in paths}
  for r in range(args.rounds):
    for size in paths:
      for name, fn in paths[size].items():
        measured[size][name].append(rate(fn, len(jpegs), args.seconds))
    print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr)

  result = {
    str(size): {name: round(statistics.median(v), 1) for name, v in measured[size].items()} for size in measured
  }
  print(
    f"\nimages/s on one core (median of {args.rounds} interleaved rounds of {args.seconds:g} s), "
    f"random-resized crop 0.08-1 + flip"
  )
  print(
    f"{'size':>5}{'naive':>10}{'jpeg':>10}{'jpeg_whole':>12}{'disk_cache':>12}{'memory_cache':>14}"
    f"{'jpeg/naive':>12}{'jpeg/whole':>12}{'cache px':>10}"
  )
  for size, row in result.items():
    print(
      f"{size:>5}{row['naive']:>10.0f}{row['jpeg']:>10.0f}{row['jpeg_whole']:>12.0f}{row['disk_cache']:>12.0f}"
      f"{row['memory_cache']:>14.0f}{row['jpeg'] / row['naive']:>11.2f}x{row['jpeg'] / row['jpeg_whole']:>11.2f}x"
      f"{CACHE_PX[int(size)]:>10}"
    )
  # The noise: the ratio of each round (its paths ran back to back, so a slow moment slows both alike).
  ratios = {size: [j / n for j, n in zip(measured[size]["jpeg"], measured[size]["naive"])] for size in measured}
  print("jpeg/naive per round, min-max: " + "; ".join(f"{s} px {min(r):.2f}-{max(r):.2f}x" for s, r in ratios.items()))
  print(json.dumps({**result, "jpeg_over_naive_rounds": {str(s): [round(x, 3) for x in r] for s, r in ratios.items()}}))


if __name__ == "__main__":
  with signals_exit_at_once("measuring: no result written", exit_handlers=True):  # the temporary folder goes too
    main()
