"""Convolutions split over the TENSOR axis by channels, Megatron-style (CNN, ResNet blocks).

A pair of convolutions splits like Megatron's column -> row pair of Linears: the first conv
keeps a slice of its *output* channels (kernel [..., C/T], bias and the batch norm after it
per channel), so ReLU and pooling run on each device's channels alone; the second keeps the
matching slice of its *input* channels (kernel [:, :, C/T, :]), its partial outputs are
summed with one `psum` over TENSOR, and its bias (if any) is added once after the sum. The
pair's input is cast tensor-varying once (Megatron's `f`), so its gradient is all-reduced
once in the backward pass, unless nothing needs it (the CNN's first conv reads the image).

- CNN: every layer on 1/T of the work, no layer repeated (Megatron's sequence parallelism,
  Korthikanti et al. 2022, with the batch for the sequence). conv1 (+bn1, replicated) runs on
  this device's B/T rows of the batch, bn1 normalising by the statistics of the whole batch
  (its `axis_name` set to TENSOR); one all-gather hands conv2 the whole batch; conv2 (+bn2)
  keeps a slice of its output channels, fc1 a slice of its output features after one
  all-gather of the channels, fc2 the matching slice of its input rows, whose partial logits
  are summed and scattered over the batch (one reduce-scatter), so the loss reads B/T rows
  (the batch is sharded over TENSOR as well as DATA). Backward, each all-gather's transpose
  reduce-scatters the gradient and the reduce-scatter's all-gathers it; the replicated
  conv1/bn1 and fc2's bias all-reduce their gradients. Measured on 4 simulated CPU devices this ran ~1.4x `single` where the split of
  conv2 by input channels (its partial sums reduce-scattered, the head repeated on every
  device) ran 3.1x: each device's convolutions keep their whole input depth.
- ResNet: in each basic block conv1 (+bn1) by output, conv2 by input; bn2, the projection
  shortcut, the stem and the head replicated. Per block one all-reduce of the block's
  output before bn2 [B, H, W, C_out] forward and one of its input gradient [B, H', W', C_in]
  backward.

Batch norm per channel sees the same (local) batch whether its channels are split or not,
so the split changes no statistic.

    spec = leaf_spec("conv1", "kernel")    # a ResNet block's: P(None, None, None, 'tensor')
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
from jaxpar.parallel.tensor import comm_forms
from jaxpar.cost import F32

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


CNN_LAYERS = ("conv1", "bn1", "conv2", "bn2", "fc1", "fc2")


def cnn_leaf_spec(layer: str, kind: str) -> P:
    """PartitionSpec of a CNN leaf: conv2 (+bn2) by output channels, fc1 by output features,
    fc2's kernel by input rows; conv1, bn1 and fc2's bias replicated."""
    if layer in ("conv2", "bn2", "fc1"):
        return P(*(None,) * (3 if layer == "conv2" else 1), TENSOR) if kind == "kernel" else P(TENSOR)
    if layer == "fc2" and kind == "kernel":
        return P(TENSOR, None)
    return P()


def split_channels(model) -> list[int]:
    """The channel counts the split divides: the CNN's conv2 and fc1 outputs, each ResNet
    pair's first-conv output channels."""
    if isinstance(model, CNN):
        return [model.conv2.out_features, model.fc1.out_features]
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
    """True where the split reads B/T rows of the batch per device (the CNN: the batch is
    sharded over TENSOR too), conv1 on them and the logits back on them, so the loss's
    weight total and the metric sums add over TENSOR."""
    return isinstance(model, CNN)


def _with_varying_params(module: nnx.Module) -> nnx.Module:
    """`module` with its parameters cast tensor-varying (its statistics as they are): a layer
    run on this device's rows then hands its gradient to the cast's transpose, one all-reduce
    over TENSOR (the cpu convolutions' custom gradients take no implicit cast)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return nnx.merge(graphdef, jax.tree.map(_varying, params), rest)


def _batch_norm_over(bn: nnx.BatchNorm | None, axis: str) -> nnx.BatchNorm | None:
    """`bn` normalising by the statistics of the rows on every device of `axis` (the module
    is this trace's own merge, so the attribute set here lives only in this step)."""
    if bn is not None:
        bn.axis_name = axis
    return bn


def cnn_layers(model: CNN, comm: comm_forms.Comm = comm_forms.NATIVE) -> list:
    """The CNN's layers on this device's share (the module docstring's split): conv1 on its
    rows, conv2 on its output channels of the gathered batch, fc1 on its output features of
    the gathered channels, fc2's partial logits reduce-scattered over the batch; gathers and
    scatters in `comm`'s form."""
    layers = model.layers()

    def conv1_rows(h, train):  # h: this device's rows of the batch
        bn1 = _batch_norm_over(getattr(model, "bn1", None), TENSOR)
        return model.after_conv(bn1, _with_varying_params(model.conv1)(h), train)

    def conv2_channels(h, train):
        return layers[1](comm.all_gather(h, TENSOR, 0), train)

    def fc1_features(h, train):
        return layers[2](comm.all_gather(h, TENSOR, 3), train)

    def fc2_rows(h, train):
        partial = h @ model.fc2.kernel[...]
        return comm.psum_scatter(partial, TENSOR, 0) + model.fc2.bias[...]

    return [conv1_rows, conv2_channels, fc1_features, fc2_rows]


def replicated_param_bytes(model: CNN) -> int:
    """Bytes of the CNN's replicated parameters (conv1, bn1, fc2's bias): run on this
    device's rows, their gradients are all-reduced over TENSOR."""
    leaves = [model.conv1, getattr(model, "bn1", None)]
    total = sum(x.size for m in leaves if m is not None for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    return (total + model.fc2.bias.size) * F32


def cnn_collective_bytes(model: CNN, batch_local: int, image_shape: tuple[int, ...], degree: int) -> dict[str, int]:
    """Operand bytes per step of the CNN's split (one device): forward, all-gathers of conv1's
    output (this device's rows) and conv2's (its channels) and the reduce-scatter of the whole
    batch's partial logits; backward, their transposes (reduce-scatters of the two gathered
    gradients, the all-gather of this device's logits' gradient); the all-reduce of the
    replicated parameters' gradients and the metric sums."""
    h, w = image_shape[0] // 2, image_shape[1] // 2  # after conv1's pool; conv2's pool halves again
    first = batch_local * h * w * model.conv1.out_features * F32            # whole batch
    second = batch_local * (h // 2) * (w // 2) * model.conv2.out_features * F32
    logits = batch_local * model.fc2.out_features * F32
    return {"all-gather": (first + second + logits) // degree,
            "reduce-scatter": first + second + logits,
            "all-reduce": replicated_param_bytes(model) + METRIC_SUMS * F32}


def as_permutes(ops: dict[str, int], degree: int, denominator: bool) -> dict[str, int]:
    """The CNN split's operand bytes per step in the permute form (`comm_forms.PERMUTE`): each
    all-gather's shard, each reduce-scatter's block and (`denominator`: no DATA axis, whose
    all-reduce sums it otherwise) the loss denominator's one f32 sent to the T - 1 other
    devices; the all-reduce as before (its metric sums then carry the count the native form's
    denominator all-reduce stood in for: the same bytes)."""
    moved = ops.get("all-gather", 0) + ops.get("reduce-scatter", 0) // degree + (F32 if denominator else 0)
    rest = {op: n for op, n in ops.items() if op not in ("all-gather", "reduce-scatter")}
    return {**rest, "collective-permute": moved * (degree - 1)}


def permutes_per_step(degree: int, denominator: bool) -> int:
    """How many permutes `as_permutes` counts the bytes of: T - 1 for each of the 3
    all-gathers, 3 reduce-scatters (forward and backward) and the denominator."""
    return (6 + denominator) * (degree - 1)


def split_collective_bytes(model, batch_local: int, image_shape: tuple[int, ...], degree: int) -> dict[str, int]:
    """Operand bytes per training step of the channel split (one device), by collective: the
    CNN's as `cnn_collective_bytes` says; a ResNet block all-reduces its summed output
    forward and its input gradient backward."""
    if isinstance(model, CNN):
        return cnn_collective_bytes(model, batch_local, image_shape, degree)
    # The model goes in as an argument, shapes only: its arrays may be donated by now, and a
    # layer closing over them would read them (the cpu convs index their kernels).
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    ops, h = {"all-reduce": 0}, jax.ShapeDtypeStruct((batch_local, *image_shape), jnp.float32)
    for i, layer in enumerate(model.layers()):
        out = jax.eval_shape(lambda s, x, i=i: nnx.merge(graphdef, s).layers()[i](x, False), state, h)
        if layer.name.startswith("block"):
            ops["all-reduce"] += (out.size + h.size) * F32
        h = out
    return ops
