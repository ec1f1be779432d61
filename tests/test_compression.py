"""Top-k selectors, error feedback and the compressed strategies' traffic."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from light_jax import schedules
from light_jax.parallel import compression, strategies
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from tests.test_collectives import assert_replicas_agree


def _heavy_tailed(n, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_t(df=2, size=n), jnp.float32)


@pytest.mark.parametrize("n,k", [(1000, 10), (4096, 1), (5000, 500), (777, 777)])
def test_exact_topk_keeps_the_largest_magnitudes(n, k):
  x = _heavy_tailed(n, 0)
  indices, values = compression.exact_topk(x, k)
  expected = np.sort(np.argsort(-np.abs(np.asarray(x)))[:k])
  np.testing.assert_array_equal(np.sort(np.asarray(indices)), expected)
  np.testing.assert_array_equal(values, np.asarray(x)[np.asarray(indices)])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n,density", [(100_000, 0.001), (100_000, 0.01), (20_000, 0.1), (3_000, 0.5)])
def test_mstopk_returns_exactly_k_distinct_indices_within_its_mass_bound(seed, n, density):
  x = _heavy_tailed(n, seed)
  k = compression.num_selected(n, density)
  indices, values = jax.jit(compression.mstopk, static_argnums=1)(x, k)
  indices = np.asarray(indices)
  assert indices.shape == (k,) and len(set(indices.tolist())) == k
  np.testing.assert_array_equal(values, np.asarray(x)[indices])
  exact_mass = float(jnp.abs(compression.exact_topk(x, k)[1]).sum())
  approx_mass = float(jnp.abs(values).sum())
  a = np.abs(np.asarray(x))
  # The documented bound: k * (max - min) * 2**-rounds (min <= the search's lower end).
  bound = k * (a.max() - a.min()) * 2.0**-compression.MSTOPK_ROUNDS
  assert exact_mass - approx_mass <= bound + 1e-6 * exact_mass
  assert approx_mass >= 0.999 * exact_mass


def test_mstopk_with_ties_still_gives_k():
  x = jnp.concatenate([jnp.ones(50), jnp.zeros(950)])
  indices, _ = compression.mstopk(x, 20)
  assert len(set(np.asarray(indices).tolist())) == 20 and float(x[indices].sum()) == 20.0
  indices, _ = compression.mstopk(jnp.zeros(100), 7)
  assert len(set(np.asarray(indices).tolist())) == 7


def test_num_selected_takes_the_density_as_written():
  # 0.07 * 100 is 7.000000000000001 in binary floating point: a plain ceil kept 8.
  assert compression.num_selected(100, 0.07) == 7
  assert compression.num_selected(25_600_000, 0.07) == 1_792_000
  assert compression.num_selected(1000, 0.001) == 1 and compression.num_selected(1001, 0.001) == 2
  assert compression.num_selected(10, 1e-9) == 1 and compression.num_selected(10, 1.0) == 10


def test_density_warmup_phases():
  assert schedules.density_at(0, 0.001, 100) == 0.25
  assert schedules.density_at(99, 0.001, 100) == pytest.approx(0.25 * (0.001 / 0.25) ** 0.75)
  assert schedules.density_at(100, 0.001, 100) == 0.001
  assert schedules.density_at(0, 0.001, 0) == 0.001
  assert len({schedules.density_at(s, 0.001, 100) for s in range(200)}) == 5  # 4 phases + target


def test_final_density_phase_follows_the_warmup_and_the_target():
  final = (150, 0.004)
  densities = [schedules.density_at(s, 0.001, 100, final=final) for s in range(200)]
  assert densities[:100] == [schedules.density_at(s, 0.001, 100) for s in range(100)]  # the warm-up as before
  assert set(densities[100:150]) == {0.001} and set(densities[150:]) == {0.004}
  assert schedules.density_at(10, 0.001, 0, final=(5, 0.01)) == 0.01  # without a warm-up too


def _run_steps(strategy, shape, grads, density, error_feedback=True, selector="exact", lrs=None, **options):
  """Reduces each step's per-device vectors (T, devices, d); returns (outputs (T, d), final state), each
  output checked to be the same on every device.

  ``lrs``: a learning rate per step; the residuals then go into its units before each step, as the train
  step does with ``comm.residual_units="update"``."""
  mesh = mesh_lib.make_mesh(*shape)
  reducer = reducer_lib.make_gradient_reducer(
    strategy,
    *shape,
    density=density,
    selector=selector,
    error_feedback=error_feedback,
    min_compress_elements=1,
    **options,
  )
  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)
  params = {"w": jnp.zeros(grads.shape[-1])}
  state = jax.device_put(reducer.init_state(params), NamedSharding(mesh, per_device))
  step = jax.jit(
    jax.shard_map(
      lambda g, s, factor: reducer.reduce({"w": g[0]}, reducer.rescale_residuals(s, factor)),
      mesh=mesh,
      in_specs=(mesh_lib.BATCH_SPEC, per_device, P()),
      out_specs=(P(), per_device),
      check_vma=False,
    )
  )
  factors = np.ones(len(grads)) if lrs is None else [1.0, *(np.asarray(lrs[:-1]) / np.asarray(lrs[1:]))]
  outputs = []
  for g, factor in zip(grads, factors):
    out, state = step(jax.device_put(g, mesh_lib.batch_sharding(mesh)), state, jnp.float32(factor))
    assert_replicas_agree(out)
    outputs.append(np.asarray(out["w"]))
  return np.stack(outputs), jax.device_get(state), reducer


@pytest.mark.parametrize(
  "strategy,shape,compact",
  [
    ("hitopk", (2, 4), False),
    ("hitopk", (4, 2), False),
    ("topk", (2, 4), False),
    ("gtopk", (2, 4), False),
    ("gtopk", (4, 2), False),
    ("hitopk", (2, 4), True),
    ("topk", (2, 4), True),
    ("gtopk", (2, 4), True),
    ("hitopk", (8, 1), "bfloat16 hops"),  # no hop inside a machine of one device: nothing rounded
  ],
)
def test_error_feedback_conserves_gradient_mass(strategy, shape, compact):
  """``compact``: bfloat16 values on the wire, what rounding drops kept in the residual: still nothing lost.
  "bfloat16 hops" (comm.dtype): the dense hops round what they carry, outside the residual; on a mesh whose axis
  has one device there is no such hop, and nothing may be rounded."""
  steps, d = 6, 1001
  grads = np.asarray(np.random.default_rng(1).standard_t(df=2, size=(steps, 8, d)), np.float32)
  options = {"wire_dtype": "bfloat16"} if compact == "bfloat16 hops" else {"compact_pairs": compact}
  outputs, state, reducer = _run_steps(strategy, shape, grads, density=0.05, **options)
  (residual,) = state.values()  # (nodes, local, residual size)
  nodes, local = shape
  if strategy == "hitopk":  # device (i, j) holds shard j of node i's sum
    leftover = residual.sum(axis=0).reshape(-1)[:d]
  else:  # topk, gtopk: every device holds a full-size residual
    leftover = residual.sum(axis=(0, 1))
  true_sum = grads.sum(axis=(0, 1)) / 8  # sum over steps of the true mean gradient
  np.testing.assert_allclose(outputs.sum(axis=0) + leftover / 8, true_sum, atol=2e-5)
  # Compression really dropped mass each step (otherwise the identity is trivial).
  assert np.abs(leftover).sum() > 0.1 * np.abs(true_sum).sum()


@pytest.mark.parametrize("strategy,shape", [("hitopk", (2, 4)), ("topk", (2, 4)), ("gtopk", (4, 2))])
def test_residuals_in_update_units_conserve_the_learning_rate_weighted_sum(strategy, shape):
  """comm.residual_units="update": with a decaying learning rate, what the optimizer applies (lr(t) x the
  reduced gradient) plus lr(T) x the final residuals is sum lr(t) g(t), every gradient at its own step's
  rate. DGC's gradient units conserve the plain sum instead, so they apply late entries at a lower rate."""
  steps, d = 6, 1001
  grads = np.asarray(np.random.default_rng(4).standard_t(df=2, size=(steps, 8, d)), np.float32)
  lrs = np.asarray([0.5, 1.0, 0.8, 0.4, 0.2, 0.05], np.float32)  # warm-up, then decay
  intended = np.einsum("t,td->d", lrs, grads.sum(axis=1) / 8)

  def applied(outputs, state):
    (residual,) = state.values()
    leftover = residual.sum(axis=0).reshape(-1)[:d] if strategy == "hitopk" else residual.sum(axis=(0, 1))
    return np.einsum("t,td->d", lrs, outputs) + lrs[-1] * leftover / 8

  update_units = applied(*_run_steps(strategy, shape, grads, density=0.05, lrs=lrs)[:2])
  np.testing.assert_allclose(update_units, intended, atol=5e-5)
  gradient_units = applied(*_run_steps(strategy, shape, grads, density=0.05)[:2])
  assert np.abs(gradient_units - intended).max() > 0.05


def test_residual_rescale_is_the_ratio_of_consecutive_learning_rates():
  factor = schedules.residual_rescale(lambda step: jnp.asarray([0.0, 1.0, 3.0, 1.5, 0.0], jnp.float32)[step])
  np.testing.assert_allclose([float(factor(s)) for s in range(5)], [1.0, 0.0, 1 / 3, 2.0, 1.0])


def test_rescaling_under_momentum_correction_leaves_the_velocities():
  reducer = reducer_lib.make_gradient_reducer("hitopk", 2, 4, momentum_correction=0.9, min_compress_elements=8)
  state = reducer.init_state({"big": jnp.zeros(64), "small": jnp.zeros(4)})
  state = jax.tree.map(lambda x: x + 1.0, state)
  rescaled = reducer.rescale_residuals(state, 0.5)
  memories = [m for m in rescaled.values() if isinstance(m, compression.Memory)]
  velocities = [v for v in rescaled.values() if not isinstance(v, compression.Memory)]
  assert len(memories) == 1 and len(velocities) == 1
  assert float(memories[0].residual.max()) == 0.5 and float(memories[0].velocity.min()) == 1.0
  assert float(velocities[0].min()) == 1.0  # the dense bucket's velocity


def test_without_error_feedback_mass_is_lost_and_no_residual_is_kept():
  grads = np.asarray(np.random.default_rng(2).normal(size=(3, 8, 800)), np.float32)
  outputs, state, _ = _run_steps("hitopk", (2, 4), grads, density=0.05, error_feedback=False)
  assert state and all(r is None for r in state.values())  # no device memory of the gradient's size
  assert np.abs(outputs.sum(axis=0) - grads.sum(axis=(0, 1)) / 8).max() > 0.01


@pytest.mark.parametrize("selector", ["exact", "mstopk"])
def test_hitopk_sends_at_most_k_entries_per_shard_per_node(selector):
  """Each node sums its devices' gradients, keeps k entries of each device's shard of that sum, and the
  kept entries of both nodes are added: the mean of the selected node sums (numpy reference)."""
  nodes, local, d = 2, 4, 4000
  grads = np.asarray(np.random.default_rng(3).normal(size=(1, 8, d)), np.float32)
  outputs, _, reducer = _run_steps("hitopk", (nodes, local), grads, density=0.01, selector=selector)
  k = compression.num_selected(d // local, 0.01)
  assert k == 10
  node_sums = grads[0].reshape(nodes, local, d).sum(axis=1)  # devices are node-major on the mesh
  shards = node_sums.reshape(nodes, local, d // local)
  top = np.argsort(-np.abs(shards), axis=-1)[..., :k]  # exact top-k of each node's shard
  kept = np.zeros_like(shards)
  np.put_along_axis(kept, top, np.take_along_axis(shards, top, axis=-1), axis=-1)
  exact = kept.reshape(nodes, d).sum(axis=0) / (nodes * local)
  ours = np.asarray(outputs[0])
  assert 0 < np.count_nonzero(ours) <= nodes * k * local
  if selector == "exact":
    np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-6)
  else:  # a threshold search: its own entries, but each one a sum of true node-summed values
    sent = ours != 0
    choices = np.stack([node_sums[0], node_sums[1], node_sums.sum(axis=0)]) / (nodes * local)
    assert np.all(np.min(np.abs(choices[:, sent] - ours[sent]), axis=0) < 1e-5)
    assert np.abs(ours).sum() >= 0.9 * np.abs(exact).sum()  # and about as large as exact top-k's


def test_compressed_byte_accounting_matches_the_formulas():
  # d = 25,600,000 float32 (ResNet-50-sized bucket), N=2 nodes x n=4, density 0.001 (docs/techniques.md section 1).
  d, nodes, local, density = 25_600_000, 2, 4, 0.001
  reducer = reducer_lib.make_gradient_reducer("hitopk", nodes, local, fusion="fixed", bucket_bytes=0, density=density)
  params = {"w": jax.ShapeDtypeStruct((d,), jnp.float32)}
  got = reducer.bytes_per_step(params)
  k = int(np.ceil(density * d / local))
  assert k == 6400
  assert got.inter_node == (nodes - 1) * k * 8 == 51_200
  assert got.intra_node == 2 * (local - 1) * (d // local) * 4
  dense_hier = reducer_lib.make_gradient_reducer("hierarchical", nodes, local, "fixed", 0).bytes_per_step(params)
  assert dense_hier.inter_node == 2 * (nodes - 1) * (d // local) * 4 // nodes == 25_600_000
  assert dense_hier.inter_node / got.inter_node == 500.0  # hitopk at 0.1%: 500x fewer bytes across nodes, from shapes
  flat = reducer_lib.make_gradient_reducer("topk", nodes, local, "fixed", 0, density=density).bytes_per_step(params)
  assert flat.inter_node == (nodes * local - 1) * 25_600 * 8
  # gTop-k: log2(N) = 1 round across nodes and log2(n) = 2 inside, k = 25,600 pairs each, then a ring
  # all-reduce of the k float32 sums over all 8 devices (2 x 7/8 x k x 4 bytes).
  gtopk = reducer_lib.make_gradient_reducer("gtopk", nodes, local, "fixed", 0, density=density).bytes_per_step(params)
  assert gtopk.inter_node == 1 * 25_600 * 8 + 2 * 7 * 25_600 * 4 // 8 == 384_000
  assert gtopk.intra_node == 2 * 25_600 * 8 + 2 * 7 * 25_600 * 4 // 8 == 588_800


def _lowered_reduction(reducer, d: int) -> str:
  """The StableHLO text of ``reducer`` reducing one d-entry vector per device on a 2 x 4 mesh."""
  mesh = mesh_lib.make_mesh(2, 4)
  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)
  step = jax.shard_map(
    lambda g, s: reducer.reduce({"w": g[0]}, s),
    mesh=mesh,
    in_specs=(mesh_lib.BATCH_SPEC, per_device),
    out_specs=(P(), per_device),
    check_vma=False,
  )
  state = jax.device_put(reducer.init_state({"w": jnp.zeros(d)}), NamedSharding(mesh, per_device))
  return jax.jit(step).lower(jnp.zeros((8, d)), state).as_text()


def test_compact_pairs_cost_4_bytes_and_a_count_per_block_above_65536_entries():
  """comm.compact_pairs: a bfloat16 value (2 bytes) and a uint16 index (2); a top-k unit of more than 65,536
  entries also sends an int32 count of pairs per 65,536-entry block. The lowered step really sends them."""
  nodes, local, density = 2, 4, 0.001

  def inter_node(strategy, d, compact):
    reducer = reducer_lib.make_gradient_reducer(
      strategy, nodes, local, "fixed", 0, density=density, compact_pairs=compact
    )
    return reducer.bytes_per_step({"w": jax.ShapeDtypeStruct((d,), jnp.float32)}).inter_node

  # ResNet-50-sized bucket: 6.4M entries per shard, k = 6,400, 98 blocks: 4 bytes per pair + 392.
  assert inter_node("hitopk", 25_600_000, False) == 6400 * 8
  assert inter_node("hitopk", 25_600_000, True) == 6400 * 4 + 98 * 4
  # 262,144 entries: shards of 65,536 need no counts (k = 66); the whole vector topk selects from has 4 blocks.
  assert inter_node("hitopk", 262_144, True) == 66 * 4 == inter_node("hitopk", 262_144, False) // 2
  assert inter_node("topk", 262_144, True) == 7 * (263 * 4 + 4 * 4)
  assert inter_node("hitopk", 262_148, True) == 66 * 4 + 2 * 4  # one more entry per shard (65,537): 2 blocks
  # gtopk: one merge round across the 2 nodes (k = 263 pairs, 4 blocks), then the k exact float32 sums.
  sums = 2 * 7 * 263 * 4 // 8
  assert inter_node("gtopk", 262_144, True) == 263 * 4 + 4 * 4 + sums
  assert inter_node("gtopk", 262_144, False) == 263 * 8 + sums

  def gathered(compact, d):  # the dtype and shape of each all-gather's result
    reducer = reducer_lib.make_gradient_reducer("hitopk", nodes, local, density=0.01, compact_pairs=compact)
    return sorted(re.findall(r"all_gather.*-> (tensor<[^>]*>)", _lowered_reduction(reducer, d)))

  # 4,000 entries: shards of 1,000, k = 10 across 2 nodes; the bfloat16 values move as their 16 bits
  assert gathered(True, 4000) == ["tensor<2x10xui16>", "tensor<2x10xui16>", "tensor<4000xf32>"]
  assert gathered(False, 4000) == ["tensor<2x10xf32>", "tensor<2x10xi32>", "tensor<4000xf32>"]
  # 560,000: shards of 140,000 (3 blocks), k = 1,400, and the 3 blocks' counts
  assert gathered(True, 560_000) == [
    "tensor<2x1400xui16>",
    "tensor<2x1400xui16>",
    "tensor<2x3xi32>",
    "tensor<560000xf32>",
  ]


def test_block_offsets_and_counts_give_back_the_indices():
  """``group_by_block`` / ``indices_from_blocks``: any index set of a long vector, empty blocks, a partial
  last block, all in one block, comes back whole, each with its value."""
  rng = np.random.default_rng(11)
  size = 3 * compression.COMPACT_BLOCK + 1000
  blocks = compression.index_blocks(size, compact=True)
  assert blocks == 4 and compression.index_blocks(compression.COMPACT_BLOCK, compact=True) == 0
  cases = [
    rng.choice(size, 500, replace=False),
    rng.choice(np.arange(compression.COMPACT_BLOCK, 2 * compression.COMPACT_BLOCK), 300, replace=False),
    np.array([size - 1, 0, compression.COMPACT_BLOCK, compression.COMPACT_BLOCK - 1]),
    np.array([3 * compression.COMPACT_BLOCK + 7]),
  ]
  for indices in cases:
    values = rng.normal(size=indices.size).astype(np.float32)
    offsets, grouped, counts = compression.group_by_block(jnp.asarray(indices, jnp.int32), jnp.asarray(values), blocks)
    assert offsets.dtype == jnp.uint16 and counts.dtype == jnp.int32 and counts.shape == (blocks,)
    np.testing.assert_array_equal(counts, np.bincount(indices // compression.COMPACT_BLOCK, minlength=blocks))
    rebuilt = np.asarray(compression.indices_from_blocks(offsets, counts))
    assert dict(zip(rebuilt.tolist(), np.asarray(grouped).tolist())) == dict(zip(indices.tolist(), values.tolist()))


def test_dense_strategies_send_no_compact_pairs():
  for strategy in ("hierarchical", "dense"):
    with pytest.raises(ValueError, match=f"compact pairs: strategy '{strategy}' cannot send them"):
      reducer_lib.make_gradient_reducer(strategy, 2, 4, compact_pairs=True)


@pytest.mark.parametrize("shape", [(2, 4), (8, 1), (1, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gtopk_keeps_one_global_set_with_exact_sums(shape):
  """Every device ends with the same k indices; each value is the exact sum over devices there."""
  d, density = 2000, 0.01
  k = compression.num_selected(d, density)
  rng = np.random.default_rng(4)
  # Identical gradients on every device: the global top-k of the sum is the top-k of one of them.
  same = np.broadcast_to(rng.standard_t(df=2, size=d).astype(np.float32), (1, 8, d))
  outputs, _, _ = _run_steps("gtopk", shape, np.ascontiguousarray(same), density, error_feedback=False)
  expected = np.zeros(d, np.float32)
  top = np.argsort(-np.abs(same[0, 0]))[:k]
  expected[top] = same[0, 0, top]
  np.testing.assert_allclose(outputs[0], expected, rtol=1e-6)
  # Different gradients: at most k entries, each the exact mean over the 8 devices at that index.
  grads = rng.standard_t(df=2, size=(1, 8, d)).astype(np.float32)
  outputs, _, _ = _run_steps("gtopk", shape, grads, density, error_feedback=False)
  kept = np.flatnonzero(outputs[0])
  assert 0 < kept.size <= k
  np.testing.assert_allclose(outputs[0, kept], grads[0, :, kept].mean(axis=1), rtol=1e-5, atol=1e-6)
  # And the set is mostly the true top-k of the sum (the merge is greedy, so not always all of it).
  true_top = set(np.argsort(-np.abs(grads[0].sum(axis=0)))[:k])
  assert len(true_top & set(kept)) >= k // 2


@pytest.mark.parametrize("d", [2000, 140_000], ids=["short", "three_blocks"])
def test_gtopk_with_compact_pairs_ranks_in_bfloat16_and_sums_exactly(d):
  """comm.compact_pairs for gtopk: the merge rounds' pairs cross as bfloat16 values and uint16 indices (block
  offsets and counts over 65,536 entries), so the winners may differ from float32's only on near-ties; every
  device still ends with one set, and the values there are the exact float32 means, not rounded ones."""
  density = 0.01
  k = compression.num_selected(d, density)
  grads = np.random.default_rng(5).standard_t(df=2, size=(1, 8, d)).astype(np.float32)
  compact, _, _ = _run_steps("gtopk", (2, 4), grads, density, error_feedback=False, compact_pairs=True)
  wide, _, _ = _run_steps("gtopk", (2, 4), grads, density, error_feedback=False)
  kept = np.flatnonzero(compact[0])
  assert 0 < kept.size <= k
  np.testing.assert_allclose(compact[0, kept], grads[0, :, kept].mean(axis=1), rtol=1e-6, atol=1e-7)
  assert len(set(kept) & set(np.flatnonzero(wide[0]))) >= 0.9 * kept.size  # the same set but for near-ties

  reducer = reducer_lib.make_gradient_reducer("gtopk", 2, 4, density=density, compact_pairs=True)
  permuted = re.findall(r"collective_permute.*-> (tensor<[^>]*>)", _lowered_reduction(reducer, d))
  blocks = compression.index_blocks(d, compact=True)
  # Per round: the uint16 indices, the bfloat16 values as their 16 bits, and the blocks' counts
  rounds = (2 * 4).bit_length() - 1
  one_round = [f"tensor<{k}xui16>"] * 2 + ([f"tensor<{blocks}xi32>"] if blocks else [])
  assert sorted(permuted) == sorted(one_round * rounds)


def test_small_buckets_go_dense():
  reducer = reducer_lib.make_gradient_reducer("hitopk", 2, 4, density=0.01, min_compress_elements=512)
  params = {"bias": jnp.zeros(64), "kernel": jnp.zeros((64, 64))}
  state = reducer.init_state(params)
  assert [v.shape for v in state.values()] == [(2, 4, 1024)]  # only the kernel: 4096 / 4 local
  assert reducer.bytes_per_step({"bias": params["bias"]}) == strategies.strategy_bytes("hierarchical", 64, 4, 2, 4)


def test_sqrt_allocation_keeps_the_total_and_favours_small_tensors():
  # Conv kernels of resnet8_fast's sizes, one of each size, per tensor, on 2 x 4 devices (shards of a quarter
  # each); the model has a second 3x3x32x32 kernel, hence its 2.4x where this set gets 2.6x.
  shapes = [(3, 3, 32, 32), (3, 3, 32, 64), (3, 3, 64, 64), (3, 3, 64, 128), (3, 3, 128, 128), (1, 1, 64, 128)]
  params = {f"conv{i}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}
  params["bias"] = jax.ShapeDtypeStruct((128,), jnp.float32)  # dense either way
  proportional = reducer_lib.make_gradient_reducer("hitopk", 2, 4, density=0.001)
  sqrt = proportional.with_sqrt_allocation(params)
  units = [int(np.prod(s)) // 4 for s in shapes]
  assert sqrt.sqrt_crossover_size == pytest.approx((sum(units) / sum(np.sqrt(units))) ** 2)
  ks = {n: k for _, n, k in sqrt.bucket_plan(params)}
  by_size = {n: k for _, n, k in proportional.bucket_plan(params)}
  assert by_size[9216] == 3 and ks[9216] == 7  # 2,304 per shard: 6.03 rounded up, 2.6x its share
  assert by_size[147456] == 37 and ks[147456] == 25  # 36,864 per shard: 0.65x its share
  assert ks[128] == by_size[128] == 0  # the bias goes dense
  # The same budget: within the rounding up of each k.
  assert abs(sum(ks.values()) - 0.001 * sum(units)) <= len(shapes)
  assert sqrt.bytes_per_step(params).inter_node < 1.1 * proportional.bytes_per_step(params).inter_node
  # Near density 1 the small units' shares pass their size: they send whole, and the total falls short.
  capped = {n: k for _, n, k in sqrt.at_density(0.9).bucket_plan(params)}
  assert capped[9216] == 9216 // 4 and capped[147456] < 0.9 * 147456 // 4
  assert sum(capped.values()) < 0.9 * sum(units)


def _to_bfloat16(x):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _dgc_reference(vectors, k, momentum, nesterov=False, masking=True, wire=lambda x: x):
  """DGC on each row of ``vectors`` (T, rows, n) in numpy: u <- m u + g, v <- v + u (Nesterov, as DGC's
  code: u <- m (u + g), v <- v + u + g), send top-k of v as ``wire`` rounds it, keep in v what the rounding
  dropped (zero without rounding), zero (``masking``) u where sent. Returns what each row sent per step,
  (T, rows, n)."""
  u = np.zeros(vectors.shape[1:], np.float64)
  v = np.zeros_like(u)
  sent = np.zeros(vectors.shape, np.float64)
  for t, g in enumerate(vectors):
    if nesterov:
      u = momentum * (u + g)
      v = v + u + g
    else:
      u = momentum * u + g
      v = v + u
    for row in range(v.shape[0]):
      top = np.argsort(-np.abs(v[row]))[:k]
      sent[t, row, top] = wire(v[row, top])
      v[row, top] -= sent[t, row, top]
      if masking:
        u[row, top] = 0.0
  return sent


@pytest.mark.parametrize(
  "strategy,shape,nesterov,masking,compact",
  [
    ("topk", (2, 4), False, True, False),
    ("hitopk", (2, 4), False, True, False),
    ("hitopk", (4, 2), False, True, False),
    ("hitopk", (2, 4), True, True, False),
    ("topk", (2, 4), True, False, False),
    ("hitopk", (4, 2), True, False, False),
    ("hitopk", (2, 4), True, True, True),
    ("hitopk", (4, 2), False, False, True),
    ("topk", (2, 4), True, True, True),
  ],
)
def test_momentum_correction_matches_dgc_in_numpy(strategy, shape, nesterov, masking, compact):
  """``compact``: comm.compact_pairs, each sent value rounded to bfloat16 and the rounding kept in v."""
  steps, d, density, momentum = 5, 800, 0.02, 0.9
  nodes, local = shape
  grads = np.asarray(np.random.default_rng(5).normal(size=(steps, 8, d)), np.float32)
  options = dict(momentum_correction=momentum, nesterov=nesterov, momentum_masking=masking)
  outputs, state, _ = _run_steps(strategy, shape, grads, density, compact_pairs=compact, **options)
  wire = _to_bfloat16 if compact else lambda x: x
  if strategy == "topk":  # every device selects from its own whole gradient
    k = compression.num_selected(d, density)
    expected = _dgc_reference(grads.astype(np.float64), k, momentum, nesterov, masking, wire).sum(axis=1) / 8
  else:  # device (i, j) selects from shard j of node i's summed gradient
    node_sums = grads.reshape(steps, nodes, local, d).sum(axis=2)
    shards = node_sums.reshape(steps, nodes * local, d // local)
    sent = _dgc_reference(shards, compression.num_selected(d // local, density), momentum, nesterov, masking, wire)
    expected = sent.reshape(steps, nodes, d).sum(axis=1) / 8
  np.testing.assert_allclose(outputs, expected, rtol=1e-4, atol=1e-5)
  (memory,) = state.values()
  assert isinstance(memory, compression.Memory) and np.abs(memory.velocity).max() > 0
  # Momentum changes what is sent: plain error feedback sends something else.
  plain, _, _ = _run_steps(strategy, shape, grads, density)
  assert np.abs(plain - outputs).max() > 1e-3
  if compact:  # the rounding is real: float32 pairs send other values (by up to 2^-9 of each)
    float32, _, _ = _run_steps(strategy, shape, grads, density, **options)
    assert 0 < np.abs(float32 - outputs).max() < 2**-7 * np.abs(float32).max()


@pytest.mark.parametrize(
  "strategy,shape,density,compact",
  [
    ("hitopk", (4, 2), 0.3, False),  # pairs cost more than the shard above 1/4 of it on 4 nodes
    ("hitopk", (4, 2), 0.6, True),  # compact pairs above 2/4
    ("topk", (2, 4), 0.2, False),  # over all 8 devices: above 1/8
  ],
)
def test_a_density_whose_pairs_cost_more_than_the_vector_sums_it_densely_with_the_same_result(
  strategy, shape, density, compact
):
  """A density warm-up's first phases on many machines: the pairs' all-gather would send more than an all-reduce
  of the whole vector, so the vector goes, with each device's selected values in place. Same sums (DGC in numpy),
  fewer bytes, and the bytes counted are the all-reduce's."""
  steps, d, momentum = 4, 800, 0.9
  nodes, local = shape
  grads = np.asarray(np.random.default_rng(7).normal(size=(steps, 8, d)), np.float32)
  options = dict(momentum_correction=momentum, compact_pairs=compact)
  outputs, _, reducer = _run_steps(strategy, shape, grads, density, **options)
  wire = _to_bfloat16 if compact else lambda x: x
  if strategy == "topk":
    expected = _dgc_reference(grads.astype(np.float64), compression.num_selected(d, density), momentum, wire=wire)
    expected = expected.sum(axis=1) / 8
    unit, senders = d, 8
  else:
    shards = grads.reshape(steps, nodes, local, d).sum(axis=2).reshape(steps, nodes * local, d // local)
    sent = _dgc_reference(shards, compression.num_selected(d // local, density), momentum, wire=wire)
    expected = sent.reshape(steps, nodes, d).sum(axis=1) / 8
    unit, senders = d // local, nodes
  np.testing.assert_allclose(outputs, expected, rtol=1e-4, atol=1e-5)
  k = compression.num_selected(unit, density)
  pairs = (senders - 1) * compression.pair_bytes(k, unit, compact)
  dense = 2 * (senders - 1) * unit * 4 // senders
  assert dense < pairs and reducer.bytes_per_step({"w": jnp.zeros(d)}).inter_node == dense
  # Below the crossing, pairs as before.
  low = dataclasses.replace(reducer, density=0.01)
  assert low.bytes_per_step({"w": jnp.zeros(d)}).inter_node == (senders - 1) * compression.pair_bytes(
    compression.num_selected(unit, 0.01), unit, compact
  )


def test_above_the_crossing_no_pairs_are_gathered():
  def gathered(density):  # the results of the all-gathers of hitopk's reduction on 2 x 4 devices
    reducer = reducer_lib.make_gradient_reducer("hitopk", 2, 4, density=density, min_compress_elements=1)
    return re.findall(r"all_gather.*-> (tensor<[^>]*>)", _lowered_reduction(reducer, 4000))

  assert "tensor<2x300xi32>" in gathered(0.3)  # 300 indices from each of the 2 nodes
  assert gathered(0.6) == ["tensor<4000xf32>"]  # only the shards' gather inside the node: the pairs went dense


@pytest.mark.parametrize("strategy", ["hitopk", "topk"])
def test_compact_pairs_of_long_vectors_match_dgc_in_numpy(strategy):
  """Top-k units over 65,536 entries (140,000: three blocks, the last partial): the pairs travel as block
  offsets and counts, and what arrives is still DGC's sum, every block reached."""
  steps, unit, density, momentum = 3, 140_000, 0.01, 0.9
  d = unit * (4 if strategy == "hitopk" else 1)  # hitopk selects from a quarter of the node's sum
  grads = np.asarray(np.random.default_rng(8).normal(size=(steps, 8, d)), np.float32)
  options = dict(momentum_correction=momentum, nesterov=True, compact_pairs=True)
  outputs, _, _ = _run_steps(strategy, (2, 4), grads, density, **options)
  k = compression.num_selected(unit, density)
  if strategy == "topk":
    sent = _dgc_reference(grads.astype(np.float64), k, momentum, True, True, _to_bfloat16)
    expected = sent.sum(axis=1) / 8
  else:
    shards = grads.reshape(steps, 2, 4, d).sum(axis=2).reshape(steps, 8, unit)
    expected = _dgc_reference(shards, k, momentum, True, True, _to_bfloat16).reshape(steps, 2, d).sum(axis=1) / 8
  np.testing.assert_allclose(outputs, expected, rtol=1e-4, atol=1e-5)
  offsets = np.nonzero(outputs[-1])[0] % unit
  assert (offsets >= 2 * compression.COMPACT_BLOCK).any() and (offsets < compression.COMPACT_BLOCK).any()


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy_ball", "nesterov"])
def test_momentum_correction_without_masking_conserves_momentum_sgd(nesterov):
  """Without momentum factor masking the velocity is each device's momentum SGD's, so what was sent plus
  what waits in the residuals is the sum of momentum SGD's steps on the mean gradient, at any density;
  with masking (DGC's) the velocities of sent entries are lost and the sum falls short."""
  steps, d, density, momentum = 12, 800, 0.02, 0.9
  grads = np.asarray(np.random.default_rng(7).normal(0.5, 1.0, size=(steps, 8, d)), np.float32)
  mean = grads.astype(np.float64).mean(axis=1)
  u, dense_sum = np.zeros(d), np.zeros(d)
  for g in mean:
    u = momentum * (u + g) if nesterov else momentum * u + g
    dense_sum += u + g if nesterov else u
  for masking in (False, True):
    outputs, state, _ = _run_steps(
      "hitopk", (2, 4), grads, density, momentum_correction=momentum, nesterov=nesterov, momentum_masking=masking
    )
    (memory,) = state.values()  # (nodes, local, shard): the node's residual of each shard
    waiting = np.asarray(memory.residual, np.float64).sum(axis=0).reshape(-1)[:d] / 8
    error = np.abs(outputs.sum(axis=0) + waiting - dense_sum).max()
    if masking:
      assert error > 1.0, error  # a few units of gradient per entry lost over 12 steps
    else:
      assert error < 1e-3 * np.abs(dense_sum).max(), error


def _ef21_reference(rows, k, momentum, nesterov, wire):
  """EF21 with momentum in numpy, one sender per row of ``rows`` (T, senders, n): each sender's estimate of its
  momentum step after each step, (T, senders, n)."""
  u, own, estimates = np.zeros(rows.shape[1:]), np.zeros(rows.shape[1:]), []
  for g in rows:
    u = momentum * (u + g) if nesterov else momentum * u + g
    step = u + g if nesterov else u
    for row in range(len(g)):
      top = np.argsort(-np.abs(step[row] - own[row]))[:k]
      own[row, top] += wire(step[row, top] - own[row, top])
    estimates.append(own.copy())
  return np.stack(estimates)


@pytest.mark.parametrize(
  "strategy,shape,nesterov,compact",
  [
    ("hitopk", (2, 4), True, False),
    ("hitopk", (4, 2), False, False),
    ("topk", (2, 4), True, False),
    ("hitopk", (2, 4), False, True),
    ("topk", (2, 4), False, True),
  ],
)
def test_ef21_returns_the_sum_of_the_estimates_as_in_numpy(strategy, shape, nesterov, compact):
  """comm.feedback="ef21": each sender moves its estimate of its momentum step by top-k of the difference, and
  the reduction returns every sender's estimate summed, whole (where error feedback returns the k entries each
  sender sent). Compact pairs move the estimate by the rounded values."""
  steps, d, density, momentum = 6, 800, 0.02, 0.9
  nodes, local = shape
  grads = np.asarray(np.random.default_rng(9).normal(size=(steps, 8, d)), np.float32)
  options = dict(momentum_correction=momentum, nesterov=nesterov, momentum_masking=False, compact_pairs=compact)
  outputs, state, _ = _run_steps(strategy, shape, grads, density, feedback="ef21", **options)
  wire = _to_bfloat16 if compact else lambda x: x
  if strategy == "topk":
    own = _ef21_reference(grads.astype(np.float64), compression.num_selected(d, density), momentum, nesterov, wire)
    expected = own.sum(axis=1) / 8
  else:  # device (i, j) estimates shard j of node i's summed gradient's step
    shards = grads.reshape(steps, nodes, local, d).sum(axis=2).reshape(steps, nodes * local, d // local)
    own = _ef21_reference(shards, compression.num_selected(d // local, density), momentum, nesterov, wire)
    expected = own.reshape(steps, nodes, d).sum(axis=1) / 8
  np.testing.assert_allclose(outputs, expected, rtol=1e-4, atol=1e-5)
  # Every entry sent once stays in the sum: after 6 steps many more entries move than one step sends.
  assert (outputs[-1] != 0).sum() > 3 * (outputs[0] != 0).sum()
  (estimate,) = state.values()
  assert isinstance(estimate, compression.Estimate)
  # Every receiver's total is the sum of the senders' own estimates.
  group = (0, 1) if strategy == "topk" else (0,)
  np.testing.assert_allclose(
    np.broadcast_to(estimate.own.sum(axis=group, keepdims=True), estimate.own.shape), estimate.total, atol=1e-4
  )


def test_ef21_at_density_one_is_momentum_sgd():
  """Sending every entry's change, each estimate is its step: the sum is momentum SGD's on the mean gradient."""
  steps, d, momentum = 4, 600, 0.9
  grads = np.asarray(np.random.default_rng(10).normal(size=(steps, 8, d)), np.float32)
  outputs, _, _ = _run_steps(
    "hitopk", (2, 4), grads, 1.0, feedback="ef21", momentum_correction=momentum, momentum_masking=False
  )
  u = np.zeros(d)
  for t, g in enumerate(grads.astype(np.float64).mean(axis=1)):
    u = momentum * u + g
    np.testing.assert_allclose(outputs[t], u, rtol=1e-4, atol=1e-5)


def test_ef21_needs_momentum_correction_and_an_estimate_per_sender():
  with pytest.raises(ValueError, match="momentum correction"):
    reducer_lib.make_gradient_reducer("hitopk", 2, 4, feedback="ef21")
  with pytest.raises(ValueError, match="strategy 'gtopk'"):
    reducer_lib.make_gradient_reducer("gtopk", 2, 4, feedback="ef21", momentum_correction=0.9)


def test_local_gradient_clipping_clips_each_device_before_the_sum():
  d, clip = 600, 2.0
  grads = np.asarray(np.random.default_rng(6).normal(size=(1, 8, d)), np.float32)
  grads[0, 3] *= 100.0  # one device with an outlier gradient
  outputs, _, _ = _run_steps("hitopk", (2, 4), grads, density=1.0, local_clip_norm=clip)
  limit = clip / np.sqrt(8)
  norms = np.linalg.norm(grads[0], axis=1, keepdims=True)
  clipped = grads[0] * np.minimum(1.0, limit / norms)
  assert (norms > limit).all()  # every device is clipped here
  np.testing.assert_allclose(outputs[0], clipped.mean(axis=0), rtol=1e-4, atol=1e-6)


def test_the_reducer_refuses_16_bit_gradients():
  """A float16 sum over every device overflowed to inf where the mean fits: the parameters, so the gradients, are
  float32 in every config, and another dtype is refused when the step is traced."""
  mesh = mesh_lib.make_mesh(2, 4)
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 2, 4)
  step = jax.shard_map(
    lambda g: reducer.reduce({"w": g[0]}, {})[0]["w"],
    mesh=mesh,
    in_specs=mesh_lib.BATCH_SPEC,
    out_specs=P(),
    check_vma=False,
  )
  with pytest.raises(TypeError, match="the reducer sums float32 gradients, not float16"):
    jax.jit(step).lower(jnp.full((8, 9000), 60_000, jnp.float16))
