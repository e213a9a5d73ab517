"""What model-parallel strategies need to know about a model of identical blocks.

The stack-mlp and the ViT share a layout contract (jaxpar/models/stack_mlp.py):
`model(x) == readout(blocks[-1](... blocks[0](embed(x))))`, with `blocks` an nnx.List of
blocks with identical structure. Tensor parallelism splits each block's dense layers;
layer-split cuts the list into stages. This module checks the contract (a clear
ConfigError otherwise) and finds which of the other parameters `embed` uses (they live on
the first stage) and which `readout` uses (the last stage).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxpar.config import ConfigError

BLOCKS = "blocks"  # the key of the block list in the parameter tree (the model's attribute)


def require_blocks(model: nnx.Module, strategy: str) -> int:
    """Check `model` has identical blocks plus `embed`/`readout`; return the block count.

    Raises:
      ConfigError naming --model when the model cannot be cut into blocks.
    """
    blocks = getattr(model, BLOCKS, None)
    ok = blocks is not None and hasattr(model, "embed") and hasattr(model, "readout") and len(blocks) > 0
    if ok:
        shapes = [jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(b, nnx.Param))) for b in blocks]
        ok = all(s == shapes[0] for s in shapes) and len({type(b) for b in blocks}) == 1
    if not ok:
        raise ConfigError(
            f"--strategy {strategy} needs a model of identical blocks; use --model stack-mlp or "
            f"--model vit (got {type(model).__name__})")
    return len(blocks)


def shell(model: nnx.Module) -> nnx.Module:
    """A copy of `model` without its blocks: its params are exactly the non-block ones, and its
    `embed` / `readout` methods still work."""
    outer = nnx.clone(model)
    setattr(outer, BLOCKS, nnx.List([]))
    return outer


def used_by(fn, tree) -> list[str]:
    """Top-level keys of dict `tree` whose leaves `fn(tree)` reads (from its jaxpr)."""
    closed = jax.make_jaxpr(fn)(tree)
    used = set()
    for eqn in closed.jaxpr.eqns:
        used.update(id(v) for v in eqn.invars if not hasattr(v, "val"))
    used.update(id(v) for v in closed.jaxpr.outvars if not hasattr(v, "val"))
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    keys = []
    for (path, _), var in zip(leaves, closed.jaxpr.invars):
        key = path[0].key
        if id(var) in used and key not in keys:
            keys.append(key)
    return keys
