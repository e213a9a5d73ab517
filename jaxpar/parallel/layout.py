"""Moving optimizer state between layouts alongside the parameters.

An optax state is a tree of NamedTuples whose fields are either parameter-shaped trees
(Adam's mu and nu, momentum's trace) or scalars (step counts). A strategy that reshapes
parameters (flattens and shards them, stacks blocks into stages) must reshape those
fields the same way and leave the scalars alone: `map_param_trees` does exactly that.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


def abstract(tree: Any) -> Any:
    """Shapes and dtypes of `tree` as ShapeDtypeStructs: a layout template that holds no data."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def map_param_trees(tree: Any, params_like: Any, fn: Callable[[Any], Any],
                    other: Callable[[Any], Any] = lambda x: x) -> Any:
    """Apply `fn` to every sub-tree of `tree` shaped like `params_like` (same tree structure),
    and `other` to every leaf outside such sub-trees.

    Args:
      tree: e.g. an optax state, or a whole TrainState.
      params_like: a tree with the parameters' structure (its leaves are not used).
      fn: params-structured tree -> transformed tree.
      other: leaf -> leaf, for scalars and anything else.
    """
    target = jax.tree.structure(params_like)

    def walk(node):
        try:
            if jax.tree.structure(node) == target:
                return fn(node)
        except Exception:  # noqa: BLE001 - some nodes (None) have no structure worth comparing
            pass
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # NamedTuple
            return type(node)(*(walk(c) for c in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(c) for c in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if hasattr(node, "replace") and hasattr(node, "__dataclass_fields__"):  # flax struct
            return node.replace(**{f: walk(getattr(node, f)) for f in node.__dataclass_fields__})
        return jax.tree.map(other, node)

    return walk(tree)


def host_copy(tree: Any) -> Any:
    """Host (numpy) copy of `tree`, like `jax.device_get`, except that an array split over
    other processes' devices (one global mesh under jax.distributed) is first gathered from
    every process. Every process must call it at the same point (it is a collective there)."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return x

    return jax.device_get(jax.tree.map(one, tree))
