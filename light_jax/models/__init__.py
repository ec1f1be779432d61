"""Models: the ResNet family."""

from light_jax.models.resnet import ARCHITECTURES, ResNet, create_model

__all__ = ["ARCHITECTURES", "ResNet", "create_model"]
