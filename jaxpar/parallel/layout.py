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

from jaxpar.models.sequence import Key


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
    # only under jax.distributed (a global array to gather)
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return x

    return jax.device_get(jax.tree.map(one, tree))


def leaves(tree) -> list[tuple[Key, Any]]:
    """(path, leaf) of every leaf of a nested dict, paths as plain key tuples."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path), leaf) for path, leaf in flat]


def nest(items: list[tuple[Key, Any]]) -> dict:
    """The nested dict holding each (path, leaf)."""
    out: dict = {}
    for path, leaf in items:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return out


def _get(tree, path):
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            tree = tree[k.key]
        elif isinstance(k, jax.tree_util.SequenceKey):
            tree = tree[k.idx]
        else:
            tree = getattr(tree, k.name)
    return tree


def pick(structure, sources):
    """A tree shaped like `structure`, each leaf taken from the first source holding its path.

    Stage trees are sub-dicts of the reference tree with the same keys (blocks keep their
    global index), so this both gathers stages into the reference layout and cuts it up.
    """
    def one(path, _):
        for src in sources:
            try:
                return _get(src, path)
            except (KeyError, IndexError, AttributeError, TypeError):
                continue
        raise KeyError(jax.tree_util.keystr(path))
    return jax.tree_util.tree_map_with_path(one, structure)


def owned(tree, keys: list) -> dict:
    """The sub-dict of `tree` under any of `keys` (path prefixes): one stage's layers' entries."""
    mine = lambda path: any(path[:len(k)] == tuple(k) for k in keys)  # noqa: E731
    return nest([(path, x) for path, x in leaves(tree) if mine(path)])
