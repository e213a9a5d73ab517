"""Small convolutional classifier, the Flax/Keras MNIST example network.

conv3x3(32) -> ReLU -> maxpool2 -> conv3x3(64) -> ReLU -> maxpool2 -> Linear(128) -> ReLU
-> Linear(10), SAME padding so 28 -> 14 -> 7. With `batch_norm=True` a BatchNorm follows
each conv (before the ReLU), and the convs drop their bias since BN's shift replaces it.
`conv_impl` picks how convolutions, pooling and batch norm are computed (layers.py,
batchnorm.py), not what.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxpar.models import layers, sequence
from jaxpar.models.batchnorm import BATCH_NORM
from jaxpar.models.sequence import Layer

# Flax's default BN momentum (0.99) lets running statistics lag far behind the weights in
# runs of a few thousand steps; 0.9 (PyTorch's 0.1) makes eval-mode accuracy trustworthy.
BN_MOMENTUM = 0.9


class CNN(nnx.Module):
    """Two conv/pool stages and a two-layer head; 421,642 parameters without BN."""

    def __init__(self, *, batch_norm: bool = False, conv_impl: str = "auto",
                 num_classes: int = 10, rngs: nnx.Rngs):
        self.batch_norm = batch_norm
        impl = layers.resolve(conv_impl)
        conv = functools.partial(nnx.Conv, padding="SAME", use_bias=not batch_norm,
                                 conv_general_dilated=layers.CONV[impl], rngs=rngs)
        self.conv1 = conv(1, 32, (3, 3))
        self.conv2 = conv(32, 64, (3, 3))
        self.pool = layers.POOL[impl]
        if batch_norm:
            self.bn1 = BATCH_NORM[impl](32, momentum=BN_MOMENTUM, rngs=rngs)
            self.bn2 = BATCH_NORM[impl](64, momentum=BN_MOMENTUM, rngs=rngs)
        self.fc1 = nnx.Linear(7 * 7 * 64, 128, rngs=rngs)
        self.fc2 = nnx.Linear(128, num_classes, rngs=rngs)

    def after_conv(self, bn: nnx.BatchNorm | None, x: jax.Array, train: bool) -> jax.Array:
        """What follows a convolution: BN (if any), ReLU, 2x2 max-pool (all per channel, so a
        tensor-parallel shard of the channels runs it on its own channels alone)."""
        if bn is not None:
            x = bn(x, use_running_average=not train)
        return self.pool(nnx.relu(x))

    def layers(self) -> list[Layer]:
        """conv1 (+bn1, ReLU, pool), conv2 (+bn2, ReLU, pool), fc1 (flattens), fc2."""
        bn1, bn2 = getattr(self, "bn1", None), getattr(self, "bn2", None)
        return [
            Layer("conv1", sequence.keys_of(self, "conv1", "bn1"),
                  lambda h, train: self.after_conv(bn1, self.conv1(h), train)),
            Layer("conv2", sequence.keys_of(self, "conv2", "bn2"),
                  lambda h, train: self.after_conv(bn2, self.conv2(h), train)),
            Layer("fc1", (("fc1",),), lambda h, train: nnx.relu(self.fc1(h.reshape(h.shape[0], -1)))),
            Layer("fc2", (("fc2",),), lambda h, train: self.fc2(h)),
        ]

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits [B, num_classes]; `train=True` normalises by batch statistics and updates them."""
        return sequence.apply(self.layers(), x, train)
