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
