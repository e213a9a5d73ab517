"""The Megatron-LM split of a block over the TENSOR axis, shared by `tensor` and `hybrid`.

Shoeybi et al. 2019, fig. 3: a block's column-parallel layers (`up`; in the ViT also
`query`/`key`/`value`, so every device holds whole attention heads) keep a column slice of
their kernel and bias; the row-parallel layer after them (`down`, `out`) keeps a row slice
of its kernel, and its partial products are summed with one `psum` over TENSOR before its
(replicated) bias is added once. The block input is cast to tensor-varying once (Megatron's
`f`), so the backward pass has exactly one all-reduce per sub-block too. LayerNorms stay
replicated.

    spec = leaf_spec("up", "kernel")            # P(None, 'tensor')
    h = block(block_module, h)                  # inside shard_map, on this device's shard
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.mesh import TENSOR
from jaxpar.models import abstract_model
from jaxpar.models.mlp import ACTIVATIONS
from jaxpar.models.vit import TransformerBlock

COLUMN = ("up", "query", "key", "value")  # kernel split on the output dim, bias split
ROW = ("down", "out")                     # kernel split on the input dim, bias replicated


def leaf_spec(layer: str, kind: str, lead: tuple = ()) -> P:
    """PartitionSpec of one block parameter, `kind` ('kernel', 'bias', 'scale') of `layer`.

    Args:
      lead: specs of leading dimensions the layout adds (hybrid's stacked blocks: (STAGE,)).
    """
    if layer in COLUMN:
        return P(*lead, None, TENSOR) if kind == "kernel" else P(*lead, TENSOR)
    if layer in ROW and kind == "kernel":
        return P(*lead, TENSOR, None)
    return P(*lead)


def check_divisible(model, degree: int, strategy: str) -> None:
    """ConfigError if the width (stack-mlp) or head count (vit) does not split `degree` ways."""
    block = model.blocks[0]
    width = block.up.in_features
    if isinstance(block, TransformerBlock):
        heads = width // block.head_dim
        if heads % degree:
            raise ConfigError(f"--strategy {strategy}: the ViT's {heads} heads do not split over "
                              f"tensor={degree}; change --mesh tensor= to a divisor of {heads}")
    elif width % degree:
        raise ConfigError(f"--strategy {strategy}: --width {width} is not divisible by "
                          f"tensor={degree}; change --width or --mesh tensor=")


def split_problems(config, degree: int, strategy: str) -> list[str]:
    """`check_divisible` on the model `config` builds, traced (nothing allocated), as a list of
    problems for `jaxpar.validate`."""
    try:
        check_divisible(abstract_model(config.model), degree, strategy)
    except ConfigError as e:
        return [str(e).rstrip(".") + "."]
    return []


def _row(linear: nnx.Linear, a: jax.Array) -> jax.Array:
    """Row-parallel Linear: partial products summed over TENSOR, then the bias added once."""
    return jax.lax.psum(a @ linear.kernel[...], TENSOR) + linear.bias[...]


def _varying(x: jax.Array) -> jax.Array:
    # Megatron's `f`: identity forward; its transpose is the block's one backward all-reduce.
    return jax.lax.pcast(x, TENSOR, to="varying")


def block(module, h: jax.Array) -> jax.Array:
    """One block (a stack-mlp ResidualBlock or a ViT TransformerBlock) on this device's shard
    of it, inside shard_map over TENSOR: the same math as `module(h)` on the whole block."""
    if isinstance(module, TransformerBlock):
        h = h + _row(module.out, module.attention_heads(_varying(module.ln1(h))))
        return h + _row(module.down, nnx.gelu(module.up(_varying(module.ln2(h)))))
    return h + _row(module.down, ACTIVATIONS[module.activation](module.up(_varying(h))))
