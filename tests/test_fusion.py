"""Fusion planning: fixed buckets, the MG-WFBP rule on hand-worked examples, profiling, cost model."""

import dataclasses
import json
import os
import sys

import jax
import numpy as np
import pytest

from light_jax.models import create_model
from light_jax.parallel import cost_model, fusion, strategies
from light_jax.parallel import reducer as reducer_lib


def test_mgwfbp_merges_everything_when_startup_dominates():
  # t_b = 1 s per layer, t_c = alpha = 10 s. Ready times 1, 2, 3.
  # i=0: S(0)=1, r=2 < 1+10 and r - S(0) = 1 < alpha -> merge 0 into 1.
  # i=1: S(1)=max(1+0, 2)=2, r=3 < 2+10 and 3-2 = 1 < alpha -> merge.
  assert fusion.plan_mgwfbp([1, 1, 1], [4, 4, 4], alpha=10.0, beta=0.0) == [[0, 1, 2]]


def test_mgwfbp_keeps_layers_apart_when_communication_is_cheap():
  # t_c = 0.1 s: each collective ends (S+0.1) before the next gradient is ready.
  assert fusion.plan_mgwfbp([1, 1, 1], [4, 4, 4], alpha=0.1, beta=0.0) == [[0], [1], [2]]


def test_mgwfbp_closes_a_group_when_the_next_gradient_comes_too_late():
  # t_b = (1, 0.2, 1), alpha = 0.5, beta = 0: ready at 1, 1.2, 2.2.
  # i=0: S(0)=1, r=1.2 < 1.5 and 1.2-1 = 0.2 < 0.5 -> merge 0 into 1.
  # i=1: S(1)=max(1+0, 1.2)=1.2, r=2.2 >= 1.2+0.5 -> close; position 2 alone.
  assert fusion.plan_mgwfbp([1, 0.2, 1], [4, 4, 4], alpha=0.5, beta=0.0) == [[0, 1], [2]]


def test_mgwfbp_with_bandwidth_term():
  # alpha = 0.1, beta = 0.01 s/byte; sizes 100, 10, 10 bytes -> t_c = 1.1, 0.2, 0.2; t_b = 1, 0.5, 2.
  # Ready at 1, 1.5, 3.5. i=0: S(0)=1, r=1.5 < 2.1; S(0) > r? no; r-S(0) = 0.5 >= alpha -> close.
  # i=1: S(1)=max(1+1.1, 1.5)=2.1 > r? r=3.5: 3.5 < 2.1+0.2? no -> close.
  assert fusion.plan_mgwfbp([1, 0.5, 2], [100, 10, 10], alpha=0.1, beta=0.01) == [[0], [1], [2]]
  # Same, but layer 1's gradient is ready while layer 0's collective has not started (queued behind
  # a long one): t_b = (1, 0.05, 0.05), sizes (10, 10, 10), alpha 0.1, beta 0.1 -> t_c = 1.1 each.
  # i=0: S(0)=1, r=1.05 < 2.1 and 1.05-1 < 0.1 -> merge. i=1: slot 1 now 20 bytes (t_c 2.1),
  # S(1)=max(1+0, 1.05)=1.05, r=1.1 < 3.15 and 1.1-1.05 < 0.1 -> merge.
  assert fusion.plan_mgwfbp([1, 0.05, 0.05], [10, 10, 10], alpha=0.1, beta=0.1) == [[0, 1, 2]]


def test_profile_gives_backward_order_and_flops():
  model = create_model("resnet8_small", 10, width=4)
  profile = fusion.profile_parameters(model, (28, 28, 1))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(profile.params)]
  backward = [paths[i] for i in profile.order]
  assert backward[0].startswith("['Dense_0']")  # the head's gradient is ready first
  assert backward[-1] == "['conv_init']['kernel']"  # the stem's last
  assert sorted(profile.order) == list(range(len(paths)))
  flops = dict(zip(paths, profile.backward_flops))
  # conv_init: 3x3x1x4 kernel at 28x28 output positions, x 4 (forward 2, backward 2 x forward... x 2).
  assert flops["['conv_init']['kernel']"] == 4.0 * 36 * 28 * 28
  assert flops["['Dense_0']['kernel']"] == 4.0 * 16 * 10


def test_adaptive_plan_on_resnet50_is_between_per_tensor_and_one_bucket():
  model = create_model("resnet50", 1000)
  profile = fusion.profile_parameters(model, (224, 224, 3))
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 16, 8, order=profile.order)
  # 32 images per V100 at 15 TFLOP/s: about 17 ms of backward pass to hide the communication in.
  slow = cost_model.plan_adaptive_fusion(reducer, profile, cost_model.PRESETS["v100_nvlink_25gbe"], 15e12, 32)
  fast = cost_model.plan_adaptive_fusion(reducer, profile, cost_model.PRESETS["h100_nvlink_ib"], 15e12, 32)
  n = len(profile.order)
  assert sorted(i for g in slow.groups for i in g) == list(range(n))
  assert 1 < len(slow.groups) < n and 1 < len(fast.groups) < n
  # The faster network leaves more room to communicate early: at least as many groups.
  assert len(fast.groups) >= len(slow.groups)


def test_adaptive_reduction_equals_reference():
  model = create_model("resnet8_small", 10, width=4)
  profile = fusion.profile_parameters(model, (16, 16, 1))
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 2, 4, order=profile.order)
  adaptive = cost_model.plan_adaptive_fusion(reducer, profile, cost_model.PRESETS["v100_nvlink_25gbe"], 1e9, 4)
  leaves = jax.tree.leaves(profile.params)
  order, buckets = adaptive.buckets(leaves)
  assert order == list(profile.order) and sorted(i for b in buckets for i in b) == list(range(len(leaves)))
  from jax.sharding import PartitionSpec as P

  from light_jax.parallel import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(2, 4)
  # numpy, not jax.random: no program compiled per tensor shape
  grads = jax.tree.map(
    lambda s: np.random.default_rng(s.size).standard_normal((8, *s.shape)).astype(np.float32), profile.params
  )
  out = jax.jit(
    jax.shard_map(
      lambda g: adaptive.reduce(jax.tree.map(lambda x: x[0], g), {})[0],
      mesh=mesh,
      in_specs=mesh_lib.BATCH_SPEC,
      out_specs=P(),
      check_vma=False,
    )
  )(jax.device_put(grads, mesh_lib.batch_sharding(mesh)))
  for got, g in zip(jax.tree.leaves(out), jax.tree.leaves(grads)):
    np.testing.assert_allclose(got, np.asarray(g).mean(axis=0), atol=1e-5)


def test_fit_link_recovers_alpha_and_beta():
  sizes = np.array([1e3, 1e5, 1e6, 1e7])
  link = cost_model.fit_link(sizes, 2e-5 + sizes / 3e9)
  assert link.alpha == pytest.approx(2e-5, rel=1e-6) and link.beta == pytest.approx(1 / 3e9, rel=1e-6)


def test_fit_link_needs_two_sizes_and_the_calibration_measures_two():
  """One size gave polyfit an arbitrary split: (16 KiB, 1 s) came out as alpha 0.5 s and beta 3e-5 s/B."""
  with pytest.raises(ValueError, match="two buffer sizes or more"):
    cost_model.fit_link([16384, 16384], [1.0, 1.1])
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import calibrate_links

  assert calibrate_links.level_sizes(2.0, 2**20, link_bytes_budget=1.0) == [4096, 8192]  # a budget for none
  assert calibrate_links.level_sizes(1.0, 2**14, None) == [4096, 8192, 16384]


def test_cost_model_json_round_trip_and_errors(tmp_path):
  path = tmp_path / "links.json"
  path.write_text(cost_model.PRESETS["h100_nvlink_ib"].to_json())
  assert cost_model.load(str(path)) == cost_model.PRESETS["h100_nvlink_ib"]
  assert json.loads(path.read_text())["inter"]["alpha"] == 10e-6
  with pytest.raises(ValueError, match="neither a preset"):
    cost_model.load(str(tmp_path / "missing.json"))


def test_modelled_hierarchical_beats_flat_dense_on_a_slow_network():
  cost = cost_model.PRESETS["v100_nvlink_25gbe"]
  d = 25_557_032
  dense = cost.reduction_seconds("dense", d, 16, 8)
  hier = cost.reduction_seconds("hierarchical", d, 16, 8)
  hitopk = cost.reduction_seconds("hitopk", d, 16, 8, k=-(-d // 8) // 1000)
  assert hitopk < hier < dense


def test_a_nodes_link_is_shared_by_its_devices_except_in_a_flat_ring():
  """Inter-node beta is per machine's link: the hierarchical step's ``local`` devices cross it at once,
  a flat ring with one device's traffic."""
  link = cost_model.LinkCost(alpha=1e-3, beta=1 / 1e6)
  cost = cost_model.ClusterCost(intra=cost_model.LinkCost(alpha=0.0, beta=0.0), inter=link)
  d, nodes, local = 1_000_000, 2, 4
  per_device = strategies.strategy_bytes("hierarchical", d, 4, nodes, local).inter_node
  assert cost.level_seconds("hierarchical", d, nodes, local)[1] == pytest.approx(1e-3 + local * per_device / 1e6)
  flat = strategies.strategy_bytes("dense", d, 4, nodes, local).inter_node
  assert cost.reduction_seconds("dense", d, nodes, local) == pytest.approx(1e-3 + flat / 1e6)
  buckets = [("hierarchical", d, 0), ("hierarchical", d // 2, 0)]
  intra, inter = cost.step_seconds(buckets, nodes, local)
  assert intra == 0.0 and inter == pytest.approx(2e-3 + 1.5 * local * per_device / 1e6, rel=1e-5)
  # bfloat16 on the wire halves the bytes.
  assert cost.step_seconds(buckets, nodes, local, wire_itemsize=2)[1] < 0.6 * inter


def test_auto_keeps_hidden_buckets_exact_and_compresses_where_the_link_is_slow():
  """comm.strategy="auto" on resnet50, 2 x 4: on a fast network every bucket's exact reduction hides behind
  the backward pass; on a slow one the big buckets go compressed, and the modelled step is no slower than
  the best single strategy's."""
  model = create_model("resnet50", 1000)
  profile = fusion.profile_parameters(model, (224, 224, 3))
  base = reducer_lib.make_gradient_reducer(
    "hierarchical", 2, 4, "fixed", density=0.01, order=profile.order, bucket_bytes=4 * 2**20
  )
  free = cost_model.LinkCost(alpha=0.0, beta=0.0)
  fast = cost_model.ClusterCost(intra=free, inter=cost_model.LinkCost(alpha=1e-6, beta=1 / 1e12))
  slow = cost_model.ClusterCost(intra=free, inter=cost_model.LinkCost(alpha=1e-4, beta=1 / 1e9))
  chosen = {}
  for name, cost in (("fast", fast), ("slow", slow)):
    chosen[name], reasons = cost_model.plan_auto(base, profile, cost, 100e12, 64)
    assert len(reasons) == len(chosen[name].choices) > 4 and chosen[name].strategy == "auto"
  compressed = {k: sum(strategies.get(c).compressed for c in r.choices) for k, r in chosen.items()}
  # Fast: most buckets end before the next one is ready and stay exact; slow: most go compressed.
  assert compressed["fast"] <= len(chosen["fast"].choices) // 4 < len(chosen["slow"].choices) // 2 <= compressed["slow"]
  # The compiled step's log line says how many (it said "top-k density 0.01" where the plan chose none).
  assert (
    chosen["slow"].compression == f"top-k density 0.01 in {compressed['slow']} of {len(chosen['slow'].choices)} buckets"
  )
  exact = dataclasses.replace(chosen["slow"], choices=("hierarchical",) * len(chosen["slow"].choices))
  assert exact.compression == "" and base.compression == ""
  # The choice flips where the model says: the exact reduction of the first bucket ends after the backward.
  from light_jax import simulation

  def step_seconds(reducer, cost):
    backward = [profile.backward_flops[i] * 64 / 100e12 for i in profile.order]
    buckets = simulation.bucket_comms(reducer, profile.params)
    return simulation.simulate_step(cost, 2, 4, buckets, 0.0, backward).total

  singles = [dataclasses.replace(base, strategy=s) for s in ("dense", "hierarchical", "hitopk", "gtopk")]
  for name, cost in (("fast", fast), ("slow", slow)):
    assert step_seconds(chosen[name], cost) <= min(step_seconds(r, cost) for r in singles) * 1.0001


def test_auto_plans_its_candidates_with_compact_pairs_from_the_config():
  """comm.strategy="auto" with comm.compact_pairs: the cost model times the top-k strategies with compact pairs,
  and the buckets that take them send them; on a slow link that makes the step's bytes fewer."""
  from light_jax import config as config_lib

  model = create_model("resnet8_small", 10, width=4)
  profile = fusion.profile_parameters(model, (28, 28, 1))
  slow = cost_model.ClusterCost(
    intra=cost_model.LinkCost(alpha=0.0, beta=0.0), inter=cost_model.LinkCost(alpha=1e-6, beta=1 / 1e6)
  )
  comm = config_lib.base_config().comm
  comm.update(strategy="auto", fusion="none", density=0.01, min_compress_elements=16)
  planned = {}
  for compact in (False, True):
    comm.compact_pairs = compact
    base = reducer_lib.reducer_from_config(comm, 2, 4, profile.order)
    assert base.strategy == "hierarchical" and not base.compact_pairs  # a placeholder until planned
    planned[compact], _ = cost_model.plan_reducer(base, comm, profile, slow, 1e12, 4)
  ours = planned[True]
  assert ours.compact_pairs and any(strategies.sends_compact_pairs(c) for c in ours.choices)
  for b, choice in enumerate(ours.choices):
    assert ours.bucket_reducer(b).compact_pairs == strategies.sends_compact_pairs(choice)
  bytes_ = {c: r.bytes_per_step(profile.params).inter_node for c, r in planned.items()}
  assert bytes_[True] < 0.75 * bytes_[False]


def test_plan_reducer_plans_buckets_then_auto_or_the_sqrt_share():
  """cost_model.plan_reducer, which the trainer and the simulator share, is the planners in the order each
  needs the one before: fusion first, then auto per bucket or the square-root k share (the config refuses
  the two together); with none of them configured it needs no cluster costs and returns the reducer as built."""
  from light_jax import config as config_lib

  model = create_model("resnet8_small", 10, width=4)
  profile = fusion.profile_parameters(model, (28, 28, 1))
  cost = cost_model.PRESETS["v100_nvlink_25gbe"]
  comm = config_lib.base_config().comm
  comm.update(strategy="hitopk", fusion="adaptive", k_allocation="sqrt", density=0.01, min_compress_elements=16)
  base = reducer_lib.reducer_from_config(comm, 2, 4, profile.order)
  planned, reasons = cost_model.plan_reducer(base, comm, profile, cost, 1e9, 4)
  by_hand = cost_model.plan_adaptive_fusion(base, profile, cost, 1e9, 4).with_sqrt_allocation(profile.params)
  assert planned == by_hand and reasons == [] and planned.groups and planned.sqrt_crossover_size > 0
  # The share is computed on the planned buckets: on the buckets before fusion it would differ.
  too_early = cost_model.plan_adaptive_fusion(base.with_sqrt_allocation(profile.params), profile, cost, 1e9, 4)
  assert too_early.sqrt_crossover_size != pytest.approx(planned.sqrt_crossover_size, rel=1e-3)

  comm.update(strategy="auto", k_allocation="proportional")
  base = reducer_lib.reducer_from_config(comm, 2, 4, profile.order)
  planned, reasons = cost_model.plan_reducer(base, comm, profile, cost, 1e9, 4, overlap=False)
  by_hand = cost_model.plan_adaptive_fusion(base, profile, cost, 1e9, 4)
  assert (planned, reasons) == cost_model.plan_auto(by_hand, profile, cost, 1e9, 4, overlap=False)
  assert len(reasons) == len(planned.groups) == len(planned.choices) and planned.sqrt_crossover_size == 0

  comm.update(strategy="hitopk", fusion="none")
  base = reducer_lib.reducer_from_config(comm, 2, 4, profile.order)
  assert not cost_model.needs_cost(comm)
  assert cost_model.plan_reducer(base, comm, profile, None, 1e9, 4) == (base, [])
  comm.update(fusion="adaptive")  # times buckets: without the cluster's costs it says what is missing
  assert cost_model.needs_cost(comm)
  with pytest.raises(ValueError, match="pass the cluster's cost"):
    cost_model.plan_reducer(base, comm, profile, None, 1e9, 4)
