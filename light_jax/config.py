"""The config schema (``base_config``), which fields may change on resume, and validation.

Config files under ``configs/`` start from ``base_config()`` and state only what differs; every field,
its default and its meaning are here. ``validate`` turns every mistake a user can make in a config file
or a ``--config.FIELD=VALUE`` override into one ``ConfigError`` that names the field, the bad value and
what to change, before anything heavy starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_collections

OPTIMIZERS = ("sgd", "lars", "lamb")
DECAYS = ("poly", "linear", "cosine")
DTYPES = ("float32", "bfloat16")  # comm.dtype
RESIDUAL_UNITS = ("gradient", "update")  # comm.residual_units
K_ALLOCATIONS = ("proportional", "sqrt")  # comm.k_allocation
MODEL_DTYPES = ("float32", "bfloat16", "float16")
LOSS_SCALES = ("auto", "dynamic", "none")
MOMENTUM_SCHEDULES = ("constant", "cycle")
DATASETS = ("fashion_mnist", "imagenet2012", "image_folder")
CACHES = ("none", "disk", "memory")


# Fields that may change between a run and its resumption: they change neither shapes, nor the data
# order, nor the maths of a step (a prefix covers its sub-fields). Four exceptions, on purpose: num_epochs
# lengthens or shortens a run, and the schedules (warm-up, decay, a cycled momentum) stretch over the new
# count, so the rate jumps at the resume; with comm.strategy=diloco the machines sync at the run's last
# step, so a run stopped by max_steps and resumed with a larger one took a sync the longer run would not; on
# JPEG datasets data.cache and data.cache_budget_gb choose between the decoded cache's pixels (decoded once at
# data.cache_size) and the JPEGs' (the same images in the same order, resampled otherwise); and micro_batches, the
# knob for a step a device cannot hold, normalises BatchNorm over each slice (and moves its running statistics once
# a slice), where one slice normalised over the device's batch.
SAFE_TO_CHANGE = (
  "num_epochs",
  "max_steps",
  "log_every_steps",
  # The same step in more slices where a device ran out of memory (BatchNorm then normalises over each slice).
  "micro_batches",
  "checkpoint",
  "train",
  "mesh.cpu_devices",
  # As written (-1: from the processes and their devices); the mesh they give is checked against the checkpoint's.
  "mesh.nodes",
  "mesh.local",
  "data.read_threads",
  "data.host_prefetch",
  "data.prefetch",
  "data.eval_batch_size",
  "data.eval_subset",
  "data.num_workers",
  "data.cache",
  "data.cache_dir",
  "data.cache_budget_gb",
  "data.data_dir",
)


# The fields of one machine's own input pipeline (where its data and cache are, how many threads and worker
# processes read it, how far ahead): the processes of one run may differ in these (light_jax/same_settings.py).
MACHINE_FIELDS = frozenset(
  {"data.data_dir", "data.cache_dir", "data.read_threads", "data.num_workers", "data.host_prefetch", "data.prefetch"}
)


def flat_fields(tree: dict, prefix: str = "") -> dict[str, Any]:
  """A config as a dict (``config.to_dict()``, or as JSON holds it) flattened to {"optimizer.base_lr": 0.1, ...}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flat_fields(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def base_config() -> ml_collections.ConfigDict:
  """Every field with its default: Fashion-MNIST on 8 simulated CPU devices as a 2 x 4 mesh."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # nodes x local devices; -1 fills one of them from the device count (both -1: one node per process).
  # cpu_devices: CPU devices to simulate when running on the CPU (split over processes); no effect on GPUs.
  config.mesh = dict(nodes=2, local=4, cpu_devices=8)

  # ResNet v1.5 family (light_jax/models); width 0 = the architecture's own; dtype of the compute
  # (float32 | bfloat16 | float16; parameters stay float32).
  # loss_scale: auto (dynamic for float16, none otherwise) | dynamic | none. Dynamic loss scaling (jmp)
  # starts at 2**15, halves the scale on a step whose gradient overflows (that step is skipped and counted
  # in nonfinite_steps) and doubles it after loss_scale_period steps without one.
  config.model = dict(name="resnet8_fast", width=0, dtype="float32", loss_scale="auto", loss_scale_period=2000)

  config.data = dict(
    dataset="fashion_mnist",  # fashion_mnist | imagenet2012 | image_folder
    data_dir="/usr/share/datasets/fashion-mnist",
    crop_padding=0,  # >0: random crop of the zero-padded image (array datasets)
    random_flip=True,
    train_subset=0,  # 0 = the whole training split; >0 = its first N examples
    eval_subset=0,  # 0 = the whole evaluation split
    eval_batch_size=1000,
    prefetch=2,  # batches placed on the devices ahead of the step
    read_threads=1,  # grain threads that assemble host batches
    host_prefetch=4,  # batches grain assembles ahead (bounds its parallelism too; -1: measure)
    num_workers=0,  # grain worker processes (-1: measure a few counts at start-up, keep the best)
    # Progressive resizing, "first_epoch:size[:global_batch],...", e.g. "0:128,14:224:512"; "": image_size
    # (JPEG datasets) or the arrays' own size (Fashion-MNIST, whose images are resized per phase, evaluated at 28).
    resolution_schedule="",
    # The JPEG datasets (imagenet2012, image_folder):
    image_size=0,  # eval size, and the training size without a resolution schedule
    random_scale_min=0.08,  # random-resized-crop area from this fraction of the image to all of it
    reduced_decode=True,  # decode JPEGs at 1/2, 1/4, 1/8 scale, and only the rows, a crop needs
    cache="none",  # none | disk (decoded, shorter side cache_size, in cache_dir) | memory
    cache_dir="/tmp/light_jax_cache",
    # Shorter side of the cached images: at least the largest training size. Crops are drawn on the cached
    # image, so at that size most are enlarged to the training size: a larger cache_size keeps more detail.
    cache_size=160,
    cache_budget_gb=64.0,  # the cache is skipped (JPEGs read instead) when it would be larger
  )

  config.global_batch_size = 256
  # Gradient accumulation: each device runs its share of a step's batch in this many slices, one after the
  # other, and averages their gradients before the one reduction (for batches larger than the devices hold).
  config.micro_batches = 1
  config.num_epochs = 8
  config.max_steps = 0  # 0 = no limit; otherwise stop after this many steps

  config.optimizer = dict(
    name="sgd",  # sgd | lars | lamb
    base_lr=0.2,  # peak lr = base_lr * global_batch_size / 256 (per phase)
    momentum=0.9,
    momentum_schedule="constant",  # constant | cycle (momentum falls to min_momentum as the lr rises)
    min_momentum=0.85,
    nesterov=True,
    weight_decay=5e-4,  # not on biases and BatchNorm parameters
    warmup_epochs=1.0,  # linear warm-up from 0
    decay="cosine",  # poly (power 2) | linear | cosine
    end_lr_factor=0.0,  # final lr = peak lr * end_lr_factor
    lars_eta=0.001,  # LARS trust coefficient
    lars_trust="optax",  # optax: eta|w| / |g + wd w| | mlperf: eta|w| / (|g| + wd|w|) (MLPerf ResNet-50)
    fused_norms=False,  # lars: every tensor's norms from packed buffers in two passes (optim.tensor_norms)
    # Each device applies the optimizer to the shard it owns after the hierarchical reduce-scatter, with
    # 1/local of the optimizer state; the all-gather carries the updates (sgd, lars; hierarchical, hitopk; with
    # comm.fusion=adaptive hitopk only, whose buckets are planned once).
    sharded_update=False,
    label_smoothing=0.1,
  )

  config.comm = dict(
    # dense | hierarchical | hitopk | topk | gtopk (light_jax/parallel/strategies.py), powersgd (rank-r
    # tensors, light_jax/parallel/powersgd.py), diloco (local steps, light_jax/parallel/diloco.py), or auto: a
    # strategy per bucket, the one the cost model (cost_model, device_tflops) says ends soonest
    strategy="hierarchical",
    fusion="fixed",  # none | fixed (buckets of bucket_bytes) | adaptive (MG-WFBP)
    bucket_bytes=25 * 2**20,
    # Wire dtype of the dense hops: bfloat16 halves them. hierarchical and hitopk sum in float32; dense (and the
    # dense buckets of topk, gtopk) sum in bfloat16; diloco narrows its outer all-reduce, not its every-step one.
    dtype="float32",
    cost_model="v100_nvlink_25gbe",  # adaptive, auto: a cost_model.PRESETS name or a calibrated JSON file
    device_tflops=15.0,  # adaptive, auto: sustained FLOP/s (x 1e12) for backward-time estimates
    # The top-k strategies (hitopk, topk, gtopk):
    density=0.01,  # fraction of entries kept (per local shard for hitopk)
    error_feedback=True,  # what is not sent is kept and added to the next step's gradient
    topk_selector="exact",  # exact (lax.top_k) | mstopk (sort-free threshold search)
    # Each (value, index) pair as a bfloat16 value and a uint16 index, 4 bytes instead of 8 (in vectors over
    # 65,536 entries the index is an offset in its 65,536-entry block, with an int32 count of pairs per block).
    # hitopk, topk: the rounding stays in the residual; gtopk: only its merge rounds' pairs are compact, the
    # sums at the winners stay float32.
    compact_pairs=False,
    min_compress_elements=512,  # smaller buckets / shards go to the strategy's dense fallback
    density_warmup_epochs=0.0,  # >0: DGC-style warm-up from density 0.25 down to `density`
    # >0: the last final_density_epochs epochs send at final_density instead of `density`. Measured on
    # :large_batch_hitopk, moving 0.1% between the middle and the end gains nothing (docs/techniques.md section 11)
    final_density_epochs=0.0,
    final_density=0.01,
    # How the top-k budget (density x the compressed entries) is shared between buckets: "proportional" (k =
    # density x size each) or "sqrt" (k in proportion to sqrt(size), the same total: small tensors get more
    # than their share, large ones less; light_jax/parallel/reducer.py, GradientReducer.with_sqrt_allocation).
    # A bucket whose share would exceed its size sends whole, and the excess is not passed on: near density 1
    # the total falls short (at the density warm-up's 0.25, by under 1% for resnet8_fast).
    k_allocation="proportional",
    # DGC's accuracy compensation (docs/techniques.md section 11): momentum correction moves
    # optimizer.momentum into the reducer (a velocity per device, masked where entries were sent; the
    # optimizer then runs without momentum); local_clip_norm > 0 clips what each device hands the reducer (its
    # gradient, with SGD's weight decay wd w added under momentum correction) to local_clip_norm / sqrt(devices)
    # before compression. With LARS, momentum correction needs local_trust_ratio (refused without: the trust
    # ratio and weight decay would act after the reduction, on the mean velocity, undoing the momentum; at 0.1%
    # that diverged, docs/measurements.md); local_clip_norm is refused with local_trust_ratio (it would clip
    # LARS's scaled update).
    momentum_correction=False,
    # DGC's momentum factor masking: the velocity is zeroed where entries were sent. False zeroes only the
    # accumulated step, so the velocity stays the device's momentum SGD's (light_jax/parallel/compression.py).
    momentum_masking=True,
    # With momentum correction, SGD's weight decay wd w enters each device's velocity before compression
    # (True, DGC's) or runs after the reduction with a momentum of its own (False): the weights are
    # replicated, so wd w needs no communication, reaches every entry each step, and takes no top-k slots.
    decay_in_velocity=True,
    local_clip_norm=0.0,
    # What the top-k strategies keep of what they did not send: "residual" (error feedback: the unsent part,
    # sent later) or "ef21" (hitopk, topk; EF21 with momentum, Fatkhullin et al. 2023: each device sends top-k
    # of the change of its momentum step since its peers' estimate of it, and every step applies the sum of
    # those estimates whole, so every entry moves every step. Needs momentum_correction=True and
    # momentum_masking=False; light_jax/parallel/compression.py, select_change). 3 points worse at 0.1% on
    # :large_batch_hitopk: at that density the estimates go stale (docs/techniques.md section 11).
    feedback="residual",
    # What the error-feedback residuals hold: "gradient" (DGC's: summed gradients, applied at the learning
    # rate of the step that sends them) or "update" (Stich et al. 2018: each step's gradient weighted by
    # its own learning rate, so an entry sent late is not shrunk by a decayed schedule; 2 points worse on
    # :large_batch_hitopk, docs/measurements.md).
    residual_units="gradient",
    # LARS's weight decay and trust ratio on each device's gradient before the reduction, the optimizer
    # keeping the learning rate and momentum: top-k then sends pieces of the scaled update (error feedback
    # conserves it) instead of LARS rescaling the few sent entries to a whole layer's step.
    local_trust_ratio=False,
    rank=4,  # powersgd: columns of P and Q (error_feedback, min_compress_elements, dtype, local_clip_norm apply too)
    # diloco: each machine takes sync_every steps on its own (gradients averaged inside it), then an outer
    # step, SGD with Nesterov momentum, applies the machines' mean change to the shared parameters.
    sync_every=8,
    outer_lr=0.7,
    outer_momentum=0.9,
  )

  config.log_every_steps = 20
  # Asynchronous orbax checkpoints in WORKDIR/checkpoints; a workdir with one resumes from it.
  config.checkpoint = dict(every_steps=200, keep=3)
  config.train = dict(
    on_nonfinite="skip",  # skip: drop the update and go on; stop: save a checkpoint and stop
    inject_nan_at_step=-1,  # fault drill: poison this step's loss (-1: off)
    inject_hang_at_step=-1,  # fault drill: process 0 stops stepping once this many steps are done (-1: off)
    # True: wait for every step and append its seconds and the bytes this machine sent (its input, dispatch and
    # computation: the evaluation and save after it left out) to WORKDIR/step_times.jsonl (steps then do not
    # overlap; for the mesh lab, benchmarks/mesh_lab.py).
    time_steps=False,
    # "A:B" (1 <= A < B): a jax.profiler trace of the steps after step A up to step B, in WORKDIR/profile (TensorBoard's
    # profile plugin or Perfetto read it; README "Reading a profile"). "" = none.
    profile_steps="",
  )
  return config


# What VALUE sets in a strategy label "NAME@VALUE" (the top-k strategies and auto: comm.density).
STRATEGY_PARAMETER = {"powersgd": ("rank", int), "diloco": ("sync_every", int)}
_EXAMPLE_VALUE = {"powersgd": 4, "diloco": 8}


def strategy_fields(label: str) -> dict[str, Any]:
  """The ``comm`` fields a strategy label "NAME[@VALUE][/OPTION...]" stands for, as benchmarks and scripts take
  them: "hitopk@0.001" -> strategy and density, "powersgd@4" -> rank 4, "diloco@8" -> sync_every 8; options
  "/bfloat16" -> the wire dtype (comm.dtype), "/compact" -> comm.compact_pairs: "hitopk@0.01/bfloat16/compact"."""
  from light_jax.parallel.reducer import STRATEGIES

  spec, *options = label.split("/")
  name, at, value = spec.partition("@")
  _choice(f"strategy {label!r}: comm.strategy", name, STRATEGIES)  # before any run that would take it
  fields: dict[str, Any] = {"strategy": name}
  takes_value = name in STRATEGY_PARAMETER or is_top_k(name) or name == "auto"
  if at and not takes_value:  # it was accepted, and did nothing
    raise ConfigError(f"strategy {label!r}: {name} takes no @VALUE (the top-k strategies and auto take a density, "
                      "powersgd a rank, diloco its steps between syncs)")  # fmt: skip
  if at and not value:
    raise ConfigError(f"strategy {label!r}: nothing after @; give a value ({name}@{_EXAMPLE_VALUE.get(name, 0.01)}), "
                      "or drop the @ for the config's")  # fmt: skip
  if value:
    field, kind = STRATEGY_PARAMETER.get(name, ("density", float))
    try:
      fields[field] = kind(value)
    except ValueError:
      raise ConfigError(f"strategy {label!r}: {value!r} is not a valid comm.{field} ({kind.__name__})") from None
    if field == "density":
      _density(f"strategy {label!r}: comm.density", fields[field])
    else:
      _positive(f"strategy {label!r}: comm.{field}", fields[field])
  for option in options:
    if option in DTYPES:
      fields["dtype"] = option
    elif option == "compact":
      fields["compact_pairs"] = True
    else:
      raise ConfigError(
        f"strategy {label!r}: /{option} is neither a wire dtype ({', '.join(DTYPES)}) nor /compact (compact pairs)."
      )
  return fields


def apply_variant(
  config: ml_collections.ConfigDict,
  variant: str | None,
  variants: dict[str, Callable[[ml_collections.ConfigDict], None]],
  filename: str,
) -> ml_collections.ConfigDict:
  """Applies ``variants[variant]`` (a function that edits the config in place); None: no variant."""
  if variant:
    if variant not in variants:
      raise ValueError(f"unknown variant {variant!r} of {filename}; known: {', '.join(variants)}")
    variants[variant](config)
  return config


class ConfigError(ValueError):
  """The config cannot run; the message says which field to change and how."""


# model.width's largest: 16x resnet50's 64 channels in the first stage (about 256x its 25.6M parameters).
MAX_WIDTH = 1024


def check_fields(config: ml_collections.ConfigDict) -> None:
  """The config has ``base_config()``'s fields, no fewer and no others: a config file that misspells a field
  (``c.global_batch_sizee = 3``) would otherwise run with the default, and one built without base_config, or
  another kind of file's (a mesh experiment, a search space), would fail deep inside the run."""
  import difflib

  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(
      f"the config file's get_config() returned a {type(config).__name__}, not a training config; a training "
      "config file returns base_config() from light_jax/config.py with its changes (configs/fashion_mnist.py)."
    )

  def paths(tree, prefix=""):
    for key, value in tree.items():
      path = f"{prefix}{key}"
      yield path
      if isinstance(value, ml_collections.ConfigDict):
        yield from paths(value, f"{path}.")

  known, given = set(paths(base_config())), set(paths(config))
  unknown, missing = sorted(given - known), sorted(known - given)
  listed = lambda names: ", ".join(names[:5]) + (" ..." if names[5:] else "")  # noqa: E731
  if missing:  # not built from base_config: another kind of config file, most likely
    raise ConfigError(
      f"the config has no field {listed(missing)}"
      + (f", and fields a training config does not have ({listed(unknown)})" if unknown else "")
      + ": a training config file starts from base_config() in light_jax/config.py and changes what differs "
      "(configs/fashion_mnist.py)."
    )
  if unknown:
    close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
    hint = f'; did you mean "{close[0]}"?' if close else "."
    raise ConfigError(
      f"{unknown[0]} is not a config field{hint} base_config() in light_jax/config.py lists the fields"
      + (f" (also not fields: {', '.join(unknown[1:])})." if unknown[1:] else ".")
    )


def _choice(name: str, value, allowed) -> None:
  if value not in allowed:
    raise ConfigError(f"{name}={value!r} is unknown; use one of {list(allowed)}.")


MAX_EPOCHS = 10**6


def _positive(name: str, value, allow_zero: bool = False) -> None:
  # NaN passes both comparisons: a NaN learning rate trained a run of NaN weights to the end, exit 0.
  finite = isinstance(value, (int, float)) and math.isfinite(value)
  if not finite or value < 0 or (value == 0 and not allow_zero):
    raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}{'' if finite else ' and finite'}.")


def _density(name: str, value) -> None:
  if not 0.0 < value <= 1.0:
    raise ConfigError(f"{name}={value!r} must be in (0, 1] (the fraction top-k keeps).")


def is_top_k(strategy: str) -> bool:
  """Whether ``strategy`` is one of the top-k strategies (hitopk, topk, gtopk): one that selects entries."""
  from light_jax.parallel import strategies

  return strategy in strategies.NAMES and strategies.get(strategy).compressed


def check_k_allocation(config: ml_collections.ConfigDict) -> None:
  """comm.k_allocation is a known share and, for "sqrt", the strategy has a top-k budget to share."""
  _choice("comm.k_allocation", config.comm.k_allocation, K_ALLOCATIONS)
  top_k = is_top_k(config.comm.strategy)
  if config.comm.k_allocation == "sqrt" and not top_k:
    why = (
      "chooses each bucket's strategy from costs computed with the proportional k"
      if config.comm.strategy == "auto"
      else "compresses nothing"
    )
    raise ConfigError(
      f"comm.k_allocation='sqrt' shares the top-k strategies' budget between buckets; comm.strategy="
      f"{config.comm.strategy!r} {why}. Use hitopk, topk or gtopk, or set comm.k_allocation=proportional."
    )


def validate(config: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1) -> tuple[int, int]:
  """Checks ``config`` against itself and the devices; returns the resolved (nodes, local) mesh shape.

  Raises:
    ConfigError: with a message that says what to change.
  """
  # Imported here, not at the top: config files import this module (for base_config) while train.py
  # parses its flags, before it has set up JAX's devices; this module itself stays free of JAX.
  from light_jax import optim, schedules
  from light_jax.models import ARCHITECTURES
  from light_jax.parallel import compression, cost_model, diloco, strategies
  from light_jax.parallel import mesh as mesh_lib
  from light_jax.parallel import sharded_update as sharded_lib
  from light_jax.parallel.reducer import (
    AUTO,
    DILOCO,
    EF21_STRATEGIES,
    FEEDBACKS,
    FUSIONS,
    POWERSGD,
    STRATEGIES,
    may_select_top_k,
    takes_compact_pairs,
  )

  check_fields(config)
  _choice("comm.strategy", config.comm.strategy, STRATEGIES)
  _choice("comm.fusion", config.comm.fusion, FUSIONS)
  if config.comm.fusion == "adaptive" or config.comm.strategy == AUTO:
    try:
      cost_model.load(config.comm.cost_model)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  # The fields of another strategy, dataset or schedule are range-checked too: a mistake there is one when it is
  # used later (they were accepted and ignored without a word).
  _positive("comm.device_tflops", config.comm.device_tflops)
  _positive("comm.bucket_bytes", config.comm.bucket_bytes, allow_zero=True)
  _choice("comm.topk_selector", config.comm.topk_selector, tuple(compression.SELECTORS))
  _choice("comm.dtype", config.comm.dtype, DTYPES)
  _positive("comm.local_clip_norm", config.comm.local_clip_norm, allow_zero=True)
  top_k = is_top_k(config.comm.strategy)
  if config.comm.momentum_correction and not top_k:
    raise ConfigError(
      f"comm.momentum_correction masks the velocity where top-k sent entries; comm.strategy="
      f"{config.comm.strategy!r} is not a top-k strategy. Use hitopk, topk or gtopk, or turn it off."
    )
  if config.comm.compact_pairs and not takes_compact_pairs(config.comm.strategy):
    raise ConfigError(
      f"comm.compact_pairs narrows the (value, index) pairs of the top-k strategies; comm.strategy="
      f"{config.comm.strategy!r} sends none it can narrow. Use hitopk, topk, gtopk or auto (whose top-k "
      "buckets then send them), or set comm.compact_pairs=False."
    )
  # auto may compress some buckets, but these compensations are measured and tested with single strategies only.
  not_for = "chooses per bucket whether to compress, untried with it" if config.comm.strategy == AUTO else None
  if config.comm.local_clip_norm > 0 and not (top_k or config.comm.strategy == POWERSGD):
    raise ConfigError(
      f"comm.local_clip_norm compensates gradient compression; comm.strategy={config.comm.strategy!r} "
      f"{not_for or 'does not compress'}. Use a top-k strategy (hitopk, topk, gtopk) or powersgd, or set "
      "comm.local_clip_norm=0."
    )
  _choice("comm.residual_units", config.comm.residual_units, RESIDUAL_UNITS)
  check_k_allocation(config)
  if config.comm.residual_units == "update" and not (top_k and config.comm.error_feedback):
    raise ConfigError(
      f"comm.residual_units='update' rescales the top-k strategies' error-feedback residuals; comm.strategy="
      f"{config.comm.strategy!r} with comm.error_feedback={config.comm.error_feedback} "
      f"{not_for or 'keeps none'}. Use hitopk, topk or gtopk with error feedback, or set "
      "comm.residual_units=gradient."
    )
  _positive("comm.rank", config.comm.rank)
  _positive("comm.sync_every", config.comm.sync_every)
  _positive("comm.outer_lr", config.comm.outer_lr)
  if not 0.0 <= config.comm.outer_momentum < 1.0:
    raise ConfigError(f"comm.outer_momentum={config.comm.outer_momentum!r} must be in [0, 1).")
  if config.comm.strategy in (POWERSGD, DILOCO) and config.comm.fusion == "adaptive":
    raise ConfigError(
      f"comm.strategy={config.comm.strategy!r} packs what it sends into one all-reduce per kind; "
      "comm.fusion='adaptive' does not apply. Set comm.fusion=fixed."
    )
  if config.comm.momentum_correction and not config.comm.error_feedback:
    raise ConfigError(
      "comm.momentum_correction accumulates what top-k did not send (it is error feedback with momentum); "
      "set comm.error_feedback=True."
    )
  if not config.comm.momentum_masking and not config.comm.momentum_correction:
    raise ConfigError(
      "comm.momentum_masking=False changes how momentum correction treats the velocity of sent entries; "
      "comm.momentum_correction is off. Set comm.momentum_correction=True, or leave comm.momentum_masking."
    )
  if not config.comm.decay_in_velocity and not (
    config.comm.momentum_correction and config.optimizer.name == "sgd" and not config.optimizer.sharded_update
  ):
    raise ConfigError(
      "comm.decay_in_velocity=False moves SGD's weight decay out of momentum correction's velocity; it needs "
      "comm.momentum_correction=True, optimizer.name=sgd and optimizer.sharded_update=False (got "
      f"{config.comm.momentum_correction}, {config.optimizer.name!r}, {config.optimizer.sharded_update}). "
      "Change those, or leave comm.decay_in_velocity=True."
    )
  _choice("comm.feedback", config.comm.feedback, FEEDBACKS)
  if config.comm.feedback == "ef21":
    comm = config.comm
    needs = [  # (field, its value, whether it fits, what it needs)
      ("comm.strategy", comm.strategy, comm.strategy in EF21_STRATEGIES, " or ".join(EF21_STRATEGIES)),
      ("comm.momentum_correction", comm.momentum_correction, comm.momentum_correction, "True: EF21 estimates its step"),
      ("optimizer.momentum", config.optimizer.momentum, config.optimizer.momentum > 0, "> 0: the step's momentum"),
      ("comm.momentum_masking", comm.momentum_masking, not comm.momentum_masking, "False: nothing is owed"),
      ("comm.residual_units", comm.residual_units, comm.residual_units == "gradient", "gradient: there is no residual"),
    ]
    wrong = [f"{field}={value!r} (needs {want})" for field, value, ok, want in needs if not ok]
    if wrong:
      raise ConfigError(
        "comm.feedback='ef21' sends top-k of the change of each device's momentum step and applies every "
        f"estimate each step; change {'; '.join(wrong)}, or set comm.feedback=residual."
      )
  if config.comm.momentum_correction and config.optimizer.momentum_schedule != "constant":
    raise ConfigError(
      "comm.momentum_correction keeps a constant optimizer.momentum in the reducer; set "
      "optimizer.momentum_schedule=constant."
    )
  if config.comm.momentum_correction and config.optimizer.name == "lamb":
    raise ConfigError("comm.momentum_correction moves SGD/LARS momentum into the reducer; LAMB has none to move.")
  if config.comm.momentum_correction and config.optimizer.name == "lars" and not config.comm.local_trust_ratio:
    raise ConfigError(
      "comm.momentum_correction with optimizer.name=lars needs comm.local_trust_ratio=True: without it LARS's trust "
      "ratio rescales the reducer's velocity after the reduction, which undoes the momentum (at density 1, steps "
      "1 - momentum times LARS's; at 0.1% it diverged, docs/measurements.md). Set comm.local_trust_ratio=True, or "
      "comm.momentum_correction=False."
    )
  if config.comm.local_trust_ratio and config.optimizer.name != "lars":
    raise ConfigError(
      f"comm.local_trust_ratio moves LARS's trust ratio before the reduction; optimizer.name="
      f"{config.optimizer.name!r} has none. Set optimizer.name=lars, or comm.local_trust_ratio=False."
    )
  if config.comm.local_trust_ratio and config.comm.local_clip_norm > 0:
    raise ConfigError(
      "comm.local_clip_norm clips what each device hands the reducer, which comm.local_trust_ratio makes LARS's "
      "scaled update: a gradient's threshold there would cut every layer's step by the largest one's (a bias's). "
      "Set comm.local_clip_norm=0, or comm.local_trust_ratio=False."
    )
  if config.comm.local_trust_ratio and config.comm.strategy == DILOCO:
    raise ConfigError(
      "comm.local_trust_ratio runs LARS's trust ratio on each device before the gradient reduction; "
      "comm.strategy=diloco applies the optimizer its own way, inside each machine. Turn one off."
    )
  _positive("comm.min_compress_elements", config.comm.min_compress_elements, allow_zero=True)
  _positive("comm.density_warmup_epochs", config.comm.density_warmup_epochs, allow_zero=True)
  if config.comm.density_warmup_epochs > 0 and not may_select_top_k(config.comm.strategy):
    raise ConfigError(
      f"comm.density_warmup_epochs warms up the top-k density of the first epochs; comm.strategy="
      f"{config.comm.strategy!r} selects no entries. Use hitopk, topk, gtopk or auto, or set it to 0."
    )
  _positive("comm.final_density_epochs", config.comm.final_density_epochs, allow_zero=True)
  _density("comm.final_density", config.comm.final_density)
  if config.comm.final_density_epochs > 0:
    if not may_select_top_k(config.comm.strategy):
      raise ConfigError(
        f"comm.final_density_epochs changes the top-k density of the last epochs; comm.strategy="
        f"{config.comm.strategy!r} selects no entries. Use hitopk, topk, gtopk or auto, or set it to 0."
      )
    if config.comm.final_density_epochs + config.comm.density_warmup_epochs > config.num_epochs:
      raise ConfigError(
        f"comm.final_density_epochs={config.comm.final_density_epochs} and comm.density_warmup_epochs="
        f"{config.comm.density_warmup_epochs} overlap in a run of num_epochs={config.num_epochs}: the final phase "
        "would cut the warm-up short. Shorten one of them."
      )
  _density("comm.density", config.comm.density)
  _choice("optimizer.name", config.optimizer.name, OPTIMIZERS)
  _choice("optimizer.decay", config.optimizer.decay, DECAYS)
  _choice("optimizer.lars_trust", config.optimizer.lars_trust, optim.LARS_TRUST)
  if config.optimizer.sharded_update:
    why = "optimizer.sharded_update updates the shards that the reduce-scatter over `local` leaves; it needs"
    if config.comm.strategy not in sharded_lib.STRATEGIES:
      raise ConfigError(f"{why} comm.strategy in {sharded_lib.STRATEGIES}, not {config.comm.strategy!r}.")
    if cost_model.replans_buckets_per_phase(config.comm):
      # A dense strategy's adaptive buckets are planned again for each phase, and the shards the optimizer state is
      # laid out in with them; hitopk's are planned once, before the run.
      raise ConfigError(
        f"{why} comm.fusion 'fixed' or 'none' with comm.strategy='hierarchical', not 'adaptive': its buckets, and "
        "the shards with them, are planned again for each phase of the run (hitopk's are planned once, so "
        "comm.strategy=hitopk takes comm.fusion=adaptive)."
      )
    if config.optimizer.name not in sharded_lib.OPTIMIZERS:
      raise ConfigError(f"optimizer.sharded_update supports {sharded_lib.OPTIMIZERS}, not {config.optimizer.name!r}.")
    if config.optimizer.fused_norms:  # it did nothing, silently
      raise ConfigError(
        "optimizer.fused_norms packs whole tensors to compute LARS's norms; optimizer.sharded_update computes "
        "them from each device's shards its own way. Set optimizer.fused_norms=False."
      )
  if config.optimizer.lars_trust != "optax" and config.optimizer.name != "lars":  # it did nothing, silently
    raise ConfigError(
      f"optimizer.lars_trust={config.optimizer.lars_trust!r} chooses LARS's trust ratio; optimizer.name="
      f"{config.optimizer.name!r} has none (LAMB's is its own). Set optimizer.name='lars', or leave lars_trust out."
    )
  if config.optimizer.fused_norms and config.optimizer.name != "lars":
    raise ConfigError(
      f"optimizer.fused_norms computes LARS's trust ratios; optimizer.name={config.optimizer.name!r} has none "
      "(LAMB's are optax's own). Set optimizer.fused_norms=False."
    )
  _choice("optimizer.momentum_schedule", config.optimizer.momentum_schedule, MOMENTUM_SCHEDULES)
  if not 0.0 <= config.optimizer.min_momentum < 1.0:
    raise ConfigError(f"optimizer.min_momentum={config.optimizer.min_momentum!r} must be in [0, 1).")
  if config.optimizer.momentum_schedule != "constant":
    if config.optimizer.name == "lamb":
      raise ConfigError("optimizer.momentum_schedule applies to sgd and lars; LAMB's moments are not scheduled.")
    if not 0.0 <= config.optimizer.min_momentum <= config.optimizer.momentum:
      raise ConfigError(
        f"optimizer.min_momentum={config.optimizer.min_momentum!r} must be in [0, optimizer.momentum="
        f"{config.optimizer.momentum}]."
      )
  _choice("model.name", config.model.name, tuple(sorted(ARCHITECTURES)))
  _choice("model.dtype", config.model.dtype, MODEL_DTYPES)
  _choice("model.loss_scale", config.model.loss_scale, LOSS_SCALES)
  _positive("model.loss_scale_period", config.model.loss_scale_period)
  if config.model.loss_scale_period >= 2**31:  # jmp keeps its counter in an int32: an OverflowError in the step
    raise ConfigError(f"model.loss_scale_period={config.model.loss_scale_period} must be below 2**31 (jmp's int32).")
  if loss_scaling(config) and config.train.on_nonfinite == "stop":
    raise ConfigError(
      "dynamic loss scaling skips the steps whose gradient overflows, by design; train.on_nonfinite='stop' "
      "would stop at the first. Set --config.train.on_nonfinite=skip (or model.loss_scale=none)."
    )
  _choice("data.dataset", config.data.dataset, DATASETS)
  _positive("data.read_threads", config.data.read_threads)
  _positive("data.prefetch", config.data.prefetch)
  _positive("data.cache_budget_gb", config.data.cache_budget_gb, allow_zero=True)  # NaN never skipped the cache
  for field in ("num_workers", "host_prefetch"):
    value = config.data[field]
    if not isinstance(value, int) or value < -1 or (field == "host_prefetch" and value == 0):
      raise ConfigError(
        f"data.{field}={value!r} must be -1 (measure at start-up) or {'>= 0' if field == 'num_workers' else '>= 1'}."
      )
  jpeg = config.data.dataset != "fashion_mnist"  # Fashion-MNIST: arrays of one size (data.image_size unused)
  _choice("data.cache", config.data.cache, CACHES)  # a misspelling is no cache on arrays, unnoticed till JPEGs
  _positive("data.image_size", config.data.image_size, allow_zero=not jpeg)
  if not 0.0 < config.data.random_scale_min <= 1.0:
    raise ConfigError(f"data.random_scale_min={config.data.random_scale_min!r} must be in (0, 1].")
  _positive("data.cache_size", config.data.cache_size)
  try:
    phases = schedules.parse_resolution_schedule(
      config.data.resolution_schedule, config.data.image_size if jpeg else None
    )
  except schedules.ScheduleError as e:
    raise ConfigError(str(e)) from None
  phase_batches = {p.global_batch_size for p in phases if p.global_batch_size}
  if jpeg:
    largest = max(p.image_size for p in phases)
    if config.data.cache != "none" and config.data.cache_size < largest:
      raise ConfigError(
        f"data.cache_size={config.data.cache_size} is smaller than the largest training size ({largest} px): "
        f"every crop of the cached images would be scaled up, losing detail. Set data.cache_size >= {largest} "
        f"(larger keeps more: crops drawn on a cache of {largest} px are mostly enlarged too)."
      )
  _positive("data.crop_padding", config.data.crop_padding, allow_zero=True)
  if jpeg and config.data.crop_padding:
    raise ConfigError(
      f"data.crop_padding={config.data.crop_padding} pads the images of array datasets (Fashion-MNIST) before a "
      f"random crop; data.dataset={config.data.dataset!r} crops its JPEGs with Inception-style random crops "
      "(data.random_scale_min). Set data.crop_padding=0."
    )
  _positive("data.train_subset", config.data.train_subset, allow_zero=True)
  _positive("data.eval_subset", config.data.eval_subset, allow_zero=True)
  _positive("model.width", config.model.width, allow_zero=True)
  if config.model.width > MAX_WIDTH:  # 100,000: 3e12 parameters, whose first step never ended (nor took a signal)
    raise ConfigError(
      f"model.width={config.model.width}: at most {MAX_WIDTH} channels in the first stage (16x resnet50's 64; every "
      "stage's width scales with it, the parameters with its square), or 0 for the architecture's own."
    )
  if not isinstance(config.seed, int) or not 0 <= config.seed < 2**32:
    raise ConfigError(f"seed={config.seed!r} must be an integer in [0, 2**32).")
  _positive("optimizer.base_lr", config.optimizer.base_lr)
  _positive("optimizer.weight_decay", config.optimizer.weight_decay, allow_zero=True)
  if config.optimizer.weight_decay >= 1:  # w shrinks by lr x wd a step: typical values are 1e-5 to 0.1
    raise ConfigError(
      f"optimizer.weight_decay={config.optimizer.weight_decay} must be below 1 (typical: 1e-5 to 0.1; the default "
      "5e-4)."
    )
  _positive("optimizer.warmup_epochs", config.optimizer.warmup_epochs, allow_zero=True)
  _positive("optimizer.lars_eta", config.optimizer.lars_eta)
  if not 0.0 <= config.optimizer.momentum < 1.0:
    raise ConfigError(f"optimizer.momentum={config.optimizer.momentum!r} must be in [0, 1).")
  if not 0.0 <= config.optimizer.end_lr_factor <= 1.0:
    raise ConfigError(
      f"optimizer.end_lr_factor={config.optimizer.end_lr_factor!r} must be in [0, 1] (the final lr as a fraction "
      "of the peak)."
    )
  if not 0.0 <= config.optimizer.label_smoothing < 1.0:
    raise ConfigError(f"optimizer.label_smoothing={config.optimizer.label_smoothing!r} must be in [0, 1).")
  _choice("train.on_nonfinite", config.train.on_nonfinite, ("skip", "stop"))
  _positive("checkpoint.every_steps", config.checkpoint.every_steps, allow_zero=True)
  _positive("checkpoint.keep", config.checkpoint.keep)
  _positive("log_every_steps", config.log_every_steps)
  _positive("num_epochs", config.num_epochs)
  if config.num_epochs > MAX_EPOCHS:  # the plan holds a few numbers per epoch: 10**9 filled the memory, silently
    raise ConfigError(
      f"num_epochs={config.num_epochs!r} is over {MAX_EPOCHS:,}; give the epochs the run should train (max_steps "
      "stops it earlier)."
    )
  _positive("max_steps", config.max_steps, allow_zero=True)

  try:
    nodes, local = mesh_lib.resolve_mesh_shape(config.mesh.nodes, config.mesh.local, num_devices, num_processes)
  except mesh_lib.MeshError as e:
    wanted = config.mesh.nodes * config.mesh.local  # more devices than there are: maybe too few simulated
    hint = ""
    if wanted > num_devices and config.mesh.cpu_devices < wanted:
      hint = f" On the CPU, mesh.cpu_devices={config.mesh.cpu_devices} sets how many devices are simulated."
    raise ConfigError(f"{e}{hint}") from None
  # auto starts from hierarchical; powersgd sums its P and Q with it.
  error = strategies.device_count_error(
    config.comm.strategy if config.comm.strategy in strategies.NAMES else "hierarchical", nodes, local
  )
  if config.comm.strategy == DILOCO:
    error = error or diloco.mesh_error(nodes, local)
  if error:
    raise ConfigError(error)

  if config.train.profile_steps:
    parse_profile_steps(config.train.profile_steps)
  # Drills: the NaN poisons step N (counted from 0); the hang comes after N steps are done (so N >= 1).
  for field, lowest in (("inject_nan_at_step", 0), ("inject_hang_at_step", 1)):
    value = config.train[field]
    if type(value) is not int or (value != -1 and value < lowest):  # (a bool is an int to isinstance)
      raise ConfigError(f"train.{field}={value!r} must be -1 (off) or an integer >= {lowest}.")
  if config.train.inject_hang_at_step != -1 and num_processes == 1:
    # Only the other processes' watchdog (--step_timeout) ends a hang; one process alone would hang for good.
    raise ConfigError(
      "train.inject_hang_at_step is a drill for multi-process runs (the other processes detect the hang); "
      "with one process nothing would end it. Run several processes (--num_processes), or set it to -1."
    )
  _positive("global_batch_size", config.global_batch_size)
  _positive("data.eval_batch_size", config.data.eval_batch_size)
  train_batches = {
    f"global_batch_size={config.global_batch_size}": config.global_batch_size,
    **{f"the batch {b} in data.resolution_schedule": b for b in sorted(phase_batches)},
  }
  batch_sizes = {**train_batches, f"data.eval_batch_size={config.data.eval_batch_size}": config.data.eval_batch_size}
  for field, value in batch_sizes.items():
    if value % num_devices:
      lower = value // num_devices * num_devices
      nearest = f"{lower} or {lower + num_devices}" if lower else f"{num_devices}"  # not "8 or 8"
      raise ConfigError(
        f"{field} does not divide over {num_devices} devices; use a multiple of {num_devices} (e.g. {nearest})."
      )
  if not isinstance(config.micro_batches, int) or config.micro_batches < 1:
    raise ConfigError(f"micro_batches={config.micro_batches!r} must be an integer >= 1.")
  for field, value in train_batches.items():  # gradient accumulation slices each device's share of a step
    per_device = value // num_devices
    if per_device % config.micro_batches:
      raise ConfigError(
        f"{field} gives {per_device} examples per device, which do not split into micro_batches="
        f"{config.micro_batches} equal slices; use a micro_batches that divides {per_device}."
      )
  return nodes, local


def loss_scaling(config: ml_collections.ConfigDict) -> bool:
  """Whether the run scales its loss dynamically (model.loss_scale, "auto": for float16 compute)."""
  return config.model.loss_scale == "dynamic" or (config.model.loss_scale == "auto" and config.model.dtype == "float16")


INITIAL_LOSS_SCALE = 2.0**15


def parse_profile_steps(text: str) -> tuple[int, int]:
  """ "10:15" -> (10, 15): trace the steps after step 10 up to step 15."""
  try:
    first, last = (int(x) for x in text.split(":"))
  except ValueError:
    first = last = -1
  if not 1 <= first < last:  # the trace starts once step A is done: A = 0 would be before the loop
    raise ConfigError(
      f"train.profile_steps={text!r} is not 'A:B' with 1 <= A < B (trace the steps after step A up to step B), "
      f"e.g. '10:15'"
    )
  return first, last
