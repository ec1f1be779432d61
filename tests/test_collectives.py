"""Every strategy's reduced gradient equals the single-device gradient of the whole global batch.

This is the test that catches a silent double reduction (JAX's implicit psum of gradients of
replicated parameters plus our own): the result would be off by the device count.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from light_jax import optim
from light_jax.parallel import collectives
from light_jax.parallel import mesh as mesh_lib
from tests.helpers import TinyCNN

MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def _loss(model, params, images, labels):
  return optim.cross_entropy(model.apply({"params": params}, images), labels, 10, 0.1)


@pytest.fixture(scope="module")
def problem():
  model = TinyCNN()
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(32, 12, 12, 1)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, size=32), jnp.int32)
  params = model.init(jax.random.key(0), images[:1])["params"]
  reference = jax.jit(jax.grad(lambda p: _loss(model, p, images, labels)))(params)
  return model, params, images, labels, reference


@pytest.mark.parametrize("strategy", sorted(collectives.STRATEGIES))
@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_reduced_gradient_equals_whole_batch_gradient(problem, strategy, shape):
  model, params, images, labels, reference = problem
  mesh = mesh_lib.make_mesh(*shape)
  reducer = collectives.make_gradient_reducer(strategy, *shape)

  def device_grad(params, images, labels):
    local = jax.grad(lambda p: _loss(model, p, images, labels))(params)
    return reducer.reduce(local, ())[0]

  sharding = mesh_lib.batch_sharding(mesh)
  reduced = jax.jit(jax.shard_map(device_grad, mesh=mesh, in_specs=(P(), mesh_lib.BATCH_SPEC, mesh_lib.BATCH_SPEC),
                                  out_specs=P(), check_vma=False))(
      params, jax.device_put(images, sharding), jax.device_put(labels, sharding))
  for ours, ref in zip(jax.tree.leaves(reduced), jax.tree.leaves(reference)):
    assert ours.shape == ref.shape
    np.testing.assert_array_less(np.max(np.abs(np.asarray(ours) - np.asarray(ref))), 1e-5)
  # The comparison must be able to fail: a double reduction (x 8 devices) is far outside tolerance.
  leaf = jax.tree.leaves(reference)[0]
  assert np.max(np.abs(8 * leaf - leaf)) > 1e-3


@pytest.mark.parametrize("strategy", sorted(collectives.STRATEGIES))
@pytest.mark.parametrize("size", [1, 7, 8, 1000, 4099])
def test_allreduce_of_odd_sizes_sums_over_devices(strategy, size):
  """Shapes that do not split evenly over `local` (padding path) still give the exact sum."""
  mesh = mesh_lib.make_mesh(2, 4)
  x = jnp.arange(8 * size, dtype=jnp.float32).reshape(8, size) / 7.0
  out = jax.jit(jax.shard_map(lambda v: collectives.STRATEGIES[strategy](v[0]), mesh=mesh,
                              in_specs=mesh_lib.BATCH_SPEC, out_specs=P(), check_vma=False))(
      jax.device_put(x, mesh_lib.batch_sharding(mesh)))
  np.testing.assert_allclose(np.asarray(out), np.asarray(x).sum(axis=0), rtol=1e-6)


def test_byte_accounting_matches_the_ring_formulas():
  # d = 1,000,000 float32 on N=2 nodes x n=4 devices (light-techniques.md section 1).
  d, nodes, local = 1_000_000, 2, 4
  hier = collectives.strategy_bytes("hierarchical", d, 4, nodes, local)
  assert hier.inter_node == 2 * (nodes - 1) * (d // local) * 4 // nodes == 1_000_000
  assert hier.intra_node == 2 * (local - 1) * (d // local) * 4 == 6_000_000
  dense = collectives.strategy_bytes("dense", d, 4, nodes, local)
  assert dense.inter_node == dense.intra_node == 2 * 7 * d * 4 // 8 == 7_000_000
  # Hierarchical sends n times fewer bytes across nodes than the flat ring (here 7x, from 2(P-1)/P).
  assert dense.inter_node / hier.inter_node == 7.0
  # Padding: 10 elements over 4 local devices are sent as 12.
  assert collectives.strategy_bytes("hierarchical", 10, 4, 1, 4) == collectives.CommBytes(intra_node=2 * 3 * 3 * 4, inter_node=0)
  assert collectives.strategy_bytes("dense", 10, 4, 1, 1) == collectives.CommBytes(0, 0)


def test_reducer_bytes_sum_over_tensors(problem):
  _, params, *_ = problem
  reducer = collectives.make_gradient_reducer("hierarchical", 2, 4)
  expected = sum(collectives.strategy_bytes("hierarchical", p.size, 4, 2, 4).inter_node for p in jax.tree.leaves(params))
  assert reducer.bytes_per_step(params).inter_node == expected > 0
