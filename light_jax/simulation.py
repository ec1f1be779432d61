"""The simulator: how long a training run takes on a cluster we do not have, from measured or published parts.

Inputs: a training config (model, global batch and resolution phases, epochs, ``comm``), a ``Cluster``
(nodes x devices, the alpha-beta link costs of ``parallel/cost_model.py``, the input rate per host) and
its ``DeviceProfile`` (training images/s of one device at a reference size, with the figure's source).
For each phase (consecutive steps with one image size, global batch and top-k density) it simulates one step:

1. Compute: the device's share of the batch at the profile's images/s, scaled by pixels from the
   reference size and, for a model other than the profile's (ResNet-50), by its backward FLOPs per image
   against that model's at the reference size (``model_cost_ratio``); a third forward, two thirds backward
   (a backward pass costs twice a forward one), the backward split over the tensors by their backward FLOPs
   (``fusion.profile_parameters`` on the real flax model), in backward order.
2. Communication: the reducer the config describes (``reducer.reducer_from_config``; adaptive fusion,
   auto and the square-root k share planned as the trainer plans them: ``cost_model.plan_reducer`` with
   ``comm.device_tflops`` and the cluster cost's top-k rate, not the device profile's, which time the step;
   ``device_tflops`` gives the value of ``comm.device_tflops`` that describes a profile), one
   bucket after the other on one stream: a bucket starts when its last gradient is ready and the
   previous bucket is done, and takes its top-k selection (compressed buckets, at the profile's
   selection rate) plus ``ClusterCost.reduction_seconds``, the function adaptive fusion and the mesh
   lab's prediction use. With ``overlap`` (GPUs: asynchronous collectives) buckets run during the
   backward pass and only what outlasts it is exposed; without (XLA on CPU), all of it is.
3. The optimizer update: memory-bound, 20 bytes per parameter (read parameter, gradient and momentum,
   write parameter and momentum, float32) at the device's memory bandwidth; with ``optimizer.sharded_update``
   each device updates 1/local of them, and the all-gathers inside the node, which carry the updates, follow it.
4. Input: a host's share of the global batch at the host's input rate, which falls with the pixels;
   the pipeline runs ahead, so the step takes the slower of the input and everything else.

The config is checked as the trainer checks it (``config.validate`` on the cluster's mesh), and the run ends
where the trainer's would (``schedules.total_steps``: ``max_steps`` may end it early).

Evaluation: the eval split once per epoch and at a run's last step (as the trainer does), forward only, at a
third of a training step's time per image, on every device, padding rows included (the last batch is
padded to ``data.eval_batch_size``). The top-k density warm-up and final density split the phases where the
density changes (``schedules.density_at``), each timed with the reducer at its density. Not modelled: compilation
and start-up, checkpoints, stragglers, selection competing with the backward pass for the
device (it runs on the communication stream here), several communication streams. docs/techniques.md
section 8 lists the assumptions and their sources.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import ml_collections

from light_jax import config as config_lib
from light_jax import schedules
from light_jax.data import pipeline
from light_jax.parallel import cost_model, strategies
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.reducer import DILOCO, POWERSGD, reducer_from_config

UPDATE_BYTES_PER_PARAMETER = 20  # float32: read parameter, gradient, momentum; write parameter, momentum


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """One accelerator, as the simulator sees it."""

  name: str
  images_per_sec: float  # training (forward + backward) images/s of one device at ``image_size``, of ``model``
  image_size: int
  dtype: str
  memory_bytes_per_sec: float  # for the optimizer update
  topk_elements_per_sec: float  # exact top-k selection, elements of input per second
  source: str
  model: str = "resnet50"  # the model ``images_per_sec`` was measured on, on ImageNet (3 channels, 1,000 classes)

  def train_seconds_per_image(self, image_size: int) -> float:
    """``model``'s seconds per image; ``model_cost_ratio`` scales them to another model."""
    return (image_size / self.image_size) ** 2 / self.images_per_sec


DEVICES = {
  "v100": DeviceProfile(
    "v100",
    images_per_sec=1300.0,
    image_size=224,
    dtype="float16",
    memory_bytes_per_sec=900e9,
    topk_elements_per_sec=cost_model.ASSUMED_TOPK_RATES["v100"],
    source="images/s: NVIDIA DeepLearningExamples, ResNet-50 v1.5 mixed-precision training on V100 16 GB, about "
    "1,200-1,400 images/s per GPU (middle taken); memory: V100 datasheet, 900 GB/s HBM2; top-k: an "
    f"assumption ({cost_model.ASSUMED_TOPK_RATES['v100']:.2g} elements/s), not measured; "
    "benchmarks/calibrate_links.py measures it on a device",
  ),
  "h200": DeviceProfile(
    "h200",
    images_per_sec=7950.0,
    image_size=224,
    dtype="float16",
    memory_bytes_per_sec=4.8e12,
    topk_elements_per_sec=cost_model.ASSUMED_TOPK_RATES["h200"],
    source="images/s: NVIDIA's MLPerf Training v4.0 ResNet-50 submission (MXNet, DALI), about 7,950 images/s "
    "per H200; memory: H200 datasheet, 4.8 TB/s HBM3e; top-k: an assumption "
    f"({cost_model.ASSUMED_TOPK_RATES['h200']:.2g} elements/s, the V100 figure scaled by memory bandwidth), "
    "not measured",
  ),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Machines, their devices and links, and how fast each host feeds its devices."""

  nodes: int
  devices_per_node: int
  cost: cost_model.ClusterCost
  device: DeviceProfile
  input_images_per_sec: float  # per host, at ``input_image_size``; falls with the pixels
  input_image_size: int = 128
  source: str = ""

  @property
  def num_devices(self) -> int:
    return self.nodes * self.devices_per_node

  def input_seconds_per_image(self, image_size: int) -> float:
    return (image_size / self.input_image_size) ** 2 / self.input_images_per_sec


# The input rate: light_jax's decoded disk cache measured 2,856 images/s per core at 128 px on this
# machine (docs/measurements.md, "Input pipeline"), read from the page cache: an ImageNet cache larger than a
# host's memory may be slower. 32 cores of a host given to input is an assumption.
INPUT_IMAGES_PER_SEC_PER_CORE = 2856.0
CLUSTERS = {
  "v100x128_25gbe": Cluster(
    16,
    8,
    cost_model.PRESETS["v100_nvlink_25gbe"],
    DEVICES["v100"],
    32 * INPUT_IMAGES_PER_SEC_PER_CORE,
    source="Light's cluster: 16 machines x 8 V100 (NVLink), 25 Gbps Ethernet between machines",
  ),
  "h200x8_ib": Cluster(
    1,
    8,
    # The H100 preset's links, with the H200's top-k rate: the rate auto plans with is the one the step is charged.
    dataclasses.replace(
      cost_model.PRESETS["h100_nvlink_ib"], topk_elements_per_sec=cost_model.ASSUMED_TOPK_RATES["h200"]
    ),
    DEVICES["h200"],
    32 * INPUT_IMAGES_PER_SEC_PER_CORE,
    source="one 8 x H200 machine (NVLink 4; the H100 link preset, the H200's top-k rate)",
  ),
}

# What the simulator needs of the datasets the configs name: (train examples, eval examples, classes, channels).
DATASETS = {"imagenet2012": (1_281_167, 50_000, 1000, 3), "fashion_mnist": (60_000, 10_000, 10, 1)}
TCP_GOODPUT = 0.9  # fraction of an Ethernet link's rate TCP carries (25 Gbps -> 2.8 GB/s, as the preset)


@functools.lru_cache(maxsize=32)
def parameter_profile(
  name: str, num_classes: int, dtype: str, width: int, shape: tuple[int, ...]
) -> fusion_lib.ParameterProfile:
  """``fusion.profile_parameters`` of a model by its config's fields, traced once per process: a sweep simulates
  the same model at every point (0.3 s a trace of ResNet-50 here). Read only: every caller shares it."""
  from light_jax.models import create_model

  return fusion_lib.profile_parameters(create_model(name, num_classes, dtype, width), shape)


def backward_flops_per_image(name: str, width: int, num_classes: int, shape: tuple[int, ...]) -> float:
  """A model's backward FLOPs per image of ``shape`` (``fusion.profile_parameters``'s estimate)."""
  return sum(parameter_profile(name, num_classes, "float32", width, shape).backward_flops)


def model_cost_ratio(model: ml_collections.ConfigDict, num_classes: int, channels: int, device: DeviceProfile) -> float:
  """How many times the training FLOPs of ``device.model`` an image costs ``model``, both at the profile's image
  size: its seconds per image are ``device``'s times this (1 for the profile's own model on ImageNet)."""
  size = device.image_size
  return backward_flops_per_image(model.name, model.width, num_classes, (size, size, channels)) / _measured_flops(
    device
  )


def _measured_flops(device: DeviceProfile) -> float:
  """The backward FLOPs per image of the model ``device.images_per_sec`` was measured on (ImageNet, its size)."""
  classes, channels = DATASETS["imagenet2012"][2:]
  return backward_flops_per_image(device.model, 0, classes, (device.image_size, device.image_size, channels))


def device_tflops(device: DeviceProfile) -> float:
  """``device``'s speed in ``comm.device_tflops``'s sense, the value a config trained on it should set: its
  model's backward FLOPs per image (``fusion.profile_parameters``'s estimate) over the two thirds of its seconds
  per image that the simulator gives the backward pass, in TFLOP/s."""
  return _measured_flops(device) / (2 / 3 * device.train_seconds_per_image(device.image_size)) / 1e12


def with_link(cluster: Cluster, nodes: int | None = None, inter_gbps: float | None = None) -> Cluster:
  """``cluster`` with another machine count or inter-node Ethernet rate (for sweeps)."""
  cost = cluster.cost
  if inter_gbps is not None:
    inter = cost_model.LinkCost(alpha=cost.inter.alpha, beta=1 / (TCP_GOODPUT * inter_gbps * 1e9 / 8))
    cost = dataclasses.replace(cost, inter=inter)
  return dataclasses.replace(cluster, nodes=nodes or cluster.nodes, cost=cost)


@dataclasses.dataclass(frozen=True)
class BucketComm:
  """One bucket's collective as the step timeline sees it."""

  strategy: str  # the strategy that reduces it (the configured one or its dense fallback)
  elements: int
  k: int = 0  # entries top-k keeps; 0 for a dense bucket
  selection_elements: int = 0  # elements the top-k selections run on, all of them (gtopk: log2(P) + 1 of the unit)
  last_position: int = 0  # its last gradient's position in backward order: it is ready after that one
  # comm.compact_pairs for this bucket: its pairs cross as bfloat16 values and uint16 indices where its
  # strategy sends them so (the top-k strategies; gtopk's merge rounds, not its float32 sums)
  compact_pairs: bool = False


@dataclasses.dataclass(frozen=True)
class StepTime:
  compute: float  # forward + backward
  exposed_comm: float  # communication the backward pass did not hide
  update: float
  input_wait: float

  @property
  def total(self) -> float:
    return self.compute + self.exposed_comm + self.update + self.input_wait


def simulate_step(
  cost: cost_model.ClusterCost,
  nodes: int,
  local: int,
  buckets: Sequence[BucketComm],
  forward_seconds: float,
  backward_seconds: Sequence[float],
  update_seconds: float = 0.0,
  input_seconds: float = 0.0,
  overlap: bool = True,
  wire_itemsize: int = 4,
  topk_elements_per_sec: float = math.inf,
  gather_after_update: bool = False,
) -> StepTime:
  """One step's timeline: ``backward_seconds`` per tensor in backward order, the buckets' collectives one
  after the other, each from when its last gradient is ready (``overlap``) or after the whole backward.
  ``gather_after_update`` (``optimizer.sharded_update``): each bucket's all-gather inside the node carries the
  updates, after the optimizer has run on every shard, so it leaves the stream and follows the update, exposed."""
  ready, elapsed = [], forward_seconds
  for seconds in backward_seconds:
    elapsed += seconds
    ready.append(elapsed)
  compute = elapsed
  stream_free = 0.0 if overlap else compute
  gathers = 0.0  # the sharded update's all-gathers, after the update
  for b in buckets:
    selection = b.selection_elements / topk_elements_per_sec if b.k else 0.0
    link = cost.reduction_seconds(
      b.strategy, b.elements, nodes, local, b.k, wire_itemsize=wire_itemsize, compact_pairs=b.compact_pairs
    )
    if gather_after_update and local > 1:
      # Half the node's bytes: its reduce-scatter stays in the stream, the all-gather of the updates moves out.
      buffer = strategies.Buffer(b.elements, 4, nodes, local, b.k, wire_itemsize, b.compact_pairs)
      gather_bytes = strategies.get(b.strategy).bytes(buffer).intra_node // 2
      link -= cost.intra.beta * gather_bytes
      gathers += cost.intra.seconds(gather_bytes)
    start = max(ready[min(b.last_position, len(ready) - 1)] if overlap else compute, stream_free)
    stream_free = start + selection + link
  exposed = max(stream_free - compute, 0.0) + gathers
  busy = compute + exposed + update_seconds
  return StepTime(compute, exposed, update_seconds, max(input_seconds - busy, 0.0))


def move_measured_step(
  measured_seconds: float,
  buckets: Sequence[BucketComm],
  measured_on: cost_model.ClusterCost,
  moved_to: cost_model.ClusterCost,
  nodes: int,
  local: int,
  wire_itemsize: int = 4,
  moved_buckets: Sequence[BucketComm] | None = None,
) -> float:
  """A step measured on the links ``measured_on`` describes, predicted on ``moved_to``, without overlap (XLA
  on CPU): its compute is the measured step less the modelled communication of its ``buckets`` there, plus
  that of ``moved_buckets`` (default: the same; adaptive fusion and auto may plan others for other links) on
  ``moved_to``. The mesh lab's ``predicted_step_seconds``."""

  def communication(cost: cost_model.ClusterCost, of: Sequence[BucketComm]) -> float:
    return simulate_step(cost, nodes, local, of, 0.0, [0.0], overlap=False, wire_itemsize=wire_itemsize).total

  moved = buckets if moved_buckets is None else moved_buckets
  return measured_seconds - communication(measured_on, buckets) + communication(moved_to, moved)


def bucket_comms(reducer, params) -> list[BucketComm]:
  """The reducer's buckets for ``params`` as the timeline needs them."""
  leaves = jax.tree.leaves(params)
  order, buckets = reducer.buckets(leaves)
  comms = []
  for b, positions in enumerate(buckets):
    elements = sum(math.prod(leaves[order[i]].shape) for i in positions)
    one = reducer.bucket_reducer(b)
    k = one.k_for(elements)
    spec = one.strategy_for_size(elements)
    comms.append(
      BucketComm(
        spec.name,
        elements,
        k,
        one.selection_elements(elements),
        max(positions),
        one.compact_pairs,
      )
    )
  return comms


@dataclasses.dataclass(frozen=True)
class PhaseReport:
  first_epoch: int
  epochs: int  # the epochs that end (and are evaluated) in this phase
  image_size: int
  global_batch: int
  steps: int
  step: StepTime
  buckets: int
  train_seconds: float
  eval_seconds: float
  density: float = 1.0  # the top-k density of its steps (schedules.density_at)
  last_epoch: int = 0  # the epoch of its last step

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["step"] = {**dataclasses.asdict(self.step), "total": self.step.total}
    return d


class Phase(NamedTuple):
  """Consecutive steps with one image size, global batch and top-k density."""

  first_epoch: int
  epochs: int  # the epochs that end in it: the trainer evaluates at each epoch's end (and at the run's)
  image_size: int
  global_batch: int
  steps: int
  density: float
  last_epoch: int


def epoch_plan(config: ml_collections.ConfigDict, num_train: int) -> schedules.EpochPlan:
  """The trainer's plan of epochs (batch and image size per epoch) for ``num_train`` training examples."""
  image_size = config.data.image_size or 28
  resolutions = schedules.parse_resolution_schedule(config.data.resolution_schedule, image_size)
  return schedules.EpochPlan(num_train, config.num_epochs, resolutions, config.global_batch_size)


def split_sizes(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """The training and evaluation examples a run reads, as the input pipeline takes its subsets (0: the whole
  split)."""
  num_train, num_eval = DATASETS[config.data.dataset][:2]
  return min(num_train, config.data.train_subset or num_train), min(num_eval, config.data.eval_subset or num_eval)


def phases_of(config: ml_collections.ConfigDict, num_train: int) -> list[Phase]:
  """The run's phases: runs of steps with one image size, global batch and top-k density (the density warm-up
  and the final density, as ``CompiledSteps.density_at`` sets them), up to the run's last step
  (``schedules.total_steps``: ``max_steps`` may end it inside an epoch, which then counts as one of ``epochs``:
  the trainer evaluates at its end too)."""
  image_size = config.data.image_size or 28
  plan = epoch_plan(config, num_train)
  total = schedules.total_steps(config.max_steps, plan)
  comm = config.comm
  warmup_steps, final = schedules.density_steps(comm, plan)  # as CompiledSteps has them

  def density(step: int) -> float:
    return schedules.density_at(step, comm.density, warmup_steps, final=final)

  phases: list[Phase] = []
  for epoch in range(config.num_epochs):
    first = plan.first_steps[epoch]
    if first >= total:
      break
    end = min(first + plan.steps_per_epoch[epoch], total)
    # (start, stop, density): one run, unless the density changes inside the epoch (warm-up, final density):
    # then a run per step, which the loop below merges where the density stays
    runs = [(first, end, density(first))]
    if first < warmup_steps or (final is not None and first < final[0] < end):
      runs = [(step, step + 1, density(step)) for step in range(first, end)]
    key = (plan.image_sizes[epoch] or image_size, plan.batch_sizes[epoch])
    for start, stop, d in runs:
      ends_epoch = int(stop == end)
      last = phases[-1] if phases else None
      if last is not None and (last.image_size, last.global_batch, last.density) == (*key, d):
        phases[-1] = last._replace(epochs=last.epochs + ends_epoch, steps=last.steps + stop - start, last_epoch=epoch)
      else:
        phases.append(Phase(epoch, ends_epoch, *key, stop - start, d, epoch))
  return phases


def check(config: ml_collections.ConfigDict, cluster: Cluster) -> None:
  """Raises ValueError (``config.ConfigError`` for the trainer's own checks) where ``simulate`` cannot time
  ``config`` on ``cluster``: a dataset or strategy it has no model of, or what the trainer would refuse there
  (num_epochs=0, a batch that does not divide over the devices, gtopk on a device count that is no power of
  two, ...)."""
  if config.data.dataset not in DATASETS:
    raise ValueError(f"the simulator knows the datasets {sorted(DATASETS)}, not {config.data.dataset!r}")
  if config.comm.strategy in (POWERSGD, DILOCO):
    raise ValueError(
      f"the simulator times bucketed strategies ({', '.join(strategies.NAMES)}, auto), not "
      f"{config.comm.strategy!r}: its step (QR factorisations; DiLoCo's rare outer step) has no model yet"
    )
  # The trainer's checks, not a copy of them: on the cluster's mesh, one process per node.
  checked = config.copy_and_resolve_references()
  checked.mesh.update(nodes=cluster.nodes, local=cluster.devices_per_node)
  config_lib.validate(checked, cluster.num_devices, num_processes=cluster.nodes)
  epoch_plan(config, split_sizes(config)[0])  # a training split smaller than one batch: ScheduleError


def simulate(config: ml_collections.ConfigDict, cluster: Cluster, overlap: bool = True) -> dict:
  """The whole run: per phase, the step split and the seconds; the total, the exposed-communication
  fraction and the scaling efficiency against one device. Raises ValueError as ``check`` does."""
  check(config, cluster)
  num_classes, channels = DATASETS[config.data.dataset][2:]
  num_train, num_eval = split_sizes(config)
  # Evaluation runs whole batches: the padding rows cost as much as the rest.
  padded_eval = pipeline.padded_eval_examples(num_eval, config.data.eval_batch_size)
  eval_size = config.data.image_size or 28
  profile = parameter_profile(
    config.model.name, num_classes, config.model.dtype, config.model.width, (eval_size, eval_size, channels)
  )
  leaves = jax.tree.leaves(profile.params)
  num_params = sum(math.prod(leaf.shape) for leaf in leaves)
  device, nodes, local = cluster.device, cluster.nodes, cluster.devices_per_node
  # The profile's images/s are its model's (ResNet-50): another model costs its FLOPs' share of them.
  cost_ratio = model_cost_ratio(config.model, num_classes, channels, device)

  def seconds_per_image(size: int) -> float:
    return cost_ratio * device.train_seconds_per_image(size)

  base = reducer_from_config(config.comm, nodes, local, profile.order)
  wire_itemsize = 2 if config.comm.dtype == "bfloat16" else 4
  backward_flops = [profile.backward_flops[i] for i in profile.order]
  total_backward_flops = sum(backward_flops)
  update = num_params * UPDATE_BYTES_PER_PARAMETER / device.memory_bytes_per_sec
  if config.optimizer.sharded_update:  # each device updates its 1/local shard of the parameters
    update /= local

  def planned(reducer, size: int, batch: int):  # from the trainer's inputs (CompiledSteps._planned)
    examples = batch / cluster.num_devices * (size / eval_size) ** 2
    return cost_model.plan_reducer(
      reducer, config.comm, profile, cluster.cost, config.comm.device_tflops * 1e12, examples, overlap
    )[0]

  # As CompiledSteps plans them: once, on the phase with the least compute per step (EpochPlan.leanest_step), or
  # for each phase where cost_model.replans_buckets_per_phase says so.
  plan, shape = epoch_plan(config, num_train), (eval_size, eval_size, channels)
  lean_batch, lean_size, _, _ = plan.batch_shape_at(plan.leanest_step(shape), shape)
  # Each phase's reducer at its density, as CompiledSteps.reducer_at makes it (a dense strategy's planned again).
  replans = cost_model.replans_buckets_per_phase(config.comm)
  reducer = base if replans else planned(base, lean_size, lean_batch)
  reports = []
  for first, epochs, size, batch, steps, density, last_epoch in phases_of(config, num_train):
    per_device = batch / cluster.num_devices
    compute = per_device * seconds_per_image(size)
    backward = [2 / 3 * compute * f / total_backward_flops for f in backward_flops]
    at_density = reducer.at_density(density)
    buckets = bucket_comms(planned(at_density, size, batch) if replans else at_density, profile.params)
    step = simulate_step(
      cluster.cost,
      nodes,
      local,
      buckets,
      compute / 3,
      backward,
      update,
      batch / nodes * cluster.input_seconds_per_image(size),
      overlap,
      wire_itemsize,
      device.topk_elements_per_sec,
      gather_after_update=config.optimizer.sharded_update,
    )
    eval_seconds = epochs * padded_eval / cluster.num_devices * seconds_per_image(eval_size) / 3
    reports.append(
      PhaseReport(
        first, epochs, size, batch, steps, step, len(buckets), steps * step.total, eval_seconds, density, last_epoch
      )
    )

  train = sum(r.train_seconds for r in reports)
  exposed = sum(r.steps * r.step.exposed_comm for r in reports)
  one_device = sum(r.steps * r.global_batch * seconds_per_image(r.image_size) for r in reports)
  return {
    "seconds": train + sum(r.eval_seconds for r in reports),
    "train_seconds": train,
    "eval_seconds": sum(r.eval_seconds for r in reports),
    "exposed_comm_fraction": exposed / train,
    "scaling_efficiency": one_device / (cluster.num_devices * train),
    "phases": [r.as_dict() for r in reports],
    "num_params": num_params,
    "model_cost_ratio": cost_ratio,
  }
