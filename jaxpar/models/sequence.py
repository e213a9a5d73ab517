"""A model as a sequence of layers: what `layer-split`, `pipeline` and `gems` cut into stages.

Every model's `layers()` lists its layers in order, and its `__call__` is exactly them applied
one after the other, so a stage is a run of consecutive layers:

    h = images
    for layer in model.layers():
        h = layer(h, train)                 # == model(images, train)

A layer names the entries of the model's state it owns (`keys`, paths like ("conv1",) or
("blocks", 3)), so a stage's parameters and batch-norm statistics are the entries of its
layers. Layers are the model's own modules, called as the model calls them: how a
convolution is computed stays the model's business.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

Key = tuple[Any, ...]  # a path into the model's state: ("fc1",), ("blocks", 0)


class Layer(NamedTuple):
    name: str                                        # "conv1", "block3", "head"
    keys: tuple[Key, ...]                            # the state entries it owns
    fn: Callable[[jax.Array, bool], jax.Array]       # (h, train) -> h

    def __call__(self, h: jax.Array, train: bool = False) -> jax.Array:
        return self.fn(h, train)


def apply(layers: list[Layer], h: jax.Array, train: bool = False) -> jax.Array:
    """`layers` applied in order (a model's `__call__`, or one stage of it)."""
    for layer in layers:
        h = layer(h, train)
    return h


def keys_of(module, *names: str) -> tuple[Key, ...]:
    """The (name,) paths of the attributes of `module` among `names` that exist (a CNN without
    batch norm has no `bn1`)."""
    return tuple((n,) for n in names if getattr(module, n, None) is not None)
