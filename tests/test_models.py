import jax
import jax.numpy as jnp
import pytest

from light_jax.models import ARCHITECTURES, create_model
from tests.helpers import init_variables


def _params(name, num_classes, shape):
  model = create_model(name, num_classes)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(shape), train=False))


def test_resnet50_has_the_published_parameter_count():
  variables = _params("resnet50", 1000, (1, 224, 224, 3))
  assert sum(p.size for p in jax.tree.leaves(variables["params"])) == 25_557_032


@pytest.mark.parametrize(
  "name,count",
  [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet101", 44_549_160), ("resnet152", 60_192_808)],
)
def test_family_parameter_counts_match_torchvision(name, count):
  variables = _params(name, 1000, (1, 224, 224, 3))
  assert sum(p.size for p in jax.tree.leaves(variables["params"])) == count


def test_last_batchnorm_of_each_block_starts_at_zero():
  model = create_model("resnet8_small", 10, width=4)
  params = init_variables(model, (28, 28, 1))["params"]
  blocks = [k for k in params if k.startswith("BasicBlock")]
  assert len(blocks) == 3
  for b in blocks:
    assert float(jnp.abs(params[b]["BatchNorm_1"]["scale"]).max()) == 0.0
    assert float(params[b]["BatchNorm_0"]["scale"].min()) == 1.0


def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = create_model("resnet8_fast", 10, dtype="bfloat16")
  x = jnp.ones((2, 28, 28, 1))
  variables = init_variables(model, x.shape[1:])
  assert {p.dtype for p in jax.tree.leaves(variables["params"])} == {jnp.dtype(jnp.float32)}
  logits = jax.jit(lambda v: model.apply(v, x, train=False))(variables)
  assert logits.shape == (2, 10) and logits.dtype == jnp.float32
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x, train=False))(variables)
  assert "bf16" in str(jaxpr)


def test_small_models_fit_28x28():
  for name in [n for n in ARCHITECTURES if n.endswith(("_small", "_fast"))]:
    assert _params(name, 10, (1, 28, 28, 1))["params"]["Dense_0"]["kernel"].shape[1] == 10


def test_unknown_model_is_refused():
  with pytest.raises(ValueError, match="unknown model 'resnet7'"):
    create_model("resnet7", 10)
