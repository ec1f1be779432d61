"""Image transforms on the host: NumPy, Pillow and libjpeg-turbo (they run in grain threads and worker processes).

Two transforms for JPEG datasets, each "choose a box in the image, resize the box to ``size`` x ``size``":

- training: ``random_resized_crop_box`` (Inception/torchvision style: area fraction in ``scale``,
  aspect ratio log-uniform in ``ratio``) and a horizontal flip;
- evaluation: ``center_crop_box``, the central square of side ``crop_fraction`` x the shorter side
  (the same region as "resize the shorter side to size / 0.875, then centre-crop size", without that
  pipeline's rounding of the resized side and of the crop's offset).

``decode_crop_resize`` works on JPEG bytes and decodes only what the box needs: a JPEG can be decoded
at 1/2, 1/4 or 1/8 scale for less (libjpeg-turbo's DCT scaling), a box much larger than ``size``
never needs full resolution, and the rows below the box need no decoding at all. Entropy decoding is
most of a JPEG's cost and runs top to bottom, so stopping at the box's last row is the larger saving;
``_jpeg_region`` (a small C extension over the system's libjpeg-turbo, _jpeg_region.c) does both.
Without it (no libjpeg headers at install time) whole JPEGs go through simplejpeg (libjpeg-turbo's
TurboJPEG API with fast IDCT and upsampling, the same pixels). Anything libjpeg refuses (CMYK JPEGs,
PNGs named .JPEG, other formats, damaged files) goes through Pillow, which also converts greyscale,
CMYK, palette and RGBA images to RGB. Bytes that neither can decode (corrupt, truncated) raise
``BadImage``. Output pixels are uint8 RGB. Measured in benchmarks/input_pipeline.py.

``resize_images`` resizes whole images of an array dataset (progressive resizing of Fashion-MNIST).
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import simplejpeg
from PIL import Image

try:  # the C extension built by `pip install` when libjpeg's headers are there (see setup.py)
  from light_jax.data import _jpeg_region
except ImportError:
  _jpeg_region = None

RESAMPLE = Image.Resampling.BILINEAR
EVAL_CROP_FRACTION = 0.875
Box = tuple[float, float, float, float]  # (left, top, right, bottom) in pixels


def region_decoding_available() -> bool:
  """Whether the install built ``_jpeg_region`` (it needs a C compiler and libjpeg's headers)."""
  return _jpeg_region is not None


class BadImage(ValueError):
  """The bytes are not a decodable image (corrupt, truncated, unknown format)."""


def random_resized_crop_box(
  width: int,
  height: int,
  rng: np.random.Generator,
  scale: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Box:
  """A random box covering ``scale`` of the area with aspect ratio in ``ratio`` (10 tries, then centre)."""
  area = width * height
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(*log_ratio))
    w = round(math.sqrt(target * aspect))
    h = round(math.sqrt(target / aspect))
    if 0 < w <= width and 0 < h <= height:
      left = int(rng.integers(0, width - w + 1))
      top = int(rng.integers(0, height - h + 1))
      return (left, top, left + w, top + h)
  # Fallback: the largest centred box within the ratio bounds.
  in_ratio = width / height
  if in_ratio < ratio[0]:
    w, h = width, round(width / ratio[0])
  elif in_ratio > ratio[1]:
    w, h = round(height * ratio[1]), height
  else:
    w, h = width, height
  left, top = (width - w) // 2, (height - h) // 2
  return (left, top, left + w, top + h)


def center_crop_box(width: int, height: int, crop_fraction: float = EVAL_CROP_FRACTION) -> Box:
  side = crop_fraction * min(width, height)
  left, top = (width - side) / 2, (height - side) / 2
  return (left, top, left + side, top + side)


def open_image(data: bytes) -> Image.Image:
  """Pillow's lazy image (header parsed, pixels not decoded yet)."""
  try:
    return Image.open(io.BytesIO(data))
  except Exception as e:  # PIL.UnidentifiedImageError, or a header that is cut short
    raise BadImage(f"not an image Pillow can read ({type(e).__name__}: {e})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
  try:
    image.load()
    if image.mode.startswith("I;16") or image.mode == "I":  # 16-bit greyscale (medical, scientific images)
      image = _eight_bits(image)
    return image if image.mode == "RGB" else image.convert("RGB")
  except Exception as e:  # OSError("image file is truncated ..."), decoder errors
    raise BadImage(f"cannot decode ({type(e).__name__}: {e})") from None


def _eight_bits(image: Image.Image) -> Image.Image:
  """A 16-bit greyscale image ("I;16*", or "I", which Pillow gives 16-bit PNGs) as 8-bit ("L"), its full range
  scaled down: Pillow's own conversion clips everything above 255 to white."""
  pixels = np.asarray(image, dtype=np.int64)
  return Image.fromarray((np.clip(pixels, 0, 65535) // 257).astype(np.uint8), mode="L")


def as_image(pixels: np.ndarray) -> Image.Image:
  """A Pillow image of a uint8 (h, w, 3) array (Pillow copies it: it keeps RGB at 4 bytes per pixel)."""
  height, width = pixels.shape[:2]
  return Image.frombuffer("RGB", (width, height), np.ascontiguousarray(pixels), "raw", "RGB", 0, 1)


def _dct_denominator(width: int, height: int, min_width: int, min_height: int) -> int:
  """The largest of 1, 2, 4, 8 whose DCT-scaled size (1/denominator, rounded up) keeps both minimums.

  libjpeg-turbo also scales by 7/8, 3/4, 5/8, ..., but those are slower than decoding at full size
  (measured: 1.7 ms against 1.1 ms for a 500 x 375 JPEG); only the power-of-two ones save time.
  """
  for denominator in (8, 4, 2):
    if -(-width // denominator) >= min_width and -(-height // denominator) >= min_height:
      return denominator
  return 1


def _turbo_decode(data: bytes, size: tuple[int, int], min_width: int = 0, min_height: int = 0) -> np.ndarray | None:
  """RGB pixels of a whole JPEG of ``size`` at the smallest power-of-two DCT scale that keeps both
  minimums, or None when simplejpeg cannot decode it (CMYK, damaged, not a JPEG: Pillow then decides)."""
  denominator = _dct_denominator(*size, min_width, min_height)
  scale = {"min_width": -(-size[0] // denominator), "min_height": -(-size[1] // denominator)}
  try:
    return simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True, strict=True, **scale)
  except ValueError as e:
    if (junk := _END_JUNK.search(str(e))) and int(junk.group(1)) <= _MOST_END_JUNK:
      # A few bytes between the last scan and the end marker (some ImageNet files have one): every pixel was
      # decoded before libjpeg met them (Pillow decodes the file, the region decoder stops before them), so the
      # image is whole. Thousands of them are what damaged data leaves, its scan having ended early.
      return simplejpeg.decode_jpeg(data, "RGB", fastdct=True, fastupsample=True, strict=False, **scale)
    # Damaged entropy-coded data: libjpeg warns and goes on, and Pillow would decode the damage into the pixels
    # (as the region decoder, which takes the warning for an error, would not). Anything else (a JPEG kind
    # simplejpeg cannot read): Pillow decides.
    if str(e).startswith(("Corrupt JPEG data", "Premature end of JPEG")):
      raise BadImage(f"damaged JPEG data ({e})") from None
    return None


# libjpeg's warning for bytes before the end-of-image marker (0xd9) after the image's last scan, and how many of
# them a whole image may have (damage in the last scan left 2,073 and 2,300 in tests/test_image_data.py). More are
# refused here (damage, as a rule), while the region decoder, which stops before them, decodes such a file: there
# the JPEG path's training crops and the decoded cache (or an image folder's conversion) disagree.
_END_JUNK = re.compile(r"(\d+) extraneous bytes before marker 0xd9")
_MOST_END_JUNK = 16


def _read_span(start: float, end: float, limit: int, out_size: int) -> tuple[int, int]:
  """The pixels [first, last) along one axis that resampling [start, end) of an image ``limit`` pixels
  long to ``out_size`` reads: Pillow's bilinear filter reaches (end - start) / out_size pixels (at
  least 1) beyond the box; one more for rounding."""
  margin = math.ceil(max((end - start) / out_size, 1.0)) + 1
  return max(0, math.floor(start) - margin), min(limit, math.ceil(end) + margin)


def _decode_region(
  data: bytes, size: tuple[int, int], denominator: int, box: Box, out_size: int
) -> tuple[Image.Image, Box] | None:
  """The rows of a JPEG of ``size`` that resizing ``box`` to ``out_size`` reads, decoded at 1/denominator
  by ``_jpeg_region`` (only the columns it reads; the others stay black), and the box in their
  coordinates; None when libjpeg refuses the bytes (CMYK, damaged: Pillow then decides)."""
  width, height = -(-size[0] // denominator), -(-size[1] // denominator)
  box = _scale_box(box, 1 / denominator, (width, height))
  left, right = _read_span(box[0], box[2], width, out_size)
  top, bottom = _read_span(box[1], box[3], height, out_size)
  try:
    pixels = _jpeg_region.decode_region(data, denominator, left, top, right, bottom)
  except ValueError:
    return None
  image = as_image(np.frombuffer(pixels, np.uint8).reshape(bottom - top, width, 3))
  return image, (box[0], box[1] - top, box[2], box[3] - top)


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
  try:
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    return width, height
  except ValueError:
    return None


def crop_resize(image: Image.Image, box: Box, size: int, flip: bool = False) -> np.ndarray:
  """uint8 (size, size, 3): ``box`` of a decoded RGB image, resized (bilinear), optionally mirrored.

  Two one-axis Pillow resizes, rows first, over just the rows the filter reads. One two-axis resize
  would let Pillow choose the order of its two passes from the image's size, and the order changes
  the rounding (by 1 in a quarter of the pixels): an image decoded only as far as the box needs
  (``_decode_region``) would then not give the pixels of the whole image.
  """
  top, bottom = _read_span(box[1], box[3], image.height, size)
  if (top, bottom) != (0, image.height):
    image = image.crop((0, top, image.width, bottom))
  rows = image.resize((size, image.height), RESAMPLE, box=(box[0], 0, box[2], image.height))
  out = rows.resize((size, size), RESAMPLE, box=(0, box[1] - top, size, box[3] - top))
  if flip:
    out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
  return np.asarray(out, dtype=np.uint8)


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
  """uint8 (B, H, W, C) -> (B, size, size, C): each image resized whole to a square, bilinear as ``crop_resize``
  (Pillow widens the filter when it shrinks, so no pixel is skipped). For progressive resizing of array datasets.
  RGB goes through Pillow at once, any other channel count one channel at a time (Pillow would treat 2 or 4
  channels as colour and alpha, and premultiply)."""
  count, _, _, channels = images.shape
  out = np.empty((count, size, size, channels), np.uint8)
  planes = [images] if channels == 3 else [images[..., c] for c in range(channels)]
  for i in range(count):
    resized = [np.asarray(Image.fromarray(plane[i]).resize((size, size), RESAMPLE)) for plane in planes]
    out[i] = resized[0] if channels == 3 else np.stack(resized, axis=-1)
  return out


def _decode_at_least(data: bytes, size: tuple[int, int] | None, min_width: int, min_height: int) -> Image.Image:
  """Decoded RGB image at the smallest power-of-two DCT scale that keeps both minimums.

  ``size`` is the JPEG's (width, height) from its header, or None when it is not a JPEG simplejpeg
  reads; simplejpeg decodes what it can, Pillow (with ``draft`` for JPEGs) everything else.
  """
  pixels = _turbo_decode(data, size, min_width, min_height) if size else None
  if pixels is not None:
    return as_image(pixels)
  image = open_image(data)
  if image.format == "JPEG":
    image.draft("RGB", (min_width, min_height))
  return _to_rgb(image)


def _image_size(data: bytes) -> tuple[tuple[int, int], tuple[int, int] | None]:
  """((width, height), the same if simplejpeg reads the header, else None)."""
  jpeg_size = _jpeg_size(data)
  return (jpeg_size or open_image(data).size), jpeg_size


def decode_crop_resize(
  data: bytes,
  size: int,
  rng: np.random.Generator | None = None,
  flip: bool = False,
  scale: tuple[float, float] = (0.08, 1.0),
  reduced_decode: bool = True,
  region_decode: bool = True,
) -> np.ndarray:
  """Training (``rng`` given: random box + ``flip``) or evaluation (centre box) transform of encoded bytes.

  A JPEG is decoded only as far as the box needs: with ``reduced_decode`` at the smallest DCT scale
  (1, 1/2, 1/4, 1/8) that still leaves the box at least ``size`` pixels on each side (a box decoded
  at a reduced scale is only ever shrunk by the final resize; one under ``size`` pixels is decoded at full
  scale and enlarged), and for a training box with ``region_decode`` (if the decoder was built) only the rows
  down to the box's last one; for an intact JPEG the output pixels are the same as from decoding the whole image.
  """
  (width, height), jpeg_size = _image_size(data)
  box = random_resized_crop_box(width, height, rng, scale) if rng is not None else center_crop_box(width, height)
  box_w, box_h = box[2] - box[0], box[3] - box[1]
  wanted = (math.ceil(width * size / box_w), math.ceil(height * size / box_h)) if reduced_decode else (width, height)
  # Decoding stops at the box's last row, so damage below it would go unseen: a JPEG that does not end
  # with its end-of-image marker (a cut-off download, the usual damage) is decoded whole, which rejects
  # it, so that it is bad for every crop, not for some. Damage inside a file that still ends with the marker
  # (flipped bytes) shows only at the end of the scan: a training crop above it decodes. Evaluation (its centre
  # box reaches nearly the last row anyway) decodes whole, so that whether an image counts does not depend on the
  # decoder being built.
  region = region_decode and rng is not None and _jpeg_region is not None
  if region and jpeg_size is not None and data.endswith(b"\xff\xd9"):
    decoded = _decode_region(data, jpeg_size, _dct_denominator(width, height, *wanted), box, size)
    if decoded is not None:
      return crop_resize(*decoded, size, flip)
  image = _decode_at_least(data, jpeg_size, *wanted)
  # The decoder's scale, 1, 1/2, 1/4 or 1/8 (its sizes are rounded up, so the exact ratio is not it).
  factor = next((1 / d for d in (1, 2, 4, 8) if -(-width // d) == image.size[0]), image.size[0] / width)
  return crop_resize(image, _scale_box(box, factor, image.size), size, flip)


def _scale_box(box: Box, factor: float, image_size: tuple[int, int]) -> Box:
  """``box`` in an image scaled by ``factor`` whose size is ``image_size`` (rounded up, hence the clip)."""
  return (box[0] * factor, box[1] * factor, min(box[2] * factor, image_size[0]), min(box[3] * factor, image_size[1]))


def decode(data: bytes) -> Image.Image:
  """The whole image, decoded at full size, as RGB."""
  return _to_rgb(open_image(data))


def shorter_side_size(width: int, height: int, shorter: int) -> tuple[int, int]:
  """(width, height) scaled so that the shorter side is ``shorter``, never enlarged: the cached size."""
  factor = shorter / min(width, height)
  if factor >= 1:
    return width, height
  return max(1, round(width * factor)), max(1, round(height * factor))


def resize_shorter_side(image: Image.Image, shorter: int) -> Image.Image:
  """Scaled to ``shorter_side_size``: what the decoded caches store."""
  target = shorter_side_size(*image.size, shorter)
  return image if target == image.size else image.resize(target, RESAMPLE)


def decode_shorter_side(data: bytes, shorter: int) -> Image.Image:
  """Decoded RGB image scaled to a shorter side of ``shorter`` px (JPEGs decoded at a reduced DCT scale
  that stays at least that large): what the decoded caches store."""
  (width, height), jpeg_size = _image_size(data)
  factor = shorter / min(width, height)
  image = _decode_at_least(data, jpeg_size, math.ceil(width * factor), math.ceil(height * factor))
  return resize_shorter_side(image, shorter)


def naive_train_transform(data: bytes, size: int, rng: np.random.Generator, flip: bool) -> np.ndarray:
  """The baseline the benchmark compares with: full-size decode, crop, bilinear resize, flip."""
  image = decode(data)
  box = random_resized_crop_box(*image.size, rng)
  cropped = image.crop(tuple(int(c) for c in box)).resize((size, size), RESAMPLE)
  array = np.asarray(cropped, dtype=np.uint8)
  return np.ascontiguousarray(array[:, ::-1]) if flip else array
