"""Tiny Vision Transformer (Dosovitskiy et al. 2021, fig. 1) for 28x28x1 images.

7x7 patches -> 16 tokens -> Linear(49 -> d) + learned position embedding [16, d], then
`depth` identical pre-LN blocks (LN -> multi-head self-attention -> residual, LN -> MLP
d -> 4d -> d with GELU -> residual), final LN, mean over tokens (no class token), Linear.

Attention is written with explicit [d, d] `query`, `key`, `value`, `out` Linears so a
tensor-parallel strategy can split heads by slicing columns of q/k/v and rows of `out`
(Megatron-LM, Shoeybi et al. 2019, fig. 3b): the head count is read from the q width
at call time (q width // head_dim), so a block whose q/k/v hold a column slice of whole
heads computes exactly those heads. The same layout contract as stack_mlp holds:
`model(x) == readout(blocks[-1](... blocks[0](embed(x))))`, blocks identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import sequence
from jaxpar.models.sequence import Layer

PATCH = 7
TOKENS = (28 // PATCH) ** 2
EXPANSION = 4


class TransformerBlock(nnx.Module):
    """Pre-LN block; params ln1, query, key, value, out, ln2, up, down."""

    def __init__(self, width: int, *, heads: int = 4, rngs: nnx.Rngs):
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.head_dim = width // heads
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.query = nnx.Linear(width, width, rngs=rngs)
        self.key = nnx.Linear(width, width, rngs=rngs)
        self.value = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, EXPANSION * width, rngs=rngs)
        self.down = nnx.Linear(EXPANSION * width, width, rngs=rngs)

    def attention_heads(self, h: jax.Array) -> jax.Array:
        """Concatenated head outputs [B, T, heads*head_dim] before `out` (h is normalised)."""
        b, t, _ = h.shape
        split = lambda y: y.reshape(b, t, -1, self.head_dim)  # heads from the q/k/v width
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, -1)

    def __call__(self, h: jax.Array) -> jax.Array:
        """Residual stream [B, T, d] -> [B, T, d]."""
        h = h + self.out(self.attention_heads(self.ln1(h)))
        return h + self.down(nnx.gelu(self.up(self.ln2(h))))


def patchify(x: jax.Array) -> jax.Array:
    """[B, 28, 28, C] -> [B, 16, 49*C], patches in row-major order."""
    b, hgt, wid, c = x.shape
    g = hgt // PATCH
    x = x.reshape(b, g, PATCH, wid // PATCH, PATCH, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, g * (wid // PATCH), PATCH * PATCH * c)


class ViT(nnx.Module):
    """Patch embedding + position embedding, `depth` TransformerBlocks of `width`, LN, mean, Linear."""

    def __init__(self, *, depth: int = 4, width: int = 64, heads: int = 4,
                 num_classes: int = 10, rngs: nnx.Rngs):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.patch_embed = nnx.Linear(PATCH * PATCH, width, rngs=rngs)
        self.pos_embed = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (TOKENS, width)))
        self.blocks = nnx.List(
            [TransformerBlock(width, heads=heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, num_classes, rngs=rngs)

    def embed(self, x: jax.Array) -> jax.Array:
        """Images [B, 28, 28, 1] -> tokens [B, 16, width]."""
        return self.patch_embed(patchify(x)) + self.pos_embed[...]

    def readout(self, h: jax.Array) -> jax.Array:
        """Tokens [B, 16, width] -> logits [B, num_classes]."""
        return self.head(self.norm(h).mean(axis=1))

    def layers(self) -> list[Layer]:
        """embed (patches + positions), block0 ... block(depth - 1), readout (LN, mean, head)."""
        def block(i):
            return lambda h, train: self.blocks[i](h)

        return ([Layer("embed", (("patch_embed",), ("pos_embed",)), lambda h, train: self.embed(h))]
                + [Layer(f"block{i}", (("blocks", i),), block(i)) for i in range(len(self.blocks))]
                + [Layer("readout", (("norm",), ("head",)), lambda h, train: self.readout(h))])

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits [B, num_classes]; `train` is unused (no BN, no dropout)."""
        return sequence.apply(self.layers(), x, train)
