"""Validation of a resolved config, before anything heavy starts.

Every mistake a user can make in a config file or a ``--config.FIELD=VALUE`` override should end here
as one ``ConfigError`` that names the field, the bad value and what to change.
"""

from __future__ import annotations

import ml_collections

from light_jax.models import ARCHITECTURES
from light_jax.parallel import collectives, compression, cost_model
from light_jax.parallel import mesh as mesh_lib

STRATEGIES = collectives.STRATEGIES
SELECTORS = tuple(compression.SELECTORS)
OPTIMIZERS = ("sgd", "lars", "lamb")
FUSIONS = collectives.FUSIONS
DECAYS = ("poly", "cosine")
DTYPES = ("float32", "bfloat16")
DATASETS = ("fashion_mnist", "imagenet2012", "image_folder")
CACHES = ("none", "disk", "memory")


class ConfigError(ValueError):
  """The config cannot run; the message says which field to change and how."""


def _choice(name: str, value, allowed) -> None:
  if value not in allowed:
    raise ConfigError(f"{name}={value!r} is unknown; use one of {list(allowed)}.")


def _positive(name: str, value, allow_zero: bool = False) -> None:
  if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
    raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}.")


def validate(config: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1) -> tuple[int, int]:
  """Checks ``config`` against itself and the devices; returns the resolved (nodes, local) mesh shape.

  Raises:
    ConfigError: with a message that says what to change.
  """
  _choice("comm.strategy", config.comm.strategy, STRATEGIES)
  _choice("comm.fusion", config.comm.fusion, FUSIONS)
  if config.comm.fusion == "adaptive":
    try:
      cost_model.load(config.comm.cost_model)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    _positive("comm.device_tflops", config.comm.device_tflops)
  _positive("comm.bucket_bytes", config.comm.bucket_bytes, allow_zero=True)
  _choice("comm.topk_selector", config.comm.topk_selector, SELECTORS)
  _choice("comm.dtype", config.comm.dtype, DTYPES)
  _positive("comm.min_compress_elements", config.comm.min_compress_elements, allow_zero=True)
  _positive("comm.density_warmup_epochs", config.comm.density_warmup_epochs, allow_zero=True)
  if not 0.0 < config.comm.density <= 1.0:
    raise ConfigError(f"comm.density={config.comm.density!r} must be in (0, 1] (the fraction top-k keeps).")
  _choice("optimizer.name", config.optimizer.name, OPTIMIZERS)
  _choice("optimizer.decay", config.optimizer.decay, DECAYS)
  _choice("model.name", config.model.name, tuple(sorted(ARCHITECTURES)))
  _choice("model.dtype", config.model.dtype, DTYPES)
  _choice("data.dataset", config.data.dataset, DATASETS)
  _positive("data.read_threads", config.data.read_threads)
  _positive("data.prefetch", config.data.prefetch)
  for field in ("num_workers", "host_prefetch"):
    value = config.data[field]
    if not isinstance(value, int) or value < -1 or (field == "host_prefetch" and value == 0):
      raise ConfigError(f"data.{field}={value!r} must be -1 (measure at start-up) or "
                        f"{'>= 0' if field == 'num_workers' else '>= 1'}.")
  if config.data.dataset != "fashion_mnist":
    _choice("data.cache", config.data.cache, CACHES)
    _positive("data.image_size", config.data.image_size)
    if not 0.0 < config.data.random_scale_min <= 1.0:
      raise ConfigError(f"data.random_scale_min={config.data.random_scale_min!r} must be in (0, 1].")
    from light_jax import data as data_lib   # here: the data package imports grain and Pillow
    try:
      phases = data_lib.parse_resolution_schedule(config.data.resolution_schedule, config.data.image_size)
    except data_lib.DataError as e:
      raise ConfigError(str(e)) from None
    phase_batches = {p.global_batch_size for p in phases if p.global_batch_size}
  else:
    phase_batches = set()
  _positive("optimizer.base_lr", config.optimizer.base_lr)
  _positive("optimizer.weight_decay", config.optimizer.weight_decay, allow_zero=True)
  _positive("optimizer.warmup_epochs", config.optimizer.warmup_epochs, allow_zero=True)
  if not 0.0 <= config.optimizer.label_smoothing < 1.0:
    raise ConfigError(f"optimizer.label_smoothing={config.optimizer.label_smoothing!r} must be in [0, 1).")
  _choice("train.on_nonfinite", config.train.on_nonfinite, ("skip", "stop"))
  _positive("checkpoint.every_steps", config.checkpoint.every_steps, allow_zero=True)
  _positive("checkpoint.keep", config.checkpoint.keep)
  _positive("num_epochs", config.num_epochs)
  _positive("max_steps", config.max_steps, allow_zero=True)

  try:
    nodes, local = mesh_lib.resolve_mesh_shape(config.mesh.nodes, config.mesh.local, num_devices, num_processes)
  except mesh_lib.MeshError as e:
    raise ConfigError(str(e)) from None
  devices = nodes * local
  if config.comm.strategy == "gtopk" and devices & (devices - 1):
    raise ConfigError(f"comm.strategy='gtopk' merges by recursive doubling and needs a power-of-two device "
                      f"count, not {nodes} x {local} = {devices}; use 'hitopk' or 'topk', or a mesh of "
                      f"{1 << (devices.bit_length() - 1)} devices.")

  _positive("global_batch_size", config.global_batch_size)
  _positive("data.eval_batch_size", config.data.eval_batch_size)
  batch_sizes = {f"global_batch_size={config.global_batch_size}": config.global_batch_size,
                 f"data.eval_batch_size={config.data.eval_batch_size}": config.data.eval_batch_size,
                 **{f"the batch {b} in data.resolution_schedule": b for b in sorted(phase_batches)}}
  for field, value in batch_sizes.items():
    if value % num_devices:
      lower = value // num_devices * num_devices
      raise ConfigError(
          f"{field} does not divide over {num_devices} devices; use a multiple of {num_devices} "
          f"(e.g. {max(lower, num_devices)} or {lower + num_devices}).")
  return nodes, local
