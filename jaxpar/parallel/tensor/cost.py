"""What tensor parallelism costs: the Megatron split's activation all-reduces in closed form
(`tensor_collective_bytes`, which `Tensor.theory` reports beside the compiled step's), the
channel split's collectives (`channels`), and the step as a `jaxpar.cost.Work`."""

from __future__ import annotations

import functools

from jaxpar.config import ModelConfig
from jaxpar.cost import F32, SUMS_BYTES, Collective, Problem, Work
from jaxpar.data import IMAGE_SHAPE  # the built-in models' images
from jaxpar.models import abstract_model, option_value
from jaxpar.models.vit import TOKENS
from jaxpar.parallel.tensor import channels


def tensor_collective_bytes(*, batch_local: int, width: int, depth: int, degree: int,
                            vit: bool, data: int = 1, param_bytes_local: int = 0) -> int:
    """Megatron TP all-reduce operand bytes per training step (one device).

    Each block sub-layer pair (the MLP; in the ViT also attention) all-reduces its output
    activation [B_local, (tokens,) width] once forward and once backward.

    Args:
      batch_local: examples per device along the data axis (global batch / data degree).
      width: the residual stream width d.
      depth: number of blocks.
      degree: tensor-parallel degree T (no collectives when T == 1).
      vit: True for the ViT (2 sub-blocks per block, TOKENS tokens per example).
      data: data-parallel degree; when > 1 each device also all-reduces its gradient shard
        (`param_bytes_local`) and the three metric sums once.

    Returns:
      bytes: 2 * sub_blocks * depth * B_local * tokens * width * 4 (+ the data part).
    """
    tokens, sub_blocks = (TOKENS, 2) if vit else (1, 1)
    tp = 2 * sub_blocks * depth * batch_local * tokens * width * F32 if degree > 1 else 0
    dp = param_bytes_local + 3 * F32 if data > 1 else 0
    return tp + dp


def split_layer_indices(p: Problem) -> list[int]:
    """The layers whose parameters tensor parallelism splits: stack-mlp and ResNet blocks, the
    CNN's conv2, fc1 and fc2 (its conv1 runs replicated on B/T rows)."""
    names = [layer.name for layer in p.compute.layers]
    if p.model.get("model") == "cnn":
        return [i for i, n in enumerate(names) if n != "conv1"]
    return [i for i, n in enumerate(names) if n.startswith("block")]


@functools.lru_cache(maxsize=64)
def tensor_ops(model: tuple, batch_local: int, degree: int) -> tuple[Collective, ...]:
    """The collectives of the Megatron / channel split per step, from `tensor_collective_bytes` and
    `jaxpar.parallel.tensor.channels` (as `Tensor.theory` states them)."""
    name, depth, width = model
    if degree <= 1:
        return ()
    if name == "stack-mlp":
        depth, width = option_value(name, "depth", depth), option_value(name, "width", width)
        nbytes = tensor_collective_bytes(batch_local=batch_local, width=width, depth=depth,
                                                degree=degree, vit=False)
        return (Collective("all-reduce", nbytes / (2 * depth), degree, 2 * depth),)
    net = abstract_model(ModelConfig(name, depth=depth, width=width))
    ops = channels.split_collective_bytes(net, batch_local, IMAGE_SHAPE, degree)
    if name == "cnn":  # all-gathers and reduce-scatters of activations, the all-reduce of grads
        return tuple(Collective(op, nbytes, degree) for op, nbytes in ops.items())
    count = 2 * len(net.blocks)  # a block's output forward, its input gradient backward
    return (Collective("all-reduce", ops["all-reduce"] / count, degree, count),)


def tensor_parts(p: Problem, batch: float, layers) -> tuple[float, float]:
    """(compute seconds, parameter bytes) of one tensor shard of `layers` at this batch: split
    layers' work and parameters / T; the CNN's conv1 also runs on B/T rows (its parameters
    whole)."""
    c, t = p.compute, p.size("tensor")
    split = set(split_layer_indices(p))
    rows = set(range(len(c.layers))) - split if p.model.get("model") == "cnn" else set()
    shares = c.shares(batch)
    frac = sum(shares[i] / (t if i in split | rows else 1) for i in layers)
    params = sum(c.layers[i].param_bytes / (t if i in split else 1) for i in layers)
    return c.backprop_s(batch) * frac + c.update_s * params / max(c.param_bytes, 1), params


def _permuted(ops: list[Collective], degree: int, data: int) -> list[Collective]:
    """The CNN split's collectives in their permute form (`channels.as_permutes`): the 3
    all-gathers, 3 reduce-scatters (and without DATA the loss denominator) as T - 1 permutes
    each."""
    found = channels.as_permutes({o.op: o.bytes for o in ops}, degree, denominator=data == 1)
    count = channels.permutes_per_step(degree, denominator=data == 1)
    return [Collective(op, n / count, degree, count) if op == "collective-permute" else Collective(op, n, degree)
            for op, n in found.items()]


def tensor(p: Problem) -> Work:
    """Split layers' compute and parameters divided by T; their activations all-reduced twice
    (forward and backward) per pair (the CNN: gathered and reduce-scattered, or permuted);
    over data > 1 also the gradient all-reduce."""
    d, t = p.size("data"), p.size("tensor")
    b = p.batch / d
    seconds, params = tensor_parts(p, b, range(len(p.compute.layers)))
    ops = list(tensor_ops((p.model.get("model"), p.model.get("depth"), p.model.get("width")), int(b), t))
    if p.collective_form == "permute" and t > 1:
        ops = _permuted(ops, t, d)
    if d > 1:
        ops.append(Collective("all-reduce", params + SUMS_BYTES, d))
    return Work((seconds,) * (d * t), tuple(ops), params * 3, p.compute.temp_bytes(b))
