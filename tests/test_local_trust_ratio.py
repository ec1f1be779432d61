"""comm.local_trust_ratio: LARS's weight decay and trust ratio on each device's gradient before the
reduction, the optimizer keeping the learning rate and momentum (light_jax/optim.py, local_transform)."""

import jax
import ml_collections
import numpy as np
import optax
import pytest

from light_jax import optim
from light_jax import train_step as step_lib
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from tests.helpers import TinyCNN
from tests.test_train_step import _batches, _config, _max_diff


def _train(shape, batches, info, local_trust: bool, form: str):
  comm = {"local_trust_ratio": local_trust, "momentum_correction": False}
  config = ml_collections.ConfigDict({"optimizer": _config("lars").optimizer, "comm": comm})
  config.optimizer.lars_trust = form
  tx = optim.build_optimizer(config.optimizer, optax.constant_schedule(1.0), decay=not local_trust)
  mesh = mesh_lib.make_mesh(*shape)
  reducer = reducer_lib.make_gradient_reducer("hierarchical", *shape)
  model = TinyCNN()
  state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
  step = step_lib.make_train_step(
    model, tx, reducer, mesh, info, label_smoothing=0.1, local_tx=optim.local_transform(config)
  )
  sharding = mesh_lib.batch_sharding(mesh)
  for images, labels in batches:
    state, _ = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
  return jax.device_get(state.params)


def _same_on_every_device(batches, devices=8):
  """Each device's slice of every batch made equal to the first device's."""
  out = []
  for images, labels in batches:
    n = len(images) // devices
    out.append((np.concatenate([images[:n]] * devices), np.concatenate([labels[:n]] * devices)))
  return out


@pytest.mark.parametrize("form", ["optax", "mlperf"])
def test_with_the_same_gradient_on_every_device_it_is_lars(form):
  """Equal local gradients have the mean's trust ratio: the step is LARS's, on 2 x 4. With different
  data per device it is not (each device's ratio comes from its own gradient): the check can fail."""
  batches, info = _batches(3)
  same = _same_on_every_device(batches)
  lars = _train((2, 4), same, info, local_trust=False, form=form)
  local = _train((2, 4), same, info, local_trust=True, form=form)
  assert _max_diff(lars, local) < 1e-5
  differs = _max_diff(_train((2, 4), batches, info, False, form), _train((2, 4), batches, info, True, form))
  assert differs > 1e-4


def _train_with_momentum_correction(batches, info, local_trust: bool):
  """LARS with DGC's momentum correction: the momentum in the reducer, every bucket sent dense (hitopk's fallback
  below min_compress_elements), the optimizer without momentum."""
  comm = {"local_trust_ratio": local_trust, "momentum_correction": True}
  config = ml_collections.ConfigDict({"optimizer": _config("lars").optimizer, "comm": comm})
  opt, shape = config.optimizer, (2, 4)
  tx = optim.build_optimizer(opt, optax.constant_schedule(1.0), momentum=0.0, decay=not local_trust)
  mesh = mesh_lib.make_mesh(*shape)
  reducer = reducer_lib.make_gradient_reducer(
    "hitopk", *shape, min_compress_elements=10**9, momentum_correction=opt.momentum, nesterov=opt.nesterov
  )
  state = step_lib.create_train_state(TinyCNN(), tx, reducer, info.image_shape, mesh, seed=0)
  step = step_lib.make_train_step(
    TinyCNN(), tx, reducer, mesh, info, label_smoothing=0.1, local_tx=optim.local_transform(config)
  )
  sharding = mesh_lib.batch_sharding(mesh)
  for images, labels in batches:
    state, _ = step(state, jax.device_put(images, sharding), jax.device_put(labels, sharding))
  return jax.device_get(state.params)


def test_momentum_correction_with_the_local_trust_ratio_is_its_momentum_and_without_it_is_not():
  """With the trust ratio before the reduction, the reducer's velocity is optax's momentum of the same scaled
  gradients: at density 1 the steps are comm.local_trust_ratio's own. After the reduction (what config.validate
  refuses) LARS rescales the velocity to a layer's step each time, undoing the momentum: another run."""
  batches, info = _batches(3)
  local = _train((2, 4), batches, info, local_trust=True, form="optax")
  assert _max_diff(_train_with_momentum_correction(batches, info, local_trust=True), local) < 1e-5
  lars = _train((2, 4), batches, info, local_trust=False, form="optax")
  assert _max_diff(_train_with_momentum_correction(batches, info, local_trust=False), lars) > 1e-3
