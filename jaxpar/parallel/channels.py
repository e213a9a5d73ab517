"""Convolutions split over the TENSOR axis by channels, Megatron-style (CNN, ResNet blocks).

A pair of convolutions splits like Megatron's column -> row pair of Linears: the first conv
keeps a slice of its *output* channels (kernel [..., C/T], bias and the batch norm after it
per channel), so ReLU and pooling run on each device's channels alone; the second keeps the
matching slice of its *input* channels (kernel [:, :, C/T, :]), its partial outputs are
summed with one `psum` over TENSOR, and its bias (if any) is added once after the sum. The
pair's input is cast tensor-varying once (Megatron's `f`), so its gradient is all-reduced
once in the backward pass, unless nothing needs it (the CNN's first conv reads the image).

- CNN: conv1 (+bn1) by output channels, conv2 by input channels, whose partial outputs are
  summed *and scattered over the batch* (one reduce-scatter: Megatron's sequence parallelism,
  Korthikanti et al. 2022, with the batch for the sequence), so bn2, ReLU, the pool, fc1 and
  fc2 run on B/T rows per device instead of all B on every device. Backward: one all-gather of conv2's output gradient, and the
  all-reduce of the (replicated) tail's parameter gradients; bn2 normalises by the statistics
  of the whole batch (its `axis_name` set to TENSOR), as in `single`. The loss reads each
  device's rows (`local_rows`); the metric sums are summed over TENSOR.
- ResNet: in each basic block conv1 (+bn1) by output, conv2 by input; bn2, the projection
  shortcut, the stem and the head replicated. Per block one all-reduce of the block's
  output before bn2 [B, H, W, C_out] forward and one of its input gradient [B, H', W', C_in]
  backward.

Batch norm per channel sees the same (local) batch whether its channels are split or not,
so the split changes no statistic.

    spec = leaf_spec(("blocks", 0, "conv1", "kernel"))   # P(None, None, None, 'tensor')
    h = block(basic_block, h, train)                      # inside shard_map over TENSOR
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import TENSOR
from jaxpar.models import CNN
from jaxpar.models.resnet import BasicBlock

F32 = 4
METRIC_SUMS = 3  # step.metric_sums: loss_sum, correct, count


def leaf_spec(layer: str, kind: str) -> P:
    """PartitionSpec of a conv-pair leaf (`layer` conv1/bn1/conv2, `kind` kernel/bias/scale/
    mean/var); anything else is replicated."""
    if layer == "conv1":
        return P(None, None, None, TENSOR) if kind == "kernel" else P(TENSOR)
    if layer == "bn1":
        return P(TENSOR)
    if layer == "conv2" and kind == "kernel":
        return P(None, None, TENSOR, None)
    return P()


def split_channels(model) -> list[int]:
    """The channel counts the split divides: each pair's first-conv output channels."""
    if isinstance(model, CNN):
        return [model.conv1.out_features]
    return [b.conv1.out_features for b in model.blocks]


def _varying(x: jax.Array) -> jax.Array:
    # Megatron's `f`: identity forward; its transpose is the pair's one backward all-reduce.
    return jax.lax.pcast(x, TENSOR, to="varying")


def _without_bias(conv: nnx.Conv) -> nnx.Conv:
    """The same convolution (the module's own implementation) with a zero bias."""
    graphdef, state = nnx.split(conv)
    state = nnx.to_pure_dict(state)
    state["bias"] = jnp.zeros_like(state["bias"])
    return nnx.merge(graphdef, state)


def row_conv(conv: nnx.Conv, h: jax.Array) -> jax.Array:
    """Row-parallel conv: partial sums over this device's input channels, all-reduced over
    TENSOR, then the bias added once."""
    if conv.bias is None:
        return jax.lax.psum(conv(h), TENSOR)
    return jax.lax.psum(_without_bias(conv)(h), TENSOR) + conv.bias[...]


def block(module: BasicBlock, h: jax.Array, train: bool) -> jax.Array:
    """A ResNet basic block on this device's channel shard: the same math as
    `module(h, train)` on the whole block."""
    ura = not train
    y = nnx.relu(module.bn1(module.conv1(_varying(h)), use_running_average=ura))
    y = module.bn2(row_conv(module.conv2, y), use_running_average=ura)
    shortcut = module.proj_bn(module.proj_conv(h), use_running_average=ura) if module.project else h
    return nnx.relu(y + shortcut)


def scatters_rows(model) -> bool:
    """True where the split leaves each device B/T rows of the batch after the convolutions
    (the CNN), so the loss reads `local_rows` and the metric sums add over TENSOR."""
    return isinstance(model, CNN)


def local_rows(batch: dict, rows: int) -> dict:
    """This device's `rows` consecutive rows of a (tensor-replicated) batch, as
    `psum_scatter(..., scatter_dimension=0, tiled=True)` hands them out."""
    start = jax.lax.axis_index(TENSOR) * rows
    return {k: jax.lax.dynamic_slice_in_dim(v, start, rows) for k, v in batch.items()}


def _scatter_conv(conv: nnx.Conv, h: jax.Array) -> jax.Array:
    """Row-parallel conv whose partial sums are reduce-scattered over the batch: this
    device's B/T rows of the whole convolution, the bias added once."""
    y = jax.lax.psum_scatter(_without_bias(conv)(h) if conv.bias is not None else conv(h),
                             TENSOR, scatter_dimension=0, tiled=True)
    return y if conv.bias is None else y + conv.bias[...]


def _batch_norm_over(bn: nnx.BatchNorm | None, axis: str) -> nnx.BatchNorm | None:
    """`bn` normalising by the statistics of the rows on every device of `axis` (the module
    is this trace's own merge, so the attribute set here lives only in this step)."""
    if bn is not None:
        bn.axis_name = axis
    return bn


def cnn_layers(model: CNN) -> list:
    """The CNN's layers on this device's channel shard: conv1's stage on its output
    channels, conv2's summed over input channels and scattered over the batch, the head on
    this device's rows."""
    layers = model.layers()

    def second(h, train):
        bn2 = _batch_norm_over(getattr(model, "bn2", None), TENSOR)
        return model.after_conv(bn2, _scatter_conv(model.conv2, h), train)

    return [lambda h, train: layers[0](_varying(h), train), second, None, None]


def tail_param_bytes(model: CNN) -> int:
    """Bytes of the parameters applied to the scattered rows (conv2's bias, bn2, fc1, fc2):
    replicated, their gradients are all-reduced over TENSOR."""
    leaves = [model.fc1, model.fc2, getattr(model, "bn2", None)]
    total = sum(x.size for m in leaves if m is not None for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    return (total + (model.conv2.bias.size if model.conv2.bias is not None else 0)) * F32


def collective_bytes(model, batch_local: int, image_shape: tuple[int, ...], degree: int) -> dict[str, int]:
    """Operand bytes per training step of the channel split (one device), by collective: a
    ResNet block all-reduces its summed output forward and its input gradient backward; the
    CNN reduce-scatters conv2's output (the whole of it is the operand), all-gathers its
    gradient (this device's rows) and all-reduces the head's gradients and the metric sums."""
    # The model goes in as an argument, shapes only: its arrays may be donated by now, and a
    # layer closing over them would read them (the cpu convs index their kernels).
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    ops, h = {"all-reduce": 0}, jax.ShapeDtypeStruct((batch_local, *image_shape), jnp.float32)
    for i, layer in enumerate(model.layers()):
        out = jax.eval_shape(lambda s, x, i=i: nnx.merge(graphdef, s).layers()[i](x, False), state, h)
        if isinstance(model, CNN) and i == 1:  # conv2's output, before pooling
            whole = batch_local * h.shape[1] * h.shape[2] * model.conv2.out_features * F32
            ops = {"reduce-scatter": whole, "all-gather": whole // degree,
                   "all-reduce": tail_param_bytes(model) + METRIC_SUMS * F32}
        elif not isinstance(model, CNN) and layer.name.startswith("block"):
            ops["all-reduce"] += (out.size + h.size) * F32
        h = out
    return ops
