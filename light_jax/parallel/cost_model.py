"""The alpha-beta cost model of a collective, per link level: t(M) = alpha + beta * M.

alpha is the start-up latency of one collective (seconds), beta the time per byte sent (seconds/byte;
1/beta is the effective bandwidth). Each level of the mesh has its own pair: ``intra`` for the links
inside a node (NVLink / PCIe), per device, as each device has its own; ``inter`` for a node's link to
the others (Ethernet / InfiniBand), which the node's devices share: in a hierarchical step all ``local``
devices of a node send their shard across at once, so the node's link carries ``local`` times one
device's inter-node bytes; a flat ring over every device crosses it with one device's traffic (so does
gtopk's final psum of its k sums, while its merge rounds cross from all ``local`` devices at once).

``fit_link`` fits alpha and beta from measured (bytes, seconds) pairs;
``benchmarks/calibrate_links.py`` measures them on the current mesh and writes a JSON file that
``comm.cost_model`` can name instead of a preset. Adaptive fusion (fusion.plan_mgwfbp) uses the model
to decide which gradients to merge.

The presets are *assumptions* from public hardware figures, not measurements: NVLink 2 (V100) about
100 GB/s of all-reduce bus bandwidth, NVLink 4 (H100) about 400 GB/s; 25 Gbps Ethernet about 2.8 GB/s
of TCP goodput per node; 8 x 400 Gbps InfiniBand NDR about 45 GB/s per GPU, 360 GB/s per node.
Latencies: a few microseconds on NVLink, tens over TCP. A preset also names its device's exact top-k
selection rate, an assumption too (``ASSUMED_TOPK_RATES``, which the simulator's devices use as well).
Calibrate on the real cluster before trusting a plan (``benchmarks/calibrate_links.py``, also on the mesh
lab's emulated links): it measures both links and the rate on the device it runs on.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel import strategies
from light_jax.parallel.reducer import AUTO, GradientReducer, Reducer, may_select_top_k


@dataclasses.dataclass(frozen=True)
class LinkCost:
  alpha: float  # seconds per collective
  beta: float  # seconds per byte over the link (intra: one device's links; inter: one node's link)

  def seconds(self, num_bytes: float) -> float:
    return self.alpha + self.beta * num_bytes if num_bytes > 0 else 0.0


def _gtopk_sums(b: strategies.Buffer) -> strategies.CommBytes:
  # gtopk_allreduce's last step: a psum of the k exact sums over every device, as gtopk_bytes counts it.
  return strategies.dense_bytes(strategies.Buffer(b.k, b.itemsize, b.nodes, b.local))


# The part of a two-level strategy's bytes (keyed by its byte formula) that is one flat ring over every device.
_FLAT_PARTS = {strategies.gtopk_bytes: _gtopk_sums}


TOPK_RATE = "topk_elements_per_sec"  # ClusterCost's field, a calibration file's optional top-level key

# Exact top-k selection rates, elements of input per second: assumptions, not measurements (no GPU has run here). A
# V100 at 1e9; the others scaled from it by memory bandwidth, as selection reads the vector a few times: an H100
# (3.35 TB/s against the V100's 0.9) 3.7e9, an H200 (4.8 TB/s) 5.3e9.
ASSUMED_TOPK_RATES = {"v100": 1e9, "h100": 3.7e9, "h200": 5.3e9}


def _is_number(value) -> bool:
  """An int or float as JSON gives them (true and false are not numbers here)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ClusterCost:
  intra: LinkCost
  inter: LinkCost
  # The device's exact top-k selection rate, elements of input per second (``comm.strategy="auto"`` charges each
  # strategy its selections at it). inf: unknown (an older calibration file), so auto plans on link time alone.
  topk_elements_per_sec: float = math.inf

  def __post_init__(self):
    rate = self.topk_elements_per_sec
    if not _is_number(rate) or not rate > 0:
      raise ValueError(f"topk_elements_per_sec={rate!r} must be a number > 0 (elements/s; inf: unknown)")

  @property
  def has_topk_rate(self) -> bool:
    return math.isfinite(self.topk_elements_per_sec)

  def level_seconds(
    self,
    strategy: str,
    num_elements: int,
    nodes: int,
    local: int,
    k: int = 0,
    itemsize: int = 4,
    wire_itemsize: int | None = None,
    compact_pairs: bool = False,
  ) -> tuple[float, float]:
    """(intra-node, inter-node) seconds of reducing one flat buffer with ``strategy``."""
    spec = strategies.get(strategy)
    buffer = strategies.Buffer(num_elements, itemsize, nodes, local, k, wire_itemsize, compact_pairs)
    b = spec.bytes(buffer)
    if spec.flat:
      return self.intra.seconds(b.intra_node), self.inter.seconds(b.inter_node)
    # A two-level strategy's inter-node bytes cross a node's link from all `local` devices at once, except a
    # flat ring inside it (gtopk's sums), which crosses it with one device's bytes; that ring runs at the pace
    # of the slowest link, so its intra-node bytes add no time where there is an inter-node link.
    flat = _FLAT_PARTS[spec.bytes](buffer) if spec.bytes in _FLAT_PARTS else strategies.CommBytes()
    intra = b.intra_node - (flat.intra_node if nodes > 1 else 0)
    inter = local * (b.inter_node - flat.inter_node) + flat.inter_node
    return self.intra.seconds(intra), self.inter.seconds(inter)

  def reduction_seconds(
    self,
    strategy: str,
    num_elements: int,
    nodes: int,
    local: int,
    k: int = 0,
    itemsize: int = 4,
    wire_itemsize: int | None = None,
    compact_pairs: bool = False,
  ) -> float:
    """Modelled time of reducing one flat buffer: each level's bytes at that level's cost, in sequence."""
    intra, inter = self.level_seconds(strategy, num_elements, nodes, local, k, itemsize, wire_itemsize, compact_pairs)
    if strategies.get(strategy).flat and nodes > 1:
      return max(intra, inter)  # a flat ring runs at the pace of its slowest link, whichever level that is
    return intra + inter

  def step_seconds(
    self, buckets: Sequence[tuple[str, int, int]], nodes: int, local: int, **sizes
  ) -> tuple[float, float]:
    """(intra-node, inter-node) seconds of one step's reduction, its buckets as (strategy, elements, k)
    (``GradientReducer.bucket_plan``); ``sizes``: itemsize, wire_itemsize, compact_pairs."""
    per_bucket = [self.level_seconds(s, n, nodes, local, k, **sizes) for s, n, k in buckets]
    return sum(intra for intra, _ in per_bucket), sum(inter for _, inter in per_bucket)

  def to_json(self) -> str:
    """The links and, where known, the top-k rate (an unknown one is left out: JSON has no inf)."""
    d = dataclasses.asdict(self)
    if not self.has_topk_rate:
      del d[TOPK_RATE]
    return json.dumps(d, indent=2)

  @classmethod
  def from_dict(cls, d: dict) -> ClusterCost:
    """``to_json``'s dict, or a calibration's; without "topk_elements_per_sec" the rate is unknown (inf)."""
    rate = d.get(TOPK_RATE, math.inf)
    return cls(intra=LinkCost(**d["intra"]), inter=LinkCost(**d["inter"]), topk_elements_per_sec=rate)


PRESETS = {
  "v100_nvlink_25gbe": ClusterCost(
    intra=LinkCost(alpha=10e-6, beta=1 / 100e9),
    inter=LinkCost(alpha=50e-6, beta=1 / 2.8e9),
    topk_elements_per_sec=ASSUMED_TOPK_RATES["v100"],
  ),
  "h100_nvlink_ib": ClusterCost(
    intra=LinkCost(alpha=5e-6, beta=1 / 400e9),
    inter=LinkCost(alpha=10e-6, beta=1 / 360e9),
    topk_elements_per_sec=ASSUMED_TOPK_RATES["h100"],
  ),
}


def fit_link(num_bytes: Sequence[float], seconds: Sequence[float]) -> LinkCost:
  """Alpha and beta from measured (bytes, seconds) pairs, by least squares on *relative* error (weights
  1/seconds), so the small sizes that fix alpha count as much as the large ones that fix beta; both
  clipped at 0."""
  if len(set(num_bytes)) < 2:
    raise ValueError(f"fit_link needs two buffer sizes or more to fit a line, got {sorted(set(num_bytes))}")
  seconds = np.asarray(seconds, np.float64)
  beta, alpha = np.polyfit(np.asarray(num_bytes, np.float64), seconds, 1, w=1.0 / seconds)
  return LinkCost(alpha=max(float(alpha), 0.0), beta=max(float(beta), 0.0))


def load(name_or_path: str) -> ClusterCost:
  """A preset name or the path of a JSON file written by benchmarks/calibrate_links.py. The file's top-level
  "topk_elements_per_sec" is optional: an older calibration without it loads with the rate unknown (inf)."""
  if name_or_path in PRESETS:
    return PRESETS[name_or_path]
  try:
    with open(name_or_path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise ValueError(
      f"comm.cost_model={name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor an "
      f"existing JSON file; run benchmarks/calibrate_links.py to write one."
    ) from None
  except (OSError, ValueError) as e:  # ValueError: not JSON (json.JSONDecodeError) or not text
    raise ValueError(f"comm.cost_model={name_or_path!r}: cannot read it as JSON ({e}); write it again with "
                     "benchmarks/calibrate_links.py") from None  # fmt: skip
  # Check the shape here: LinkCost(**d) would fail later with a TypeError or KeyError that names no file.
  for level in ("intra", "inter"):
    link = data.get(level) if isinstance(data, dict) else None
    if not isinstance(link, dict) or sorted(link) != ["alpha", "beta"]:
      raise ValueError(
        f'comm.cost_model={name_or_path!r}: {level!r} must be {{"alpha": SECONDS, "beta": SECONDS_PER_BYTE}}, not '
        f"{link!r}; a calibration holds both levels, as benchmarks/calibrate_links.py writes them"
      )
    for field, value in link.items():
      if not _is_number(value) or not np.isfinite(value) or value < 0:
        raise ValueError(
          f"comm.cost_model={name_or_path!r}: {level}.{field}={value!r} must be a finite number >= 0 (seconds"
          f"{' per byte' if field == 'beta' else ''})"
        )
  rate = data.get(TOPK_RATE, math.inf)
  if TOPK_RATE in data and not (_is_number(rate) and 0 < rate < math.inf):
    raise ValueError(
      f"comm.cost_model={name_or_path!r}: {TOPK_RATE}={rate!r} must be a finite number > 0 (elements of input per "
      "second that the device's exact top-k selects, as benchmarks/calibrate_links.py measures it); leave the field "
      "out to plan on link time alone"
    )
  return ClusterCost.from_dict(data)


def bucket_seconds(cost: ClusterCost, reducer: GradientReducer, elements: int) -> float:
  """Modelled time of ``reducer`` (one strategy) reducing a bucket of ``elements``: its strategy, or the dense
  fallback for a bucket too small to compress, with its k, wire dtype and pair format."""
  name, k = reducer.strategy_for_size(elements).name, reducer.k_for(elements)
  wire_itemsize = jnp.dtype(reducer.wire_dtype).itemsize
  return cost.reduction_seconds(
    name, elements, reducer.nodes, reducer.local, k, wire_itemsize=wire_itemsize, compact_pairs=reducer.compact_pairs
  )


def effective_link(cost: ClusterCost, reducer: GradientReducer) -> LinkCost:
  """alpha and beta of one fused collective of ``reducer``'s strategy on this cluster (all levels).

  The modelled time is nearly linear in the buffer size (k grows with it for the top-k strategies), so two sizes
  give the line: within 0.3% for the top-k strategies (k rounded up, the compact pairs' block counts), further off
  for a small bucket that the top-k strategies reduce dense (docs/techniques.md section 5).
  """
  small, large = (bucket_seconds(cost, reducer, n) for n in (2**20, 2**26))
  beta = (large - small) / ((2**26 - 2**20) * 4)
  return LinkCost(alpha=max(small - beta * 2**20 * 4, 0.0), beta=beta)


def plan_adaptive_fusion(
  reducer: GradientReducer,
  profile: fusion_lib.ParameterProfile,
  cost: ClusterCost,
  device_flops: float,
  examples_per_device: int,
) -> GradientReducer:
  """``reducer`` with fusion="adaptive" and its MG-WFBP groups for the profiled parameters.

  Backward time of each tensor: its backward FLOPs per example x ``examples_per_device`` /
  ``device_flops`` (FLOP/s the device sustains).
  """
  leaves = jax.tree.leaves(profile.params)
  link = effective_link(cost, reducer)
  order = list(profile.order)
  backward_seconds = [profile.backward_flops[i] * examples_per_device / device_flops for i in order]
  sizes = [int(np.prod(leaves[i].shape)) * np.dtype(leaves[i].dtype).itemsize for i in order]
  groups = fusion_lib.plan_mgwfbp(backward_seconds, sizes, link.alpha, link.beta)
  return dataclasses.replace(reducer, fusion="adaptive", order=tuple(order), groups=tuple(tuple(g) for g in groups))


def plan_auto(
  reducer: GradientReducer,
  profile: fusion_lib.ParameterProfile,
  cost: ClusterCost,
  device_flops: float,
  examples_per_device: int,
  overlap: bool = True,
  compact_pairs: bool = False,
) -> tuple[GradientReducer, list[str]]:
  """``reducer``'s buckets, each with the strategy ``comm.strategy="auto"`` gives it; and a reason per bucket.
  ``compact_pairs`` (``comm.compact_pairs``): the top-k candidates send compact pairs, and so do
  the buckets that take them. ``cost.topk_elements_per_sec`` (a preset's assumption or a calibration's
  measurement) charges each compressed candidate its selections (gtopk: log2(P) + 1 of the whole unit) as the
  simulator does; where a calibration file has none (inf), auto plans on link time alone.

  Buckets are reduced one after the other on one stream, each once its gradients are ready (backward
  times as in ``plan_adaptive_fusion``). Every registered strategy the mesh allows is a candidate (exact,
  or compressed at the configured density), so a strategy added to the registry is considered without a
  change here. Two passes:
  1. forward: the earliest each bucket can end if every bucket takes its fastest strategy; the last of
     these is the earliest the step's communication can end (no choice per bucket ends sooner);
  2. backward, from the last bucket: keep a bucket exact when the step can still end at that earliest
     time (its exact reduction is hidden behind backward compute or behind later buckets), else give it
     its fastest strategy; each choice sets the latest the bucket before it may end.
  So no accuracy is spent where it buys no time, and by these times the step ends no later than with any single
  strategy. Planned on link time alone (no selection rate), a bucket given gtopk can end far later than it
  plans, for its log2(P) + 1 full-size selections. Without ``overlap`` (XLA on CPU runs collectives in line)
  every bucket waits for the whole backward pass.
  """
  planned, reasons, _ = _plan_auto(reducer, profile, cost, device_flops, examples_per_device, overlap, compact_pairs)
  return planned, reasons


def _candidates(reducer: GradientReducer) -> list[str]:
  """The registered strategies the mesh allows (gtopk needs a power-of-two device count)."""
  devices = reducer.nodes * reducer.local
  return [
    s.name for s in strategies.REGISTRY.values() if not (s.needs_power_of_two_devices and devices & (devices - 1))
  ]


def _plan_auto(
  reducer: GradientReducer,
  profile: fusion_lib.ParameterProfile,
  cost: ClusterCost,
  device_flops: float,
  examples_per_device: int,
  overlap: bool,
  compact_pairs: bool,
) -> tuple[GradientReducer, list[str], float]:
  """``plan_auto``'s plan and reasons, and when the step's communication ends with it (seconds after the
  backward pass starts)."""
  leaves = jax.tree.leaves(profile.params)
  order, buckets = reducer.buckets(leaves)
  ready, elapsed = [], 0.0
  for i in order:
    elapsed += profile.backward_flops[i] * examples_per_device / device_flops
    ready.append(elapsed)
  if not overlap:
    ready = [elapsed] * len(ready)
  candidates = _candidates(reducer)
  exact_names = [n for n in candidates if not strategies.get(n).compressed]
  sizes = [sum(int(np.prod(leaves[order[i]].shape)) for i in positions) for positions in buckets]
  singles = {name: reducer.with_strategy(name, compact_pairs) for name in candidates}

  durations = [
    {
      name: bucket_seconds(cost, one, n) + one.selection_elements(n) / cost.topk_elements_per_sec
      for name, one in singles.items()
    }
    for n in sizes
  ]
  bucket_ready = [ready[max(positions)] for positions in buckets]
  earliest, free = [], 0.0
  for r, d in zip(bucket_ready, durations):
    free = max(r, free) + min(d.values())
    earliest.append(free)

  latest, choices, reasons = earliest[-1], [None] * len(buckets), [""] * len(buckets)
  for b in reversed(range(len(buckets))):
    d = durations[b]
    exact, fastest = min(exact_names, key=d.get), min(candidates, key=d.get)
    start = max(bucket_ready[b], earliest[b - 1] if b else 0.0)
    if start + d[exact] <= latest * (1 + 1e-12):
      choices[b], why = exact, f"hidden ({1e3 * (latest - start - d[exact]):.2f} ms to spare)"
    else:
      choices[b], why = fastest, f"{1e3 * (d[exact] - d[fastest]):.2f} ms faster than {exact}, on the critical path"
    reasons[b] = f"{sizes[b]:,} elements: {choices[b]}, {why}"
    latest -= d[choices[b]]
  planned = dataclasses.replace(reducer, strategy="auto", choices=tuple(choices), compact_pairs=compact_pairs)
  return planned, reasons, earliest[-1]


def needs_cost(comm: ml_collections.ConfigDict) -> bool:
  """Whether ``plan_reducer`` times buckets with the cluster's costs: adaptive fusion and auto do."""
  return comm.fusion == "adaptive" or comm.strategy == AUTO


def replans_buckets_per_phase(comm: ml_collections.ConfigDict) -> bool:
  """Whether ``comm.fusion="adaptive"`` plans its buckets again for each phase of a run (a new batch or image
  size changes the backward times). Only a dense strategy's: a compressed strategy's buckets (or auto's, which
  may compress) carry residuals of their own shapes, so they are planned once, on the phase with the least compute
  per step (``EpochPlan.leanest_step``)."""
  return comm.fusion == "adaptive" and not may_select_top_k(comm.strategy)


def plan_reducer(
  reducer: Reducer,
  comm: ml_collections.ConfigDict,
  profile: fusion_lib.ParameterProfile,
  cost: ClusterCost | None,
  device_flops: float,
  examples_per_device: float,
  overlap: bool = True,
) -> tuple[Reducer, list[str]]:
  """``reducer`` planned as the config section ``comm`` asks, each part after what it depends on: MG-WFBP
  buckets first (``comm.fusion="adaptive"``), then on those buckets auto's strategy per bucket
  (``comm.strategy="auto"``) or the square-root k share (``comm.k_allocation="sqrt"``; the config refuses
  it with auto). ``cost`` may be None where ``needs_cost(comm)`` is False. Returns the reducer and auto's
  reason per bucket ([] without auto). The trainer (``CompiledSteps``) and the simulator both plan with this
  function, from the same inputs: ``comm.device_tflops`` and ``cost``'s top-k rate."""
  if cost is None and needs_cost(comm):
    raise ValueError("plan_reducer: adaptive fusion and comm.strategy=auto time buckets; pass the cluster's cost")
  reasons = []
  if comm.strategy == AUTO:
    # MG-WFBP merges buckets for one strategy's link costs, and auto's buckets then take several strategies: with
    # adaptive fusion, the buckets MG-WFBP plans for each candidate, and auto's plan on those where its step ends
    # first (planned for the dense strategy alone, auto ended later than hitopk alone).
    layouts = [reducer]
    if comm.fusion == "adaptive":
      layouts = [
        dataclasses.replace(
          plan_adaptive_fusion(reducer.with_strategy(name, comm.compact_pairs), profile, cost, device_flops,
                               examples_per_device),
          strategy=reducer.strategy,
          compact_pairs=reducer.compact_pairs,
        )
        for name in [reducer.strategy, *(n for n in _candidates(reducer) if n != reducer.strategy)]
      ]  # fmt: skip
    plans = [
      _plan_auto(layout, profile, cost, device_flops, examples_per_device, overlap, comm.compact_pairs)
      for layout in layouts
    ]
    reducer, reasons, _ = min(plans, key=lambda plan: plan[2])  # of equal ends, the first: hierarchical's layout
  elif comm.fusion == "adaptive":
    reducer = plan_adaptive_fusion(reducer, profile, cost, device_flops, examples_per_device)
  if comm.k_allocation == "sqrt":
    reducer = reducer.with_sqrt_allocation(profile.params)
  return reducer, reasons
