"""Fully connected classifier: flatten, `depth` hidden layers of `width`, Linear to 10.

The default 784-512-512-10 ReLU net is the usual MLP baseline for (Fashion-)MNIST;
`activation="sigmoid"` gives the from-scratch networks of the early literature
(e.g. Nielsen, "Neural Networks and Deep Learning", ch. 1, 784-30-10 sigmoid).
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from jaxpar.models import sequence
from jaxpar.models.sequence import Layer

# Shared with stack_mlp.py, so both models offer the same names.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": nnx.relu,
    "sigmoid": nnx.sigmoid,
    "tanh": nnx.tanh,
}


def get_activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activation function called `name`; ValueError listing the choices otherwise."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; choices are: {', '.join(ACTIVATIONS)}") from None


class MLP(nnx.Module):
    """784 -> `depth` x Linear(`width`) + activation -> Linear(`num_classes`)."""

    def __init__(self, *, depth: int = 2, width: int = 512, activation: str = "relu",
                 num_classes: int = 10, in_features: int = 28 * 28, rngs: nnx.Rngs):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        get_activation(activation)  # fail at construction, not at the first call
        self.activation = activation
        sizes = [in_features] + [width] * depth
        self.hidden = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])
        self.out = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

    def layers(self) -> list[Layer]:
        """hidden0 (flattens the image), hidden1, ..., out: the pieces stages are cut from."""
        act = ACTIVATIONS[self.activation]

        def hidden(i):
            return lambda h, train: act(self.hidden[i](h.reshape(h.shape[0], -1)))

        return ([Layer(f"hidden{i}", (("hidden", i),), hidden(i)) for i in range(len(self.hidden))]
                + [Layer("out", (("out",),), lambda h, train: self.out(h.reshape(h.shape[0], -1)))])

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Logits [B, num_classes] for images [B, 28, 28, 1]; `train` is unused (no BN)."""
        return sequence.apply(self.layers(), x, train)
