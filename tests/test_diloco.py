"""DiLoCo (comm.strategy="diloco"): local steps in each machine, an outer Nesterov step across machines."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from light_jax import config as config_lib
from light_jax import optim
from light_jax import train_step as step_lib
from light_jax.parallel import collectives, diloco, strategies
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from tests.helpers import TinyCNN, init_variables
from tests.test_train_step import GLOBAL_BATCH, _batches, _config, _max_diff, _run_reference, _run_sharded


def _sgd():
  return optim.build_optimizer(_config("sgd").optimizer, optax.constant_schedule(0.1))  # momentum, Nesterov, wd


def _run_diloco(batches, info, shape, nan_at_step=-1, **options):
  tx = _sgd()
  mesh = mesh_lib.make_mesh(*shape)
  reducer = diloco.DiLoCo(*shape, inner_tx=tx, **options)
  state = step_lib.create_train_state(TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0)
  step = step_lib.make_train_step(
    TinyCNN(), tx, reducer, mesh, info, label_smoothing=0.1, inject_nan_at_step=nan_at_step
  )
  sharding = mesh_lib.batch_sharding(mesh)
  for images, labels in batches:
    state, _ = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
  return jax.device_get(state)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_one_local_step_with_plain_outer_sgd_is_the_synchronous_run(shape):
  """H = 1, outer lr 1, no outer momentum: the machines' mean change is the synchronous update (SGD with
  momentum is linear in the gradient)."""
  batches, info = _batches(3)
  ours = _run_diloco(batches, info, shape, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
  synchronous = _run_sharded(TinyCNN(), _sgd(), info, batches, shape, "hierarchical")
  assert _max_diff(ours.params, synchronous.params) < 1e-5
  assert _max_diff(ours.params, init_variables(TinyCNN(), info.image_shape)["params"]) > 1e-3
  assert all(float(np.abs(d).max()) == 0.0 for d in jax.tree.leaves(ours.comm_state["delta"]))  # synced each step


def test_four_local_steps_per_machine_then_one_nesterov_outer_step():
  """2 machines x 4 devices, H = 4: each machine trains on its half of every batch alone (its own
  momentum), the outer parameters stay put until step 4, then move by Nesterov SGD on the mean change."""
  batches, info = _batches(4)
  tx = _sgd()
  after = {}
  for steps in (3, 4):
    after[steps] = _run_diloco(batches[:steps], info, (2, 4), sync_every=4, outer_lr=0.7, outer_momentum=0.9)
  init = init_variables(TinyCNN(), info.image_shape)["params"]
  assert _max_diff(after[3].params, init) == 0.0  # no outer step yet
  half = GLOBAL_BATCH // 2  # the batch is sharded node-major: machine n holds rows [n * half, (n + 1) * half)
  machines = [
    _run_reference(
      TinyCNN(), tx, info, [(x[n * half : (n + 1) * half], y[n * half : (n + 1) * half]) for x, y in batches], 1
    )[0]
    for n in range(2)
  ]
  outer_grad = jax.tree.map(lambda p, a, b: p - (a + b) / 2, init, *machines)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  updates, _ = outer.update(outer_grad, outer.init(init), init)
  expected = optax.apply_updates(init, updates)
  assert _max_diff(after[4].params, expected) < 1e-5
  assert _max_diff(machines[0], machines[1]) > 1e-3  # the machines did drift apart
  # After the sync every machine starts again from the outer parameters.
  assert all(float(np.abs(np.asarray(d)).max()) == 0.0 for d in jax.tree.leaves(after[4].comm_state["delta"]))


def test_a_skipped_sync_step_still_syncs_the_machines():
  """A non-finite step that is a sync step (H = 2, step 1 of 2): no inner step, but the machines' changes of
  step 0 are averaged all the same, so that evaluations and checkpoints see one model: the state is that of a
  run that synced after step 0 (H = 1), but the skipped step's count."""
  batches, info = _batches(2)
  plain = {"outer_lr": 1.0, "outer_momentum": 0.0}
  skipped = _run_diloco(batches, info, (2, 4), nan_at_step=1, sync_every=2, **plain)
  synced = _run_diloco(batches[:1], info, (2, 4), sync_every=1, **plain)
  assert int(skipped.nonfinite_steps) == 1 and int(skipped.step) == 2
  assert _max_diff(skipped.params, init_variables(TinyCNN(), info.image_shape)["params"]) > 1e-3
  assert _max_diff(skipped.params, synced.params) < 1e-6  # two programs: rounding apart
  assert _max_diff(skipped.comm_state, synced.comm_state) < 1e-6  # deltas zero, the inner momentum of step 0
  assert all(float(np.abs(np.asarray(d)).max()) == 0.0 for d in jax.tree.leaves(skipped.comm_state["delta"]))


def test_bytes_the_slow_link_carries_once_every_h_steps():
  params = {"w": jnp.zeros((3, 3, 64, 128)), "b": jnp.zeros((128,))}
  n = 3 * 3 * 64 * 128 + 128
  reducer = diloco.DiLoCo(2, 4, sync_every=8)
  hierarchical = strategies.strategy_bytes("hierarchical", n, 4, 2, 4)
  # The outer step inside the machine: the all-gather of a hierarchical all-reduce, not its reduce-scatter.
  gather = 3 * (n // 4) * 4
  assert hierarchical.intra_node == 2 * gather
  assert reducer.bytes_per_step(params) == strategies.CommBytes(
    intra_node=strategies.ring_allreduce_bytes(4 * n, 4) + gather // 8,
    inter_node=hierarchical.inter_node // 8,
  )
  # Epochs of 32 steps and H = 64: the machines also sync at each epoch's end, so every 32 steps, twice as often
  # as H alone says; in a run that max_steps ends at step 40, after steps 32 and 40.
  epochs = diloco.DiLoCo(2, 4, sync_every=64).for_run((0, 32, 64, 96, 128), 128)
  assert epochs.bytes_per_step(params).inter_node == hierarchical.inter_node // 32
  cut = diloco.DiLoCo(2, 4, sync_every=64).for_run((0, 32, 40, 64, 96, 128), 40)
  assert cut.bytes_per_step(params).inter_node == hierarchical.inter_node * 2 // 40


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1), (1, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("wire", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_the_outer_all_reduce_sums_the_machines_without_a_reduce_scatter_inside_them(shape, wire):
  """collectives.machines_allreduce: every device of a machine holds the machine's change; the sum over the
  machines, with no reduce-scatter over local (it would add `local` copies) and the bytes bytes_per_step counts."""
  nodes, local = shape
  d = 1_001  # not a multiple of local or nodes: padded
  machines = np.random.default_rng(0).normal(size=(nodes, d)).astype(np.float32)
  per_device = np.repeat(machines, local, axis=0)  # device (n, l) holds machine n's vector
  mesh = mesh_lib.make_mesh(nodes, local)
  summed = jax.jit(
    jax.shard_map(
      lambda x: collectives.machines_allreduce(x[0], wire)[None],
      mesh=mesh,
      in_specs=mesh_lib.BATCH_SPEC,
      out_specs=mesh_lib.BATCH_SPEC,
      check_vma=False,
    )
  )
  text = summed.lower(per_device).as_text()
  assert "reduce_scatter" not in text and ("all_to_all" not in text or nodes > 1), text[-2000:]
  result = np.asarray(summed(per_device))
  tolerance = 1e-5 if wire == jnp.float32 else 2e-2 * nodes
  for device in range(nodes * local):
    np.testing.assert_allclose(result[device], machines.sum(axis=0), atol=tolerance)


def test_config_builds_diloco_with_the_inner_optimizer_and_refuses_bad_values():
  config = config_lib.base_config()
  config.comm.strategy = "diloco"
  assert config_lib.validate(config, 8) == (2, 4)
  reducer = reducer_lib.reducer_from_config(config.comm, 2, 4, optimizer=_sgd())
  assert isinstance(reducer, diloco.DiLoCo) and reducer.sync_every == 8 and reducer.inner_tx is not None
  for field, value, message in [
    ("sync_every", 0, "comm.sync_every=0 must be > 0"),
    ("outer_momentum", 1.0, "must be in"),
    ("fusion", "adaptive", "does not apply"),
  ]:
    bad = config_lib.base_config()
    bad.comm.strategy = "diloco"
    setattr(bad.comm, field, value)
    with pytest.raises(config_lib.ConfigError, match=message):
      config_lib.validate(bad, 8)


def test_one_machine_is_refused_with_a_clear_message():
  """nodes=1: the outer step has one machine's change to average. It would only scale that change (a Lookahead
  step), and there is no inter-node link to spare: refused, not run silently."""
  with pytest.raises(ValueError, match=r"the mesh 1 x 8 has one machine.*Use mesh.nodes >= 2"):
    diloco.DiLoCo(1, 8, inner_tx=_sgd())
  assert diloco.mesh_error(2, 4) is None and diloco.mesh_error(8, 1) is None
  # The config says it first, in a config error (train.py: one line, the bad-input exit code).
  config = config_lib.base_config()
  config.comm.strategy = "diloco"
  config.mesh.update(nodes=1, local=8)
  with pytest.raises(config_lib.ConfigError, match="has one machine"):
    config_lib.validate(config, 8)


def test_a_run_that_max_steps_ends_between_syncs_syncs_at_its_end(tmp_path):
  """The final evaluation and checkpoint see one model: the machines sync at the run's last step too."""
  import orbax.checkpoint as ocp

  from light_jax import train_lib
  from tests.helpers import small_config

  config = small_config(comm__strategy="diloco", comm__sync_every=8, max_steps=5)
  train_lib.train_and_evaluate(config, str(tmp_path))
  saved = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "5" / "state")
  assert saved["step"] == 5 and all(not np.any(d) for d in jax.tree.leaves(saved["comm_state"]["delta"]))
