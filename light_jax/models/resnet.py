"""ResNet v1.5 in flax.linen, for ImageNet-size and small (28x28, 32x32) images.

Conventions (those of the large-batch ImageNet recipes, MLPerf and flax/examples/imagenet):
- v1.5: the stride-2 of a bottleneck block sits on its 3x3 convolution, not on the first 1x1.
- The last BatchNorm of every residual block starts with scale 0, so each block starts as the identity
  (Goyal et al. 2017); this matters at large batch sizes.
- Parameters are always float32; ``dtype`` is the compute dtype (float32, bfloat16, or float16 with loss
  scaling); BatchNorm reduces in float32 whatever it is (flax's ``force_float32_reductions``).
- **BatchNorm statistics are per device.** The train step runs the model inside ``jax.shard_map`` on the
  device's shard of the batch, so mean and variance are those of the local batch (as in the ImageNet
  recipes that train at 32k-64k global batch, where cross-device BN would cost a collective per layer).
  Each device keeps the running averages of its own batches; evaluation averages them over the devices
  (``evaluation.mesh_batch_stats``), which gives the running averages of the devices' averaged statistics.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class BasicBlock(nn.Module):
  """Two 3x3 convolutions (ResNet-18/34 and the small variants)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class BottleneckBlock(nn.Module):
  """1x1 -> 3x3 (strided, v1.5) -> 1x1 with 4x expansion (ResNet-50/101/152)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (1, 1))(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.filters, (3, 3), self.strides)(y)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class ResNet(nn.Module):
  """ResNet over NHWC images already normalised to about zero mean, unit variance.

  Attributes:
    stage_sizes: residual blocks per stage.
    block_cls: BasicBlock or BottleneckBlock.
    num_classes: size of the output logits.
    num_filters: width of the first stage (doubles at each later stage).
    small_inputs: 3x3 stem and no max-pool, for 28x28 / 32x32 images; otherwise the ImageNet stem
      (7x7 stride-2 conv, 3x3 stride-2 max-pool).
    stem_strides: stride of the small-input stem (2 quarters the cost of every later layer).
    dtype: compute dtype; parameters stay float32.
    bn_momentum: decay of the BatchNorm running averages (0.9: short runs need fast averages).
  """

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  small_inputs: bool = False
  stem_strides: int = 1
  dtype: Any = jnp.float32
  bn_momentum: float = 0.9

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=self.bn_momentum,
      epsilon=1e-5,
      dtype=self.dtype,
      param_dtype=jnp.float32,
    )
    x = x.astype(self.dtype)
    if self.small_inputs:
      x = conv(self.num_filters, (3, 3), (self.stem_strides,) * 2, name="conv_init")(x)
      x = nn.relu(norm(name="bn_init")(x))
    else:
      x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
      x = nn.relu(norm(name="bn_init")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_count in enumerate(self.stage_sizes):
      for j in range(block_count):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(self.num_filters * 2**i, conv=conv, norm=norm, strides=strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32)(x)
    # The classifier computes in self.dtype (as flax's ImageNet example): the logits are rounded to it, then
    # widened, so that the softmax and the loss run in float32.
    return x.astype(jnp.float32)


# name -> (stage sizes, block, first-stage width, small-input stem, small-stem stride)
ARCHITECTURES = {
  "resnet18": ((2, 2, 2, 2), BasicBlock, 64, False, 1),
  "resnet34": ((3, 4, 6, 3), BasicBlock, 64, False, 1),
  "resnet50": ((3, 4, 6, 3), BottleneckBlock, 64, False, 1),
  "resnet101": ((3, 4, 23, 3), BottleneckBlock, 64, False, 1),
  "resnet152": ((3, 8, 36, 3), BottleneckBlock, 64, False, 1),
  # Small variants for 28x28 / 32x32 images (CIFAR-style, He et al. 2016 section 4.2).
  "resnet8_small": ((1, 1, 1), BasicBlock, 16, True, 1),
  # Stride-2 stem: 14x14 feature maps from 28x28 inputs; fast enough to train on two CPU cores.
  "resnet8_fast": ((1, 1, 1), BasicBlock, 32, True, 2),
  "resnet20_small": ((3, 3, 3), BasicBlock, 16, True, 1),
  "resnet18_small": ((2, 2, 2, 2), BasicBlock, 64, True, 1),
}


def create_model(name: str, num_classes: int, dtype: str = "float32", width: int = 0) -> ResNet:
  """Builds a model from ``ARCHITECTURES``; ``width`` > 0 overrides the first-stage width."""
  if name not in ARCHITECTURES:
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(ARCHITECTURES)}")
  stages, block, filters, small, stem_strides = ARCHITECTURES[name]
  return ResNet(
    stage_sizes=stages,
    block_cls=block,
    num_classes=num_classes,
    num_filters=width or filters,
    small_inputs=small,
    stem_strides=stem_strides,
    dtype=jnp.dtype(dtype),
  )
