"""Small ResNet for 28x28 inputs: the CIFAR ResNet-(6n+2) of He et al. 2016 (sec. 4.2).

Stem conv3x3(16)+BN+ReLU, three stages of `depth` (= n) basic blocks with 16, 32, 64
channels (28 -> 14 -> 7; stride 2 at the start of stages 2 and 3, where the shortcut is a
1x1 strided projection conv + BN, option B of the paper), global average pool, Linear.
depth=1 is ResNet-8, depth=3 ResNet-20. `conv_impl` picks how convolutions and batch norm
are computed (layers.py, batchnorm.py), not what.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.models import layers, sequence
from jaxpar.models.batchnorm import BATCH_NORM
from jaxpar.models.cnn import BN_MOMENTUM
from jaxpar.models.sequence import Layer


def _conv_bn(cin: int, cout: int, kernel: int, stride: int, impl: str, rngs: nnx.Rngs):
    # Convs feeding BN carry no bias: BN's shift makes it redundant.
    conv = nnx.Conv(cin, cout, (kernel, kernel), strides=(stride, stride), padding="SAME",
                    use_bias=False, conv_general_dilated=layers.CONV[impl], rngs=rngs)
    return conv, BATCH_NORM[impl](cout, momentum=BN_MOMENTUM, rngs=rngs)


class BasicBlock(nnx.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, *, impl: str, rngs: nnx.Rngs):
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride, impl, rngs)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3, 1, impl, rngs)
        self.project = stride != 1 or cin != cout
        if self.project:
            self.proj_conv, self.proj_bn = _conv_bn(cin, cout, 1, stride, impl, rngs)

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        ura = not train
        h = nnx.relu(self.bn1(self.conv1(x), use_running_average=ura))
        h = self.bn2(self.conv2(h), use_running_average=ura)
        shortcut = self.proj_bn(self.proj_conv(x), use_running_average=ura) if self.project else x
        return nnx.relu(h + shortcut)


class ResNet(nnx.Module):
    """ResNet-(6*depth+2) with widths 16/32/64; always batch-normalised."""

    def __init__(self, *, depth: int = 1, conv_impl: str = "auto", num_classes: int = 10,
                 rngs: nnx.Rngs):
        if depth < 1:
            raise ValueError(f"depth (blocks per stage) must be >= 1, got {depth}")
        impl = layers.resolve_conv_impl(conv_impl)
        self.stem_conv, self.stem_bn = _conv_bn(1, 16, 3, 1, impl, rngs)
        blocks, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(cin, cout, stride, impl=impl, rngs=rngs))
                cin = cout
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(64, num_classes, rngs=rngs)

    def layers(self) -> list[Layer]:
        """stem (conv, BN, ReLU), block0 ... block(3 depth - 1), head (average pool, Linear)."""
        def block(i):
            return lambda h, train: self.blocks[i](h, train)

        return ([Layer("stem", (("stem_conv",), ("stem_bn",)), lambda h, train: nnx.relu(
                    self.stem_bn(self.stem_conv(h), use_running_average=not train)))]
                + [Layer(f"block{i}", (("blocks", i),), block(i)) for i in range(len(self.blocks))]
                + [Layer("head", (("head",),), lambda h, train: self.head(h.mean(axis=(1, 2))))])

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits [B, num_classes]; `train=True` uses and updates batch statistics."""
        return sequence.apply(self.layers(), x, train)
