"""Uniform-stack residual MLP: the model that tensor and pipeline parallelism cut up.

Linear stem 784 -> width, then `depth` identical residual blocks
`h + down(act(up(h)))` with up: width -> 4*width and down: 4*width -> width (the
transformer feed-forward block without attention or normalisation), then a Linear head.
`up` is column-parallel and `down` row-parallel in the Megatron-LM split (Shoeybi et
al. 2019, fig. 3a); the identical blocks can be stacked and divided into pipeline stages.

Layout contract (relied on by jaxpar.parallel): `stem`, `blocks` (an nnx.List of
`ResidualBlock`s with identical graphdefs and state shapes), `head`;
`model(x) == readout(blocks[-1](... blocks[0](embed(x))))`.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.models import sequence
from jaxpar.models.mlp import ACTIVATIONS, get_activation
from jaxpar.models.sequence import Layer

EXPANSION = 4


class ResidualBlock(nnx.Module):
    """h -> h + down(act(up(h))); params `up` [width, 4w] and `down` [4w, width]."""

    def __init__(self, width: int, *, activation: str = "relu", depth: int = 1,
                 rngs: nnx.Rngs):
        get_activation(activation)
        self.activation = activation
        self.up = nnx.Linear(width, EXPANSION * width, rngs=rngs)
        # There is no normalisation, so each block adds variance to the residual stream.
        # Scaling the output projection's init by 1/depth (GPT-2's trick, in variance) keeps
        # the stream's growth over the whole stack bounded (about e^0.5) for any depth.
        self.down = nnx.Linear(
            EXPANSION * width, width, rngs=rngs,
            kernel_init=nnx.initializers.variance_scaling(1.0 / depth, "fan_in", "truncated_normal"))

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(ACTIVATIONS[self.activation](self.up(h)))


class StackMLP(nnx.Module):
    """Linear stem, `depth` identical residual blocks of `width`, Linear head."""

    def __init__(self, *, depth: int = 4, width: int = 256, activation: str = "relu",
                 num_classes: int = 10, in_features: int = 28 * 28, rngs: nnx.Rngs):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.stem = nnx.Linear(in_features, width, rngs=rngs)
        self.blocks = nnx.List([
            ResidualBlock(width, activation=activation, depth=depth, rngs=rngs)
            for _ in range(depth)])
        self.head = nnx.Linear(width, num_classes, rngs=rngs)

    def embed(self, x: jax.Array) -> jax.Array:
        """Images [B, 28, 28, 1] -> residual stream [B, width]."""
        return self.stem(x.reshape(x.shape[0], -1))

    def readout(self, h: jax.Array) -> jax.Array:
        """Residual stream [B, width] -> logits [B, num_classes]."""
        return self.head(h)

    def layers(self) -> list[Layer]:
        """stem (embed), block0 ... block(depth - 1), head (readout)."""
        def block(i):
            return lambda h, train: self.blocks[i](h)

        return ([Layer("stem", (("stem",),), lambda h, train: self.embed(h))]
                + [Layer(f"block{i}", (("blocks", i),), block(i)) for i in range(len(self.blocks))]
                + [Layer("head", (("head",),), lambda h, train: self.readout(h))])

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits [B, num_classes]; `train` is unused (no BN)."""
        return sequence.apply(self.layers(), x, train)
