import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import fashion_mnist
from light_jax import optim, schedules
from light_jax.models import create_model
from light_jax.schedules import EpochPlan, Phase
from tests.helpers import init_variables


def _config(**opt):
  config = fashion_mnist.get_config()
  config.global_batch_size = 1024
  config.optimizer.update(base_lr=0.5, warmup_epochs=2.0, end_lr_factor=0.01, **opt)
  return config


def test_peak_lr_scales_linearly_with_batch():
  assert schedules.peak_learning_rate(_config().optimizer, 1024) == pytest.approx(0.5 * 1024 / 256)


@pytest.mark.parametrize("decay", ["poly", "linear", "cosine"])
def test_schedule_warms_up_linearly_then_decays_to_the_end_value(decay):
  # 10 epochs of 100 steps of 1024 examples.
  schedule = schedules.learning_rate_schedule(_config(decay=decay).optimizer, EpochPlan(102_400, 10, (), 1024))
  peak = 2.0
  assert float(schedule(0)) == 0.0
  assert float(schedule(50)) == pytest.approx(peak / 4)
  assert float(schedule(100)) == pytest.approx(peak / 2)
  assert float(schedule(200)) == pytest.approx(peak)
  assert float(schedule(1000)) == pytest.approx(peak * 0.01)
  mid = float(schedule(600))  # halfway through the 800 decay steps
  if decay == "poly":  # end + (peak - end) * (1 - 1/2)^2
    assert mid == pytest.approx(0.02 + (peak - 0.02) * 0.25)
  elif decay == "linear":  # end + (peak - end) * (1 - 1/2)
    assert mid == pytest.approx(0.02 + (peak - 0.02) * 0.5)
    assert float(schedule(800)) == pytest.approx(0.02 + (peak - 0.02) * 0.25)  # 3/4 through: a quarter left
  else:  # end + (peak - end) * (1 + cos(pi/2)) / 2
    assert mid == pytest.approx(0.02 + (peak - 0.02) * 0.5)


def test_schedule_with_a_batch_per_phase_keeps_its_shape_in_epochs_and_scales_the_peak():
  """Epochs 0-3 in batches of 1024 (100 steps each), epochs 4-9 in batches of 512 (200 steps each)."""
  plan = EpochPlan(102_400, 10, (Phase(0, 128), Phase(4, 224, 512)), 1024)
  assert plan.steps_per_epoch == [100] * 4 + [200] * 6 and plan.num_steps == 1600
  assert plan.epochs_done(450) == pytest.approx(4.25) and plan.step_at(4.25) == 450
  assert plan.step_at(2.3) == 230 and plan.step_at(2.305) == 230  # 0.3 x 100 in floats is 29.999...
  assert all(plan.step_at(plan.epochs_done(step)) == step for step in range(1600))  # its inverse
  assert plan.ends_epoch(400) and plan.ends_epoch(600) and not plan.ends_epoch(500)
  assert plan.batch_shape_at(399, (256, 256, 3)) == (1024, 128, 128, 3)
  assert plan.batch_shape_at(400, (256, 256, 3)) == (512, 224, 224, 3)
  assert EpochPlan(102_400, 10, (), 1024).batch_shape_at(0, (28, 28, 1)) == (1024, 28, 28, 1)  # the data's own size
  # Where auto plans its buckets: the phase with the least compute per step (1024 x 128^2 < 512 x 224^2), and
  # a later one where the first has more (288 px at 16,384, then 96 px at 32,768: the second).
  assert plan.leanest_step((256, 256, 3)) == 0
  later = EpochPlan(102_400, 10, (Phase(0, 288, 512), Phase(1, 96, 1024)), 1024)
  assert later.leanest_step((256, 256, 3)) == later.first_steps[1] == 200
  config = _config(decay="poly")  # warm-up 2 epochs, peak 0.5 * batch / 256
  schedule = schedules.learning_rate_schedule(config.optimizer, plan)
  assert float(schedule(100)) == pytest.approx(2.0 / 2)  # 1 epoch into the warm-up at batch 1024
  assert float(schedule(200)) == pytest.approx(2.0)  # peak at batch 1024
  # Epoch 7 of 10 (step 400 + 3 * 200): 5/8 through the decay, at the batch-512 peak of 1.0.
  assert float(schedule(1000)) == pytest.approx(1.0 * (0.01 + 0.99 * (1 - 5 / 8) ** 2))
  assert float(schedule(1600)) == pytest.approx(1.0 * 0.01)
  # Across the batch change the shape is continuous and the height halves with the batch.
  assert float(schedule(400)) == pytest.approx(0.5 * float(schedule(399)), rel=1e-2)


def test_no_weight_decay_or_trust_ratio_on_biases_and_batchnorm():
  model = create_model("resnet8_small", 10, width=4)
  params = init_variables(model, (28, 28, 1))["params"]
  mask = optim.decay_mask(params)
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
  assert flat["['Dense_0']['kernel']"] and flat["['conv_init']['kernel']"]
  assert not flat["['Dense_0']['bias']"] and not flat["['bn_init']['scale']"] and not flat["['bn_init']['bias']"]
  assert sum(flat.values()) == 1 + 6 + 1 + 2  # stem, 3 blocks x 2 convs, dense, 2 projections


@pytest.mark.parametrize("name", ["sgd", "lars", "lamb"])
def test_masked_parameters_get_no_weight_decay(name):
  """With zero gradient, decayed kernels move and BatchNorm/bias parameters stay put."""
  params = {"kernel": jnp.ones((3, 3)), "bias": jnp.ones((3,)), "scale": jnp.ones((3,))}
  config = _config(name=name, weight_decay=0.1)
  tx = optim.build_optimizer(config.optimizer, optax.constant_schedule(0.1))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  assert float(jnp.abs(updates["kernel"]).max()) > 0
  assert float(jnp.abs(updates["bias"]).max()) == 0 and float(jnp.abs(updates["scale"]).max()) == 0


def test_lars_trust_ratio_applies_to_kernels_only():
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 2.0)}
  grads = {"kernel": jnp.full((4, 4), 0.5), "bias": jnp.full((4,), 0.5)}
  tx = optim.build_optimizer(
    _config(name="lars", weight_decay=0.0, momentum=0.0, nesterov=False).optimizer, optax.constant_schedule(1.0)
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  # kernel: eta * ||w|| / ||g|| * g = 0.001 * 8 / 2 * 0.5; bias: plain -lr * g.
  np.testing.assert_allclose(updates["kernel"], -0.001 * 8.0 / 2.0 * 0.5, rtol=1e-6)
  np.testing.assert_allclose(updates["bias"], -0.5, rtol=1e-6)


def test_lamb_is_optax_lamb_on_kernels_and_adam_on_biases_and_batchnorm():
  """b1 is optimizer.momentum; biases and BatchNorm get neither weight decay nor a trust ratio."""
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 1e-3)}
  schedule = optax.constant_schedule(0.01)
  for momentum in (0.9, 0.5):
    config = _config(name="lamb", weight_decay=0.1, momentum=momentum, nesterov=True).optimizer  # nesterov: not LAMB's
    transforms = [
      optim.build_optimizer(config, schedule),
      optax.lamb(schedule, b1=momentum, weight_decay=0.1),  # the kernel's steps
      optax.chain(optax.scale_by_adam(b1=momentum, eps=1e-6), optax.scale_by_learning_rate(schedule)),  # the bias's
    ]
    states = [tx.init(params) for tx in transforms]
    grads = {"kernel": jnp.linspace(-1.0, 1.0, 16).reshape(4, 4), "bias": jnp.full((4,), 1.0)}
    for _ in range(3):  # past the first step, where Adam's step is sign(g) whatever b1 is
      steps = [tx.update(grads, state, params) for tx, state in zip(transforms, states)]
      (lamb, lamb_ref, adam), states = zip(*steps)
      grads = jax.tree.map(lambda g: 0.5 * g + 0.1, grads)
    np.testing.assert_allclose(lamb["kernel"], lamb_ref["kernel"], rtol=1e-6)
    np.testing.assert_allclose(lamb["bias"], adam["bias"], rtol=1e-6)
    assert float(jnp.abs(lamb_ref["bias"]).max()) < 1e-4 < float(jnp.abs(lamb["bias"]).min())  # optax.lamb's ratio


def test_label_smoothing():
  logits = jnp.array([[0.0, 0.0]])
  assert float(optim.cross_entropy(logits, jnp.array([0]), 2, 0.0)) == pytest.approx(np.log(2))
  # Smoothing 0.2 over 2 classes: targets (0.9, 0.1), so -0.9 log p0 - 0.1 log p1 with log p = -softplus(-+20).
  sharp = jnp.array([[10.0, -10.0]])
  expected = 0.9 * np.logaddexp(0.0, -20.0) + 0.1 * np.logaddexp(0.0, 20.0)
  assert float(optim.cross_entropy(sharp, jnp.array([0]), 2, 0.2)) == pytest.approx(expected, rel=1e-6)
  assert float(optim.cross_entropy(sharp, jnp.array([1]), 2, 0.2)) == pytest.approx(
    0.1 * np.logaddexp(0.0, -20.0) + 0.9 * np.logaddexp(0.0, 20.0), rel=1e-6
  )


def test_mlperf_lars_trust_ratio_divides_by_the_sum_of_norms():
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 2.0)}
  grads = {"kernel": jnp.full((4, 4), 0.5), "bias": jnp.full((4,), 0.5)}
  wd = 0.1
  config = _config(name="lars", lars_trust="mlperf", weight_decay=wd, momentum=0.0, nesterov=False)
  tx = optim.build_optimizer(config.optimizer, optax.constant_schedule(1.0))
  updates, _ = tx.update(grads, tx.init(params), params)
  # ||w|| = 8, ||g|| = 2: trust = eta * 8 / (2 + 0.1 * 8), applied to g + wd w; the bias: -g, no decay.
  np.testing.assert_allclose(updates["kernel"], -0.001 * 8 / 2.8 * (0.5 + wd * 2.0), rtol=1e-6)
  np.testing.assert_allclose(updates["bias"], -0.5, rtol=1e-6)
  optax_form = optim.build_optimizer(_config(name="lars", weight_decay=wd, momentum=0.0).optimizer, lambda s: 1.0)
  theirs, _ = optax_form.update(grads, optax_form.init(params), params)
  # optax: eta * ||w|| / ||g + wd w|| = 0.001 * 8 / (4 * 0.7): a different step.
  np.testing.assert_allclose(theirs["kernel"], -0.001 * 8 / 2.8 * 0.7, rtol=1e-6)


def test_cyclic_momentum_mirrors_the_learning_rate():
  config = _config(decay="cosine", momentum_schedule="cycle", momentum=0.95, min_momentum=0.85)
  config.optimizer.end_lr_factor = 0.0
  plan = EpochPlan(102_400, 10, (), 1024)  # 100 steps per epoch, warm-up 2 epochs
  momentum = schedules.momentum_schedule(config.optimizer, plan)
  assert float(momentum(0)) == pytest.approx(0.95)
  assert float(momentum(100)) == pytest.approx(0.90)  # halfway up the warm-up
  assert float(momentum(200)) == pytest.approx(0.85)  # at the peak learning rate
  assert float(momentum(1000)) == pytest.approx(0.95)  # the learning rate decayed to 0
  assert schedules.momentum_schedule(_config(momentum=0.9).optimizer, plan) == 0.9


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_a_scheduled_momentum_at_a_constant_value_is_the_constant_momentum(name):
  params = {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "bias": jnp.ones((4,))}
  grads = [jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 1)), params) for i in range(3)]
  config = _config(name=name)
  results = []
  for momentum in (0.9, lambda step: 0.9):
    tx = optim.build_optimizer(config.optimizer, optax.constant_schedule(0.1), momentum)
    state, p = tx.init(params), params
    for g in grads:
      updates, state = tx.update(g, state, p)
      p = optax.apply_updates(p, updates)
    results.append(p)
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_tensor_norms_from_one_packed_buffer_equal_the_norms_tensor_by_tensor():
  rng = np.random.default_rng(0)
  leaves = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(3, 3, 8, 16), (7,), (1024,), (1025, 3), (5, 2)]]
  leaves.append(jnp.zeros((4, 4)))  # a zero tensor: norm 0, not NaN
  np.testing.assert_allclose(optim.tensor_norms(leaves), [float(jnp.linalg.norm(x)) for x in leaves], rtol=1e-5)


@pytest.mark.parametrize("form", ["optax", "mlperf"])
def test_lars_per_tensor_and_fused_take_the_same_steps_and_the_optax_form_is_optax_lars(form):
  config = fashion_mnist.get_config("lars").optimizer
  config.lars_trust = form
  model = create_model("resnet8_small", num_classes=10, width=4)
  params = init_variables(model, (16, 16, 1))["params"]
  schedule = optax.constant_schedule(0.5)
  optimizers = [optim.build_optimizer(config, schedule)]
  config.fused_norms = True
  optimizers.append(optim.build_optimizer(config, schedule))
  if form == "optax":
    optimizers.append(
      optax.lars(
        schedule,
        weight_decay=config.weight_decay,
        weight_decay_mask=optim.decay_mask,
        trust_coefficient=config.lars_eta,
        trust_ratio_mask=optim.decay_mask,
        momentum=config.momentum,
        nesterov=config.nesterov,
      )
    )
  states = [jax.jit(tx.init)(params) for tx in optimizers]
  steps = [_jitted_step(tx) for tx in optimizers]
  outs = [params] * len(optimizers)
  for step in range(3):
    rng = np.random.default_rng(step)  # numpy: no program compiled per tensor shape
    grads = jax.tree.map(lambda p: (rng.standard_normal(p.shape) * 1e-2).astype(np.float32), params)
    for k in range(len(optimizers)):
      outs[k], states[k] = steps[k](grads, states[k], outs[k])
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(params)))
  assert moved > 1e-4
  for other in outs[1:]:
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(other)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _jitted_step(tx):
  """One jitted optimizer step: the update and its application."""

  @jax.jit
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_without_momentum_the_optimizer_keeps_no_velocity(name):
  """Momentum 0 (DGC's momentum correction keeps it in the reducer): no parameter-sized trace of zeros,
  and the steps are those of the same optimizer written without momentum."""
  params = {"kernel": jnp.ones((8, 8)), "bias": jnp.ones(8)}
  grads = jax.tree.map(lambda p: 0.1 * p, params)
  opt = _config(name=name, momentum=0.9).optimizer
  tx = optim.build_optimizer(opt, optax.constant_schedule(0.5), momentum=0.0)
  state = tx.init(params)
  assert sum(x.size for x in jax.tree.leaves(state)) < 8  # step counters at most
  if name == "sgd":
    plain = optax.chain(optax.add_decayed_weights(opt.weight_decay, mask=optim.decay_mask), optax.sgd(0.5))
  else:
    plain = optax.chain(optim._lars_trust(opt), optax.scale_by_learning_rate(0.5))
  expected, _ = plain.update(grads, plain.init(params), params)
  updates, _ = tx.update(grads, state, params)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
