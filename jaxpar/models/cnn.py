"""Small convolutional classifier, the Flax/Keras MNIST example network.

conv3x3(32) -> ReLU -> maxpool2 -> conv3x3(64) -> ReLU -> maxpool2 -> Linear(128) -> ReLU
-> Linear(10), SAME padding so 28 -> 14 -> 7. With `batch_norm=True` a BatchNorm follows
each conv (before the ReLU), and the convs drop their bias since BN's shift replaces it.
`conv_impl` picks how convolutions, pooling and batch norm are computed (layers.py,
batchnorm.py), not what.
"""

from __future__ import annotations

import functools
import math

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

    CONV2_FEATURES = 64  # conv2's output channels

    def __init__(self, *, batch_norm: bool = False, conv_impl: str = "auto",
                 num_classes: int = 10, rngs: nnx.Rngs):
        self.batch_norm = batch_norm
        impl = layers.resolve_conv_impl(conv_impl)
        conv = functools.partial(nnx.Conv, padding="SAME", use_bias=not batch_norm,
                                 conv_general_dilated=layers.CONV[impl], rngs=rngs)
        self.conv1 = conv(1, 32, (3, 3))
        self.conv2 = conv(32, self.CONV2_FEATURES, (3, 3))
        self.pool = layers.POOL[impl]
        if batch_norm:
            self.bn1 = BATCH_NORM[impl](32, momentum=BN_MOMENTUM, rngs=rngs)
            self.bn2 = BATCH_NORM[impl](self.CONV2_FEATURES, momentum=BN_MOMENTUM, rngs=rngs)
        self.fc1 = nnx.Linear(7 * 7 * self.CONV2_FEATURES, 128, rngs=rngs)
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


class CNNCut(nnx.Module):
    """`CNN` with conv2 held as two convolutions over the same input, its first k output
    channels and the rest: the same function, with a layer boundary inside conv2 that a
    pipeline can put between two stages (`jaxpar.parallel.pipeline.inner_cut`).

    The first part hands on conv1's output (which the second part convolves too) and its own
    k channels after ReLU and pooling, raveled side by side per example; the second joins
    its channels after them, so the output is conv2's layer's, channel for channel. Batch norm
    is per channel, so bn2 splits the same way. Built from a CNN (its values, sliced).
    """

    def __init__(self, cnn: CNN, k: int, image_shape: tuple[int, ...]):
        self.k, self.batch_norm, self.pool = k, cnn.batch_norm, cnn.pool
        self.conv1, self.fc1, self.fc2 = cnn.conv1, cnn.fc1, cnn.fc2
        self.conv2a, self.conv2b = _channels(cnn.conv2, slice(0, k)), _channels(cnn.conv2, slice(k, None))
        if cnn.batch_norm:
            self.bn1 = cnn.bn1
            self.bn2a, self.bn2b = _channels(cnn.bn2, slice(0, k)), _channels(cnn.bn2, slice(k, None))
        # per-example shapes of conv1's output and of the first part's channels (pooled)
        h = jax.eval_shape(lambda x: cnn.layers()[0](x), jax.ShapeDtypeStruct((1, *image_shape), jax.numpy.float32))
        self.h_shape = h.shape[1:]
        self.part_shape = (*jax.eval_shape(lambda x: self.pool(x), h).shape[1:-1], k)

    def layers(self) -> list[Layer]:
        bn1, bn2a, bn2b = (getattr(self, n, None) for n in ("bn1", "bn2a", "bn2b"))
        n = math.prod(self.h_shape)

        def first(h, train):
            mine = CNN.after_conv(self, bn2a, self.conv2a(h), train)
            return jax.numpy.concatenate([h.reshape(h.shape[0], -1), mine.reshape(h.shape[0], -1)], 1)

        def second(x, train):
            h, mine = x[:, :n].reshape(-1, *self.h_shape), x[:, n:].reshape(-1, *self.part_shape)
            return jax.numpy.concatenate([mine, CNN.after_conv(self, bn2b, self.conv2b(h), train)], -1)

        k, out = self.k, self.conv2b.out_features + self.k
        return [
            Layer("conv1", sequence.keys_of(self, "conv1", "bn1"),
                  lambda h, train: CNN.after_conv(self, bn1, self.conv1(h), train)),
            Layer(f"conv2[:{k}]", sequence.keys_of(self, "conv2a", "bn2a"), first),
            Layer(f"conv2[{k}:{out}]", sequence.keys_of(self, "conv2b", "bn2b"), second),
            Layer("fc1", (("fc1",),), lambda h, train: nnx.relu(self.fc1(h.reshape(h.shape[0], -1)))),
            Layer("fc2", (("fc2",),), lambda h, train: self.fc2(h)),
        ]

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        return sequence.apply(self.layers(), x, train)


def _channels(module: nnx.Module, part: slice) -> nnx.Module:
    """A copy of a convolution or batch norm holding only the output channels `part` (the
    last axis of each of its variables)."""
    out = nnx.clone(module)
    for name, var in list(vars(out).items()):
        if isinstance(var, nnx.Variable) and var.get_value() is not None:
            setattr(out, name, type(var)(var.get_value()[..., part]))
    if hasattr(out, "out_features"):
        out.out_features = out.kernel.shape[-1]
    if hasattr(out, "num_features"):
        out.num_features = out.scale.shape[-1]
    return out
