"""optimizer.sharded_update: each device updates its shard of the hierarchical buckets; the same steps as
the replicated update, with 1/local of the optimizer state per device."""

import json
import logging
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from light_jax import config as config_lib
from light_jax import optim, schedules, train_lib
from light_jax import train_step as step_lib
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from light_jax.parallel import strategies
from light_jax.parallel.sharded_update import sharded_update, split_into_shards
from light_jax.train_lib import optimizer_state_bytes_per_device
from tests.helpers import ROOT, TinyCNN, init_variables, small_config
from tests.test_train_step import _batches, _config, _max_diff


def _train(shape, optimizer, sharded, batches, info, bucket_bytes, strategy="hierarchical"):
  """``strategy`` "hitopk+mc": hitopk with DGC's momentum correction (the momentum and SGD's decay move);
  "+update": its residuals in learning-rate-weighted units, under a decaying learning rate; "+unmasked":
  without momentum factor masking; "+compact": with compact (bfloat16, uint16) pairs; "+ef21": EF21's estimates
  (comm.feedback) instead of residuals; "+bfloat16": the dense hops in bfloat16 (comm.dtype); "+local": LARS's
  trust ratio on each device before the reduction (comm.local_trust_ratio)."""
  config = ml_collections.ConfigDict({"optimizer": _config(optimizer).optimizer})
  opt = config.optimizer
  opt.update(lars_trust="mlperf" if optimizer == "lars" else "optax", sharded_update=sharded)
  config.comm = {
    "local_trust_ratio": strategy.endswith("+local"),
    "momentum_correction": strategy.startswith("hitopk+mc"),
    "decay_in_velocity": True,  # the sharded update has no momentum of the decay's own
  }
  momentum = 0.0 if config.comm.momentum_correction else opt.momentum
  schedule = optax.constant_schedule({"sgd": 0.1, "lars": 1.0}[optimizer])
  residual_rescale = None
  if strategy.endswith("+update"):
    schedule = optax.linear_schedule(0.1, 0.01, len(batches))
    residual_rescale = schedules.residual_rescale(schedule)
  decay = not optim.decay_before_reduction(config)
  tx = optim.build_optimizer(opt, schedule, momentum, decay=decay)
  mesh = mesh_lib.make_mesh(*shape)
  options = {"density": 0.1, "min_compress_elements": 64} if strategy.startswith("hitopk") else {}
  if config.comm.momentum_correction:
    options["momentum_correction"] = opt.momentum
    options["momentum_masking"] = not strategy.endswith(("+unmasked", "+ef21"))
  if strategy.endswith("+ef21"):
    options["feedback"] = "ef21"
  if strategy.endswith("+compact"):
    options["compact_pairs"] = True
  if strategy.endswith("+bfloat16"):
    options["wire_dtype"] = "bfloat16"
  reducer = reducer_lib.make_gradient_reducer(strategy.split("+")[0], *shape, "fixed", bucket_bytes, **options)
  model = TinyCNN()
  if sharded:
    params = init_variables(model, info.image_shape)["params"]
    reducer = sharded_update(reducer, params, opt, schedule, momentum, decay)
  state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
  local_tx = optim.local_transform(config)
  step = step_lib.make_train_step(
    model, tx, reducer, mesh, info, label_smoothing=0.1, local_tx=local_tx, residual_rescale=residual_rescale
  )
  sharding = mesh_lib.batch_sharding(mesh)
  losses = []
  for images, labels in batches:
    state, loss = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
    losses.append(float(jnp.mean(loss)))
  return jax.device_get(state), losses


@pytest.mark.parametrize(
  "shape,optimizer,bucket_bytes,strategy",
  [
    ((2, 4), "lars", 4096, "hierarchical"),
    ((8, 1), "sgd", 4096, "hierarchical"),
    ((2, 4), "lars", 4096, "hitopk"),
    ((2, 4), "lars", 4096, "hitopk+local"),
    ((4, 2), "lars", 0, "hierarchical+local"),
    ((2, 4), "sgd", 4096, "hitopk+mc+update"),
    ((4, 2), "sgd", 4096, "hitopk+mc+unmasked"),
    ((2, 4), "sgd", 4096, "hitopk+mc+compact"),
    ((2, 4), "sgd", 4096, "hitopk+mc+ef21"),
  ],
  ids=str,
)
def test_sharded_update_takes_the_replicated_steps(shape, optimizer, bucket_bytes, strategy):
  """Buckets of 4 KiB split tensors across shards and shards across tensors; LARS's per-tensor norms
  then need the per-piece sums and the psum over `local`. hitopk (10%, error feedback): the same shard sums."""
  batches, info = _batches(4)
  replicated, replicated_losses = _train(shape, optimizer, False, batches, info, bucket_bytes, strategy)
  sharded, sharded_losses = _train(shape, optimizer, True, batches, info, bucket_bytes, strategy)
  init = init_variables(TinyCNN(), info.image_shape)["params"]
  assert _max_diff(replicated.params, init) > 1e-3
  assert _max_diff(sharded.params, replicated.params) < 1e-5
  for a, b in zip(sharded_losses, replicated_losses):
    assert abs(a - b) <= 1e-4 * abs(b)
  # The optimizer state per device: momentum for 1/local of the (padded) parameters.
  per_device = optimizer_state_bytes_per_device(sharded, 8)
  whole = optimizer_state_bytes_per_device(replicated, 8)
  assert whole / shape[1] <= per_device < whole / shape[1] + 64 * 4 * 8 + 64, (per_device, whole)
  # The bytes: the reduction's, and with LARS (its trust ratio after the reduction) one psum over `local` of two
  # float32 sums of squares per tensor.
  params = init_variables(TinyCNN(), info.image_shape)["params"]
  reduction = reducer_lib.make_gradient_reducer(strategy.split("+")[0], *shape).bytes_per_step(params)
  reducer = sharded_update(reducer_lib.make_gradient_reducer(strategy.split("+")[0], *shape), params,
                           _config(optimizer).optimizer, optax.constant_schedule(0.1), 0.9)  # fmt: skip
  norms = 2 * (shape[1] - 1) * (2 * len(jax.tree.leaves(params)) * 4) // shape[1] if optimizer == "lars" else 0
  assert reducer.bytes_per_step(params) == reduction + strategies.CommBytes(intra_node=norms)
  if strategy.startswith("hitopk"):  # the residuals (and velocities) are the replicated run's
    residuals = [k for k in sharded.comm_state if k != "optimizer"]
    assert residuals and residuals == list(replicated.comm_state)
    assert _max_diff([sharded.comm_state[k] for k in residuals], [replicated.comm_state[k] for k in residuals]) < 1e-6


def test_a_bfloat16_wire_carries_the_updates_and_leaves_the_parameters_float32():
  """With comm.dtype=bfloat16 the sharded update gathers the updates at bfloat16, not the new parameters: the
  parameters stay float32 (rounded to bfloat16 every step, an update below half a bfloat16 step would vanish),
  and the run stays as close to the replicated one as the rounding of the gradients' hops allows."""
  batches, info = _batches(4)
  replicated, _ = _train((2, 4), "sgd", False, batches, info, 4096, "hierarchical+bfloat16")
  sharded, _ = _train((2, 4), "sgd", True, batches, info, 4096, "hierarchical+bfloat16")
  leaves = [np.asarray(x) for x in jax.tree.leaves(sharded.params)]
  off_bfloat16 = sum(int(np.sum(x != x.astype(jnp.bfloat16).astype(np.float32))) for x in leaves)
  assert off_bfloat16 > sum(x.size for x in leaves) // 2
  assert _max_diff(sharded.params, replicated.params) < 1e-3


@pytest.mark.slow  # three train.py runs, ~2 min
def test_train_py_with_the_sharded_update_matches_the_replicated_run(tmp_path):
  """From the CLI on 4 x 2: the same training loss, and summary.json's optimizer state per device halved.
  The sharded run stops after 3 steps and resumes from its checkpoint (the sharded state) to 6."""
  common = [
    "--config.data.train_subset=1024",
    "--config.data.eval_subset=200",
    "--config.global_batch_size=128",
    "--config.mesh.nodes=4",
    "--config.mesh.local=2",
    "--config.checkpoint.every_steps=3",
  ]
  runs = [
    ("replicated", ["--config.max_steps=6"]),
    ("sharded", ["--config.optimizer.sharded_update=True", "--config.max_steps=3"]),
    ("sharded", ["--config.optimizer.sharded_update=True", "--config.max_steps=6"]),
  ]
  summaries = {}
  for name, extra in runs:
    result = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/fashion_mnist.py:lars", "--workdir", str(tmp_path / name)]
      + common
      + extra,
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / name / "summary.json") as f:
      summaries[name] = json.load(f)
  replicated, sharded = summaries["replicated"], summaries["sharded"]
  assert sharded["resumed_from_step"] == 3 and sharded["steps"] == replicated["steps"] == 6
  assert abs(sharded["final_train_loss"] - replicated["final_train_loss"]) < 1e-4 * replicated["final_train_loss"]
  ratio = sharded["optimizer_state_bytes_per_device"] / replicated["optimizer_state_bytes_per_device"]
  assert 0.5 <= ratio < 0.501, ratio
  assert sharded["inter_node_bytes_per_step"] == replicated["inter_node_bytes_per_step"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_shard_holds_its_pieces_whatever_the_gradients_dtype(dtype):
  """With a bfloat16 wire the collective pads a bucket to a multiple of local x nodes, as it pads the float32
  vector that reduce packs, whatever the gradients' dtype: the layout must pad so too (a bucket of 170 or 1418
  elements: to 176 or 1424, not 172 or 1420). Every device holds the same gradient of bfloat16 values, so every
  partial sum is exact."""
  nodes, local = shape = (2, 4)
  params = init_variables(TinyCNN(), (12, 12, 1))["params"]
  grads = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(dtype), params)
  opt = _config("sgd").optimizer
  base = reducer_lib.make_gradient_reducer("hierarchical", *shape, "fixed", 4096, wire_dtype="bfloat16")
  sharded = sharded_update(base, grads, opt, optax.constant_schedule(0.1), opt.momentum)
  elements = [sum(p.size for pieces in bucket.pieces for p in pieces) for bucket in sharded.buckets]
  assert any(-(-n // local) < bucket.shard for n, bucket in zip(elements, sharded.buckets))  # padded for the wire
  mesh = mesh_lib.make_mesh(*shape)
  per_device = P(mesh_lib.NODE, mesh_lib.LOCAL)
  reduce = jax.shard_map(
    lambda g: jax.tree.map(lambda x: x[None, None], sharded.reduce(g, {})[0]),
    mesh=mesh,
    in_specs=P(),
    out_specs=per_device,
    check_vma=False,
  )
  shards = jax.device_get(jax.jit(reduce)(grads))
  flat = [np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(grads)]
  for b, bucket in enumerate(sharded.buckets):
    for i, pieces in enumerate(bucket.pieces):
      expected = np.zeros((bucket.shard,), np.float32)
      for p in pieces:
        expected[p.offset : p.offset + p.size] = flat[p.leaf][p.start : p.start + p.size]
      for n in range(nodes):
        np.testing.assert_array_equal(shards[f"bucket_{b:03d}"][n, i], expected)


@pytest.mark.parametrize("sizes,local", [([5, 3, 8], 4), ([1, 30], 4), ([3], 8), ([7, 7, 7, 7], 2)], ids=str)
def test_the_shards_pieces_cover_each_element_once(sizes, local):
  """Each device's pieces name, in order, exactly the elements of its shard of the packed tensors (the
  last shards may be padding only)."""
  shard = -(-sum(sizes) // local)
  bucket = split_into_shards(tuple(range(10, 10 + len(sizes))), sizes, shard, local)
  packed = [(leaf, i) for leaf, size in enumerate(sizes, start=10) for i in range(size)]
  for device, pieces in enumerate(bucket.pieces):
    held = [(p.leaf, p.start + i) for p in pieces for i in range(p.size)]
    assert held == packed[device * shard : (device + 1) * shard]
    assert [p.offset for p in pieces] == [sum(q.size for q in pieces[:j]) for j in range(len(pieces))]


def test_the_density_warmup_reaches_hitopk_under_the_sharded_update():
  """CompiledSteps varies top-k's density per phase through at_density: with the sharded update it must
  reach the hitopk reducer inside, and leave the shard layout as it is."""
  params = init_variables(TinyCNN(), (12, 12, 1))["params"]
  opt = _config("lars").optimizer
  base = reducer_lib.make_gradient_reducer("hitopk", 2, 4, "fixed", 4096, density=0.01, min_compress_elements=64)
  sharded = sharded_update(base, params, opt, optax.constant_schedule(1.0), opt.momentum)
  warm = sharded.at_density(0.25)
  assert warm.base.density == 0.25 and warm.buckets == sharded.buckets
  size = sum(x.size for x in jax.tree.leaves(params))
  assert warm.base.k_for(size) > sharded.base.k_for(size) > 0


def test_hitopk_with_adaptive_fusion_takes_the_replicated_steps(tmp_path, caplog):
  """hitopk's MG-WFBP buckets are planned once, before the run (a dense strategy's again for each phase, which the
  config refuses): the sharded update lays its shards out on them and takes the replicated run's steps. Devices of
  0.01 TFLOPS give the backward pass time to hide several buckets behind (15: one bucket, as fixed fusion's); no
  warm-up, so that each step moves the parameters by its whole rate."""
  summaries = {}
  for sharded in (False, True):
    config = small_config(
      "hitopk",
      max_steps=4,
      comm__fusion="adaptive",
      comm__device_tflops=0.01,
      optimizer__warmup_epochs=0.0,
      optimizer__sharded_update=sharded,
    )
    assert config_lib.validate(config, 8) == (2, 4)  # as train.py checks it
    with caplog.at_level(logging.INFO):
      summaries[sharded] = train_lib.train_and_evaluate(config, str(tmp_path / str(sharded)))
  plans = re.findall(r"adaptive fusion \(MG-WFBP, \S+\) for batch \S+: (\d+) buckets for 29 tensors", caplog.text)
  assert len(plans) == 2 and plans[0] == plans[1] and int(plans[0]) > 2, plans  # one plan a run, of several buckets
  replicated, sharded = summaries[False], summaries[True]
  assert sharded["comm_buckets"] == replicated["comm_buckets"] and len(sharded["comm_buckets"]) == int(plans[0])
  assert abs(sharded["final_train_loss"] - replicated["final_train_loss"]) < 1e-5 * replicated["final_train_loss"]
  assert sharded["optimizer_state_bytes_per_device"] < replicated["optimizer_state_bytes_per_device"] / 3  # local 4
