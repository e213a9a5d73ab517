"""The Megatron-LM split over the TENSOR axis, shared by `tensor`, `tensor-auto` and `hybrid`.

Shoeybi et al. 2019, fig. 3: a block's column-parallel layers (`up`; in the ViT also
`query`/`key`/`value`, so every device holds whole attention heads) keep a column slice of
their kernel and bias; the row-parallel layer after them (`down`, `out`) keeps a row slice
of its kernel, and its partial products are summed with one `psum` over TENSOR before its
(replicated) bias is added once. The block input is cast to tensor-varying once (Megatron's
`f`), so the backward pass has exactly one all-reduce per sub-block too. LayerNorms stay
replicated. Convolutions split the same way by channels (`jaxpar.parallel.tensor.channels`: the
CNN, whose every layer splits, and the ResNet's blocks); `param_spec` and `split_layers`
say how any model splits.

    spec = leaf_spec("up", "kernel")            # P(None, 'tensor')
    h = block(block_module, h)                  # inside shard_map, on this device's shard
    fns = split_layers(model)                   # per layer of model.layers(): split form or None
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.mesh import TENSOR
from jaxpar.models import CNN, ResNet, abstract_model
from jaxpar.models.mlp import ACTIVATIONS
from jaxpar.models.resnet import BasicBlock
from jaxpar.models.vit import TransformerBlock
from jaxpar.parallel.tensor import channels, comm_forms

COLUMN = ("up", "query", "key", "value")  # kernel split on the output dim, bias split
ROW = ("down", "out")                     # kernel split on the input dim, bias replicated


def leaf_spec(layer: str, kind: str) -> P:
    """PartitionSpec of one block parameter, `kind` ('kernel', 'bias', 'scale') of `layer`."""
    if layer in COLUMN:
        return P(None, TENSOR) if kind == "kernel" else P(TENSOR)
    if layer in ROW and kind == "kernel":
        return P(TENSOR, None)
    return P()


def param_spec(path: tuple) -> P:
    """PartitionSpec of the parameter or batch-norm statistic at `path` (a key tuple, e.g.
    ("blocks", 2, "up", "kernel")) of any model the split takes: a block's Linear layers by
    `leaf_spec`, the CNN's layers by `channels.cnn_leaf_spec`, a ResNet block's conv pair by
    `channels.leaf_spec`, everything else (stems, heads, LayerNorms, shortcuts) replicated."""
    if len(path) == 2 and path[0] in channels.CNN_LAYERS:
        return channels.cnn_leaf_spec(*path)
    if path[0] != "blocks" or len(path) != 4:
        return P()
    layer, kind = path[2], path[3]
    if layer in COLUMN or layer in ROW:
        return leaf_spec(layer, kind)
    return channels.leaf_spec(layer, kind)


def split_layers(model, comm: comm_forms.Comm = comm_forms.NATIVE) -> list:
    """Per layer of `model.layers()`: its tensor-split form `(h, train) -> h` (inside
    shard_map over TENSOR), or None where the layer is replicated; the CNN's gathers and
    scatters in `comm`'s form."""
    if isinstance(model, CNN):
        return channels.cnn_layers(model, comm)
    found = []
    for layer in model.layers():
        (path, *more) = layer.keys
        module = model.blocks[path[1]] if path[0] == "blocks" and not more else None
        if isinstance(module, BasicBlock):
            found.append(lambda h, train, m=module: channels.block(m, h, train))
        elif module is not None:
            found.append(lambda h, train, m=module: block(m, h))
        else:
            found.append(None)
    return found


def check_divisible(model, degree: int, strategy: str) -> None:
    """ConfigError if the width (stack-mlp), head count (vit) or split channels (cnn, resnet)
    do not split `degree` ways."""
    if isinstance(model, (CNN, ResNet)):
        bad = sorted({c for c in channels.split_channels(model) if c % degree})
        if bad:
            good = min(channels.split_channels(model))
            raise ConfigError(f"--strategy {strategy}: the {type(model).__name__}'s {bad[0]}-channel "
                              f"convolutions do not split over tensor={degree}; change --mesh tensor= "
                              f"to a divisor of {good}")
        return
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
