"""Every strategy's reduced gradient equals the single-device gradient of the whole global batch.

This is the test that catches a silent double reduction (JAX's implicit psum of gradients of
replicated parameters plus our own): the result would be off by the device count.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from light_jax import optim
from light_jax.parallel import fusion, strategies
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from tests.helpers import TinyCNN, init_variables

MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def _loss(model, params, images, labels):
  return optim.cross_entropy(model.apply({"params": params}, images), labels, 10, 0.1)


@pytest.fixture(scope="module")
def problem():
  model = TinyCNN()
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(32, 12, 12, 1)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, size=32), jnp.int32)
  params = init_variables(model, images.shape[1:])["params"]
  reference = jax.jit(jax.grad(lambda p: _loss(model, p, images, labels)))(params)
  return model, params, images, labels, reference


def assert_replicas_agree(tree):
  """Every device holds the same bits of each replicated (``out_specs=P()``) output: with ``check_vma=False``
  JAX does not check it, and reading the array gives device 0's copy alone."""
  for leaf in jax.tree.leaves(tree):
    first, *others = [np.asarray(shard.data) for shard in leaf.addressable_shards]
    for i, other in enumerate(others, 1):
      assert other.tobytes() == first.tobytes(), f"device {i}'s copy differs from device 0's"


def reduce_on_mesh(reducer, mesh, model, params, images, labels, state=None):
  """Local gradients on each device's shard, then ``reducer``; returns (mean gradient, new state), the mean
  checked to be the same on every device."""
  state = reducer.init_state(params) if state is None else state
  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)

  def device_grad(params, state, images, labels):
    local = jax.grad(lambda p: _loss(model, p, images, labels))(params)
    return reducer.reduce(local, state)

  sharding = mesh_lib.batch_sharding(mesh)
  reduced, state = jax.jit(
    jax.shard_map(
      device_grad,
      mesh=mesh,
      in_specs=(P(), per_device, mesh_lib.BATCH_SPEC, mesh_lib.BATCH_SPEC),
      out_specs=(P(), per_device),
      check_vma=False,
    )
  )(
    params,
    jax.device_put(state, NamedSharding(mesh, per_device)),
    jax.device_put(images, sharding),
    jax.device_put(labels, sharding),
  )
  assert_replicas_agree(reduced)
  return reduced, state


@pytest.mark.parametrize("strategy", strategies.NAMES)
@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_reduced_gradient_equals_whole_batch_gradient(problem, strategy, shape):
  """Dense strategies exactly; top-k strategies at density 1.0 (every tensor compressed) as well."""
  model, params, images, labels, reference = problem
  mesh = mesh_lib.make_mesh(*shape)
  reducer = reducer_lib.make_gradient_reducer(strategy, *shape, density=1.0, min_compress_elements=1)
  reduced, state = reduce_on_mesh(reducer, mesh, model, params, images, labels)
  if strategies.get(strategy).compressed:
    assert len(state) == len(jax.tree.leaves(params))  # every tensor went through top-k
    assert all(float(jnp.abs(r).max()) == 0.0 for r in state.values())  # density 1: nothing left behind
  for ours, ref in zip(jax.tree.leaves(reduced), jax.tree.leaves(reference)):
    assert ours.shape == ref.shape
    np.testing.assert_array_less(np.max(np.abs(np.asarray(ours) - np.asarray(ref))), 1e-5)
  # The comparison must be able to fail: a double reduction (x 8 devices) is far outside tolerance.
  leaf = jax.tree.leaves(reference)[0]
  assert np.max(np.abs(8 * leaf - leaf)) > 1e-3


@pytest.mark.parametrize("strategy", [s.name for s in strategies.REGISTRY.values() if not s.compressed])
@pytest.mark.parametrize("size", [1, 7, 8, 1000, 4099])
def test_allreduce_of_odd_sizes_sums_over_devices(strategy, size):
  """Shapes that do not split evenly over `local` (padding path) still give the exact sum."""
  mesh = mesh_lib.make_mesh(2, 4)
  x = jnp.arange(8 * size, dtype=jnp.float32).reshape(8, size) / 7.0
  out = jax.jit(
    jax.shard_map(
      lambda v: strategies.get(strategy).reduce(v[0]),
      mesh=mesh,
      in_specs=mesh_lib.BATCH_SPEC,
      out_specs=P(),
      check_vma=False,
    )
  )(jax.device_put(x, mesh_lib.batch_sharding(mesh)))
  assert_replicas_agree(out)
  np.testing.assert_allclose(np.asarray(out), np.asarray(x).sum(axis=0), rtol=1e-6)


def test_byte_accounting_matches_the_ring_formulas():
  # d = 1,000,000 float32 on N=2 nodes x n=4 devices (docs/techniques.md section 1).
  d, nodes, local = 1_000_000, 2, 4
  hier = strategies.strategy_bytes("hierarchical", d, 4, nodes, local)
  assert hier.inter_node == 2 * (nodes - 1) * (d // local) * 4 // nodes == 1_000_000
  assert hier.intra_node == 2 * (local - 1) * (d // local) * 4 == 6_000_000
  dense = strategies.strategy_bytes("dense", d, 4, nodes, local)
  assert dense.inter_node == dense.intra_node == 2 * 7 * d * 4 // 8 == 7_000_000
  # Hierarchical sends n times fewer bytes across nodes than the flat ring (here 7x, from 2(P-1)/P).
  assert dense.inter_node / hier.inter_node == 7.0
  # Padding: 10 elements over 4 local devices are sent as 12.
  assert strategies.strategy_bytes("hierarchical", 10, 4, 1, 4) == strategies.CommBytes(
    intra_node=2 * 3 * 3 * 4, inter_node=0
  )
  assert strategies.strategy_bytes("dense", 10, 4, 1, 1) == strategies.CommBytes(0, 0)


def test_reducer_bytes_sum_over_tensors(problem):
  _, params, *_ = problem
  reducer = reducer_lib.make_gradient_reducer("hierarchical", 2, 4)
  expected = sum(strategies.strategy_bytes("hierarchical", p.size, 4, 2, 4).inter_node for p in jax.tree.leaves(params))
  assert reducer.bytes_per_step(params).inter_node == expected > 0


def test_fixed_buckets_follow_the_threshold():
  plan = fusion.plan_fixed_buckets
  assert plan([10, 10, 10, 10], 25) == [[0, 1], [2, 3]]
  assert plan([10, 30, 5, 5, 5], 25) == [[0], [1], [2, 3, 4]]  # an oversized tensor stands alone
  assert plan([10, 10, 10], 0) == [[0, 1, 2]]  # 0: one bucket
  assert plan([], 25) == []


@pytest.mark.parametrize("strategy", strategies.NAMES)
@pytest.mark.parametrize(  # 2000: several buckets, on each shape; 0: one bucket (the same code, one bucket long)
  "shape,bucket_bytes",
  [((1, 8), 2000), ((2, 4), 0), ((2, 4), 2000), ((4, 2), 2000)],
  ids=["1x8-2000", "2x4-0", "2x4-2000", "4x2-2000"],
)
def test_fused_reduction_equals_unfused(problem, strategy, shape, bucket_bytes):
  model, params, images, labels, reference = problem
  mesh = mesh_lib.make_mesh(*shape)
  results = {}
  for mode in ("none", "fixed"):
    reducer = reducer_lib.make_gradient_reducer(
      strategy, *shape, fusion=mode, bucket_bytes=bucket_bytes, density=1.0, min_compress_elements=1
    )
    if mode == "fixed":
      assert len(reducer.buckets(jax.tree.leaves(params))[1]) == (1 if bucket_bytes == 0 else 3)
    results[mode] = reduce_on_mesh(reducer, mesh, model, params, images, labels)[0]
  for fused, unfused, ref in zip(*(jax.tree.leaves(r) for r in (results["fixed"], results["none"], reference))):
    np.testing.assert_allclose(fused, unfused, atol=1e-6)
    np.testing.assert_array_less(np.max(np.abs(np.asarray(fused) - np.asarray(ref))), 1e-5)


def test_fusion_cuts_padding_and_counts_bytes_per_bucket():
  params = {"a": jnp.zeros((5,)), "b": jnp.zeros((3, 3))}  # 5 + 9 = 14 elements
  none = reducer_lib.make_gradient_reducer("hierarchical", 2, 4, "none").bytes_per_step(params)
  fixed = reducer_lib.make_gradient_reducer("hierarchical", 2, 4, "fixed").bytes_per_step(params)
  # none: pads 5 -> 8 and 9 -> 12 (shards of 2 and 3); fixed: 14 -> 16 (shard of 4).
  assert none.intra_node == 2 * 3 * (2 + 3) * 4 and fixed.intra_node == 2 * 3 * 4 * 4
  assert none.inter_node == (2 + 3) * 4 and fixed.inter_node == 4 * 4


@pytest.mark.parametrize(
  "strategy,options",
  [
    ("hierarchical", {"wire_dtype": "bfloat16"}),
    ("hitopk", {"density": 0.01, "compact_pairs": True, "wire_dtype": "bfloat16"}),
    ("gtopk", {"density": 0.01, "compact_pairs": True}),
  ],
  ids=["hierarchical", "hitopk", "gtopk"],
)
def test_sixteen_bit_values_cross_the_wire_in_sixteen_bits(strategy, options):
  """XLA's CPU backend widens bfloat16 collectives to float32 (twice the bytes the accounting counts on the
  emulated links); the collectives that only move data move the bits instead."""
  mesh = mesh_lib.make_mesh(2, 4)
  params = {"w": jnp.zeros((100_001,))}
  reducer = reducer_lib.make_gradient_reducer(strategy, 2, 4, fusion="none", **options)
  spec = P(mesh_lib.NODE, mesh_lib.LOCAL)
  reduce = jax.shard_map(reducer.reduce, mesh=mesh, in_specs=(P(), spec), out_specs=(P(), spec), check_vma=False)
  compiled = jax.jit(reduce).lower(params, reducer.init_state(params)).compile().as_text()
  # The shapes each data-moving collective outputs, e.g. "u16[2,251]{1,0}" or a tuple of them.
  moved = re.findall(r"= (.*?) (?:all-gather|all-to-all|collective-permute)\(", compiled)
  assert moved and any("u16[" in shapes for shapes in moved), moved
  # Only the 16-bit words, int32 indices and block counts move: no float32 copy of the bfloat16 values.
  assert not [shapes for shapes in moved if "f32[" in shapes], moved


@pytest.mark.parametrize("strategy", ["hierarchical", "hitopk", "dense"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_wire_is_close_to_float32_and_halves_dense_bytes(problem, strategy, shape):
  model, params, images, labels, reference = problem
  mesh = mesh_lib.make_mesh(*shape)
  f32 = reducer_lib.make_gradient_reducer(strategy, *shape, fusion="fixed", density=1.0, min_compress_elements=1)
  bf16 = reducer_lib.make_gradient_reducer(
    strategy, *shape, fusion="fixed", density=1.0, min_compress_elements=1, wire_dtype="bfloat16"
  )
  reduced = reduce_on_mesh(bf16, mesh, model, params, images, labels)[0]
  rounded = 0.0
  for ours, ref in zip(jax.tree.leaves(reduced), jax.tree.leaves(reference)):
    assert ours.dtype == jnp.float32
    # bfloat16 keeps 8 bits of mantissa: each summand is off by at most 2^-8 of itself.
    np.testing.assert_allclose(ours, ref, atol=2**-7 * float(np.abs(np.asarray(ref)).max()) + 1e-7)
    rounded = max(rounded, float(np.max(np.abs(np.asarray(ours) - np.asarray(ref)))))
  assert rounded > 1e-5  # the hops really carried bfloat16 (float32's own error here is under 1e-6)
  wide, narrow = f32.bytes_per_step(params), bf16.bytes_per_step(params)
  assert narrow.intra_node <= wide.intra_node // 2 + 64
  if strategy != "hitopk":  # hitopk's sparse (value, index) pairs cross nodes in float32 either way
    assert narrow.inter_node <= wide.inter_node // 2 + 64
  else:
    assert narrow.inter_node == wide.inter_node


def test_auto_sends_compact_pairs_from_its_top_k_buckets_only(problem):
  """comm.strategy="auto" with comm.compact_pairs: the buckets given hitopk or topk send bfloat16 values (so
  they are off the whole-batch gradient by the rounding, which stays in the residual); gtopk's buckets rank in
  bfloat16 but sum exactly, and every other bucket is exact; the byte count follows the same split."""
  model, params, images, labels, reference = problem
  mesh = mesh_lib.make_mesh(2, 4)
  base = reducer_lib.make_gradient_reducer("auto", 2, 4, density=1.0, min_compress_elements=1, compact_pairs=True)
  num_buckets = len(base.buckets(jax.tree.leaves(params))[1])
  names = list(strategies.NAMES)
  rounded = 0.0
  for shift in range(len(names)):
    choices = tuple(names[(b + shift) % len(names)] for b in range(num_buckets))
    reducer = dataclasses.replace(base, choices=choices)
    reduced, _ = reduce_on_mesh(reducer, mesh, model, params, images, labels)
    order, buckets = reducer.buckets(jax.tree.leaves(params))
    assert all(len(bucket) == 1 for bucket in buckets)  # a bucket per tensor, the tensors in ``order``
    leaf_choice = dict(zip(order, choices))
    for i, (ours, ref) in enumerate(zip(jax.tree.leaves(reduced), jax.tree.leaves(reference))):
      choice = leaf_choice[i]
      error = float(np.max(np.abs(np.asarray(ours) - np.asarray(ref))))
      assert reducer.with_strategy(choice).compact_pairs == strategies.sends_compact_pairs(choice)
      if strategies.sends_compact_pairs(choice) and choice != "gtopk":  # gtopk ranks compact, sums in float32
        assert error <= 2**-8 * float(np.max(np.abs(np.asarray(ref)))) + 1e-6, choice
        rounded = max(rounded, error)
      else:
        assert error < 1e-5, choice
  assert rounded > 1e-6  # the compact buckets really sent bfloat16 values

  def inter_node(choice, compact):  # at 10%: at 100% hitopk's node hop sums the whole shard, pairs or not
    one = dataclasses.replace(base, choices=(choice,) * num_buckets, compact_pairs=compact, density=0.1)
    return one.bytes_per_step(params).inter_node

  assert inter_node("gtopk", True) < inter_node("gtopk", False)  # its merge rounds' pairs, not its sums
  assert inter_node("hitopk", True) < 0.6 * inter_node("hitopk", False)


def test_every_strategy_record_is_complete():
  """A new entry in the registry cannot leave out what the reducer, the accounting and the cost model need."""
  for spec in strategies.REGISTRY.values():
    if spec.compressed:
      fallback = strategies.get(spec.dense_fallback)
      assert not fallback.compressed, spec.name
      assert spec.topk_unit(1000, 4) in (1000, 250), spec.name
    else:
      assert spec.dense_fallback is None, spec.name
    sent = spec.bytes(strategies.Buffer(elements=1000, itemsize=4, nodes=2, local=4, k=10 if spec.compressed else 0))
    assert sent.inter_node > 0 and sent.intra_node > 0, spec.name


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_auto_reduction_with_every_mix_of_strategies_equals_whole_batch_gradient(problem, shape):
  """comm.strategy="auto" runs each bucket's own strategy (and its residual): at density 1, any mix of
  exact and compressed buckets gives the whole-batch gradient."""
  model, params, images, labels, reference = problem
  mesh = mesh_lib.make_mesh(*shape)
  base = reducer_lib.make_gradient_reducer("hierarchical", *shape, density=1.0, min_compress_elements=1)
  num_buckets = len(base.buckets(jax.tree.leaves(params))[1])
  names = list(strategies.NAMES)
  # On 2 x 4 every strategy on every bucket; on the other meshes one mix, every strategy in it (each strategy on
  # every tensor and mesh alone: test_reduced_gradient_equals_whole_batch_gradient).
  assert num_buckets >= len(names)
  for shift in range(len(names)) if shape == (2, 4) else range(1):
    choices = tuple(names[(b + shift) % len(names)] for b in range(num_buckets))
    reducer = dataclasses.replace(base, strategy="auto", choices=choices)
    reduced, state = reduce_on_mesh(reducer, mesh, model, params, images, labels)
    assert len(state) == sum(strategies.get(c).compressed for c in choices)  # residuals for compressed buckets only
    plan = reducer.bucket_plan(params)
    assert [name for name, _, _ in plan] == list(choices)
    for ours, ref in zip(jax.tree.leaves(reduced), jax.tree.leaves(reference)):
      np.testing.assert_array_less(np.max(np.abs(np.asarray(ours) - np.asarray(ref))), 1e-5)


def test_gtopk_reducer_refuses_a_device_count_that_is_not_a_power_of_two():
  """gtopk pairs devices by the bits of their index: on 6 devices the reducer says so when it is built (in
  config.py's words), not ppermute deep inside the first trace; auto cannot be given gtopk there either."""
  message = r"comm.strategy='gtopk' pairs devices .* not 3 x 2 = 6; use 'hitopk' or 'topk', or a mesh of 4 devices"
  with pytest.raises(ValueError, match=message):
    reducer_lib.make_gradient_reducer("gtopk", 3, 2)
  auto = reducer_lib.make_gradient_reducer("auto", 3, 2)
  with pytest.raises(ValueError, match=r"strategy 'auto' chose 'gtopk' for a bucket: " + message):
    dataclasses.replace(auto, choices=("hitopk", "gtopk"))
  dataclasses.replace(auto, choices=("hitopk", "topk"))  # the others run on any mesh
  reducer_lib.make_gradient_reducer("gtopk", 2, 4)
