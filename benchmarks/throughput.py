"""Training throughput of one model on the devices here: the real train step on synthetic batches.

  python benchmarks/throughput.py --model resnet50 --image_size 224 --batch_per_device 64 --dtype bfloat16 \\
      --steps 20 [--strategy hitopk@0.01] [--config.FIELD=VALUE ...] [--profile_dir DIR]

The step is the trainer's (light_jax/compiled_steps.py, light_jax/train_step.py): our gradient reducer
(--strategy NAME[@DENSITY], default the config's), the config's optimizer (SGD; --config.optimizer.name=lars
for LARS), per-device BatchNorm, over a (node, local) mesh of every device here (--nodes 1 by default).
The batches are uint8 images already on the devices (random pixels, fixed before timing), so neither the
input pipeline nor the host is measured. Reported: images/s per device and in all, median step seconds
over --steps after --warmup (with diloco@H the mean over whole sync periods: one step in H crosses the
machines; --steps a multiple of H), compile seconds (the train state's set-up and the step's compile), and
the device memory the compiled step needs (XLA's memory analysis: arguments + outputs + temporaries - donated
aliases, per device). On CPU,
--cpu_devices simulates devices (tests run it at toy sizes). --profile_dir traces --profile_steps steps
with jax.profiler (TensorBoard's profile plugin or Perfetto open it).

--config.FIELD sets what the step reads: model.*, optimizer.*, comm.* (--strategy sets comm.strategy and its
density), micro_batches, seed. Flags own the rest, so these are refused: --config.model.name and .dtype (use
--model, --dtype), --config.mesh.* (--nodes, --cpu_devices), --config.global_batch_size (--batch_per_device)
and --config.data.* (the batches are synthetic: --image_size, --num_classes), --config.max_steps and
.num_epochs (--steps, --warmup). The learning rate is a constant 0.1, so the optimizer's schedule fields play no
part, nor do checkpoints or logging. The config is
checked as train.py checks it; a density schedule (comm.density_warmup_epochs, comm.final_density_epochs) is
refused: one step program is timed, at --strategy's density.

Last line: one JSON object with `images_per_sec` (per device), `images_per_sec_total`, `step_seconds`,
`step_seconds_min` and `_max` (the spread of the timed steps), `compile_seconds`, `peak_memory_bytes_per_device`
and the settings, the --config overrides among them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from light_jax import cli, xla_flags  # noqa: E402
from light_jax import config as config_lib  # noqa: E402
from light_jax.config import base_config  # noqa: E402

try:  # a config dict flag applies its --config.FIELD overrides here, at definition
  _CONFIG = config_flags.DEFINE_config_dict("config", base_config(), "config fields (the defaults of base_config)")
except cli.FLAG_ERRORS as e:
  error = cli.describe_flag_error(e, sys.argv)
  if error is None:  # not the command line's: a bug, with its traceback
    raise
  cli.fail(str(error))
_MODEL = flags.DEFINE_string("model", "resnet50", "model.name")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "square image side, pixels", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_per_device", 64, "images per device per step", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16", "float16"], "compute dtype (model.dtype)")
_STEPS = flags.DEFINE_integer("steps", 20, "timed steps", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 3, "steps run before timing", lower_bound=0)
_STRATEGY = flags.DEFINE_string("strategy", None, "comm strategy NAME[@DENSITY] (default: the config's)")
_NODES = flags.DEFINE_integer("nodes", 1, "mesh nodes (the rest of the devices are local)", lower_bound=1)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 1, "devices to simulate when running on CPU", lower_bound=1)
_CLASSES = flags.DEFINE_integer("num_classes", 1000, "classifier outputs", lower_bound=1)
_PROFILE_DIR = flags.DEFINE_string("profile_dir", None, "write a jax.profiler trace of a few steps here")
_PROFILE_STEPS = flags.DEFINE_integer("profile_steps", 3, "steps to trace with --profile_dir", lower_bound=1)
# Config fields the flags own: a --config.FIELD for one of them (or under it) would have no effect.
FLAG_FIELDS = {
  "model.name": "--model",
  "model.dtype": "--dtype",
  "mesh": "--nodes and --cpu_devices",
  "global_batch_size": "--batch_per_device",
  "data": "--image_size and --num_classes (the batches are synthetic)",
  "max_steps": "--steps and --warmup",
  "num_epochs": "--steps and --warmup",
}


def peak_memory_bytes(compiled) -> int | None:
  """Per-device bytes the compiled step needs, from XLA's memory analysis (None where it gives none)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    return None
  if stats is None:
    return None
  return int(
    stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
  )


def main(argv):
  del argv
  cli.check_model(_MODEL.value)
  if _PROFILE_DIR.value:  # its folder made and written now: the trace failed after the timed steps
    cli.output_path(os.path.join(_PROFILE_DIR.value, "trace"), "--profile_dir")
  for field in cli.overridden_fields(sys.argv):
    owner = next((f for f in FLAG_FIELDS if field == f or field.startswith(f + ".")), None)
    if owner:
      cli.fail(f"--config.{field} has no effect in this benchmark; set {FLAG_FIELDS[owner]} instead")
  cli.check_device_count(_CPU_DEVICES.value, f"--cpu_devices={_CPU_DEVICES.value}")
  import jax

  if _CPU_DEVICES.value > 1:
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  import numpy as np
  import optax

  from light_jax import optim, schedules
  from light_jax import train_step as step_lib
  from light_jax.compiled_steps import CompiledSteps
  from light_jax.data import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo
  from light_jax.models import create_model
  from light_jax.parallel import mesh as mesh_lib

  config = _CONFIG.value
  config.model.update(name=_MODEL.value, dtype=_DTYPE.value)
  if _STRATEGY.value:
    try:
      config.comm.update(config_lib.strategy_fields(_STRATEGY.value))
    except config_lib.ConfigError as e:
      cli.fail(str(e))
  try:
    mesh = mesh_lib.make_mesh(_NODES.value, -1, names=("--nodes", "--local"))
  except mesh_lib.MeshError as e:  # one process: --nodes does not divide the devices
    cli.fail(f"{e} (On CPU, --cpu_devices sets how many devices there are.)")
  size, per_device = _IMAGE_SIZE.value, _BATCH.value
  global_batch = per_device * mesh.size
  nodes, local = mesh.devices.shape
  config.global_batch_size = global_batch
  config.data.eval_batch_size = global_batch  # no evaluation here: its batch must only not be refused
  config.mesh.update(nodes=nodes, local=local, cpu_devices=mesh.size)
  try:
    config_lib.validate(config, mesh.size)
  except config_lib.ConfigError as e:
    cli.fail(f"invalid config: {e}")
  if config.comm.density_warmup_epochs or config.comm.final_density_epochs:
    cli.fail(
      "a density schedule (comm.density_warmup_epochs, comm.final_density_epochs) changes the step program "
      "during a run; this benchmark times one: give the density to time in --strategy NAME@DENSITY instead"
    )
  sync_every = config.comm.sync_every if config.comm.strategy == "diloco" else None
  if sync_every and _STEPS.value % sync_every:
    cli.fail(f"--steps={_STEPS.value}: with diloco@{sync_every}, a multiple of {sync_every} (whole sync periods)")
  info = DatasetInfo(_CLASSES.value, (size, size, 3), IMAGENET_MEAN, IMAGENET_STD)
  steps = _WARMUP.value + _STEPS.value + (_PROFILE_STEPS.value if _PROFILE_DIR.value else 0)
  # DiLoCo also syncs at a run's end: the plan ends after the steps run, at a period's end, so that none of them is
  # an extra sync and the bytes count one sync in sync_every steps.
  planned = sync_every * (steps // sync_every + 1) if sync_every else steps
  plan = schedules.EpochPlan(global_batch * planned, 1, (schedules.Phase(0, size),), global_batch)
  model = create_model(config.model.name, info.num_classes, config.model.dtype, config.model.width)
  optimizer = optim.from_config(config, optax.constant_schedule(0.1))

  start = time.perf_counter()
  compiled = CompiledSteps(config, model, optimizer, mesh, info, plan)
  state = step_lib.create_train_state(model, optimizer.tx, compiled.reducer, info.image_shape, mesh, config.seed)
  step_fn, comm_bytes = compiled.for_step(0, state)
  compile_seconds = time.perf_counter() - start
  peak = peak_memory_bytes(step_fn)

  rng = np.random.default_rng(0)
  sharding = mesh_lib.batch_sharding(mesh)
  batches = [
    (
      jax.device_put(rng.integers(0, 256, (global_batch, size, size, 3), dtype=np.uint8), sharding),
      jax.device_put(rng.integers(0, info.num_classes, global_batch).astype(np.int32), sharding),
    )
    for _ in range(2)
  ]
  for i in range(_WARMUP.value):
    state, loss = step_fn(state, *batches[i % 2])
  jax.block_until_ready(state)
  seconds = []
  for i in range(_STEPS.value):
    begin = time.perf_counter()
    state, loss = step_fn(state, *batches[i % 2])
    jax.block_until_ready(loss)
    seconds.append(time.perf_counter() - begin)
  if _PROFILE_DIR.value:
    jax.profiler.start_trace(_PROFILE_DIR.value, create_perfetto_trace=True)
    for i in range(_PROFILE_STEPS.value):
      state, loss = step_fn(state, *batches[i % 2])
    jax.block_until_ready(loss)
    jax.profiler.stop_trace()

  if sync_every:  # the timed steps start at the warm-up's end, not a period's: any sync_every in a row hold one sync
    step_seconds = statistics.fmean(seconds)
  else:
    step_seconds = statistics.median(seconds)
  platform = mesh.devices.flat[0].platform
  result = {
    "images_per_sec": per_device / step_seconds,
    "images_per_sec_total": global_batch / step_seconds,
    "step_seconds": step_seconds,
    "step_seconds_min": min(seconds),
    "step_seconds_max": max(seconds),
    "compile_seconds": compile_seconds,
    "peak_memory_bytes_per_device": peak,
    "model": config.model.name,
    "image_size": size,
    "batch_per_device": per_device,
    "dtype": config.model.dtype,
    "strategy": _STRATEGY.value or config.comm.strategy,
    "optimizer": config.optimizer.name,
    "config_overrides": cli.config_overrides(sys.argv[1:]),
    "steps": _STEPS.value,
    "warmup": _WARMUP.value,
    "devices": mesh.size,
    "mesh": list(mesh.devices.shape),
    "platform": platform,
    "device_kind": mesh.devices.flat[0].device_kind,
    "inter_node_bytes_per_step": comm_bytes.inter_node,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  memory = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a"
  print(f"\n{config.model.name} at {size} px, {per_device} images per device, {config.model.dtype}, "
        f"{result['strategy']}, mesh {nodes} x {local} {result['device_kind']}")  # fmt: skip
  print(f"{'images/s/device':>16}{'images/s':>11}{'step ms':>9}{'min ms':>8}{'compile s':>11}{'memory/device':>15}")
  print(f"{result['images_per_sec']:>16,.1f}{result['images_per_sec_total']:>11,.1f}{1e3 * step_seconds:>9.1f}"
        f"{1e3 * min(seconds):>8.1f}{compile_seconds:>11.1f}{memory:>15}")  # fmt: skip
  print(json.dumps(result))


if __name__ == "__main__":
  xla_flags.apply()
  with cli.measuring("a smaller --batch_per_device or --image_size"):
    app.run(main, flags_parser=cli.flags_parser(_CONFIG))
