"""Collective bytes of each strategy's compiled step against theory derived HERE, from the
model's layer shapes and the batch, independent of the strategies' own `theory()`: the
documented "equals theory" claims for data parallelism, FSDP, tensor parallelism (the
explicit and the compiler-placed split on stack-mlp) and both pipeline schedules.

Bytes are collective operand bytes per step on one device, as `jaxpar.profiling.measure` counts them
(an all-gather's operand is the local slice, a reduce-scatter's the whole buffer).
"""

from __future__ import annotations

import math

import jax
import pytest

from conftest import requires_devices
from equivalence import batches, config
from pipeline_cases import CNN_BOUNDARIES
from jaxpar.models.vit import PATCH
from jaxpar.optim import make_optimizer
from jaxpar.train import build_model, make_strategy

F32 = 4
METRIC_SCALARS = 3 * F32  # the weight total and the two metric sums, all-reduced once a step
MLP = dict(model="mlp", width=64, depth=2)
STACK = dict(model="stack-mlp", width=64, depth=4)


def mlp_leaves(width: int, depth: int) -> list[int]:
    """Element counts of the MLP's parameters: 784 -> width x depth -> 10, kernel and bias."""
    sizes = [28 * 28] + [width] * depth + [10]
    return [n for a, b in zip(sizes, sizes[1:]) for n in (a * b, b)]


def stack_outer_leaves(width: int) -> list[int]:
    """stack-mlp's stem (784 -> width) and head (width -> 10): what a pipeline replicates."""
    return [28 * 28 * width, width, width * 10, 10]


def measured(devices: int, **options) -> dict[str, int]:
    """Collective operand bytes by op of the compiled training step on `devices` devices."""
    cfg = config(**options)
    strategy = make_strategy(cfg)
    mesh = strategy.make_mesh(jax.devices()[:devices])
    state = strategy.init(build_model(cfg), make_optimizer(cfg.optim, total_steps=1), mesh)
    batch = strategy.place_batch(batches(cfg.data.batch_size, 1)[0])
    return strategy.compile("step", state, batch).collective_bytes


@requires_devices(4)
@pytest.mark.parametrize("strategy", ["dp-pmap", "dp-shard-map"])
@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_all_reduces_the_gradient_once(strategy, n):
    grad = sum(mlp_leaves(64, 2)) * F32
    got = measured(n, strategy=strategy, mesh=f"data={n}", **MLP)
    assert got == {"all-reduce": grad + METRIC_SCALARS, "total": grad + METRIC_SCALARS}


@requires_devices(4)
def test_dp_auto_is_theory_plus_at_most_one_scalar_of_xlas_own():
    grad = sum(mlp_leaves(64, 2)) * F32
    got = measured(4, strategy="dp-auto", mesh="data=4", **MLP)
    assert set(got) == {"all-reduce", "total"}
    assert 0 <= got["total"] - (grad + METRIC_SCALARS) <= F32


@requires_devices(8)
@pytest.mark.parametrize("n", [4, 8])  # at 8 the 10-element head bias pads to 16
def test_fsdp_gathers_slices_and_reduce_scatters_padded_gradients(n):
    padded = sum(math.ceil(k / n) * n for k in mlp_leaves(64, 2)) * F32
    got = measured(n, strategy="fsdp", mesh=f"data={n}", **MLP)
    want = {"all-gather": padded // n, "reduce-scatter": padded, "all-reduce": METRIC_SCALARS}
    assert got == {**want, "total": sum(want.values())}


def megatron_bytes(batch_local: int, width: int, depth: int, sub_blocks: int = 1, tokens: int = 1) -> int:
    """One all-reduce of each sub-block's output forward and one of its input gradient backward."""
    return 2 * sub_blocks * depth * batch_local * tokens * width * F32


def stack_block_leaves(width: int, expansion: int = 4) -> tuple[list[int], list[int]]:
    """One residual block's (split, replicated) element counts under Megatron's split: `up`
    kernel and bias by output column, `down` kernel by input row; `down`'s bias replicated."""
    return [width * expansion * width, expansion * width, expansion * width * width], [width]


@requires_devices(4)
@pytest.mark.parametrize("strategy", ["tensor", "tensor-auto"])
@pytest.mark.parametrize("mesh,data,tensor", [("tensor=2", 1, 2), ("tensor=4", 1, 4),
                                              ("data=2,tensor=2", 2, 2)])
def test_tensor_parallel_stack_mlp_equals_megatron(strategy, mesh, data, tensor):
    batch, width, depth = 64, STACK["width"], STACK["depth"]
    want = megatron_bytes(batch // data, width, depth)
    if data > 1:  # plus each device's gradient all-reduced over `data`, with the metric sums
        split, replicated = stack_block_leaves(width)
        local = sum(stack_outer_leaves(width)) + depth * (sum(replicated) + sum(split) // tensor)
        want += local * F32 + METRIC_SCALARS
    got = measured(data * tensor, strategy=strategy, mesh=mesh, batch_size=batch, **STACK)
    assert got["total"] == want, got


@requires_devices(2)
def test_tensor_parallel_vit_equals_megatron():
    tokens = (28 // PATCH) ** 2  # attention and MLP each all-reduce every token's activation
    got = measured(2, strategy="tensor", mesh="tensor=2", model="vit", width=32, depth=2,
                   batch_size=32)
    assert got["total"] == megatron_bytes(32, 32, 2, sub_blocks=2, tokens=tokens)


def pipeline_bytes(schedule: str, stages: int, micro: int, batch: int, width: int) -> dict[str, int]:
    """The stage-boundary buffer [batch/M, width] sent point to point on every slot that
    sends (GPipe: M+S-1 forward ticks, each transposed backward; 1F1B: 2(M+S-1) slots, each
    sending to both neighbours), plus the metric scalars all-reduced once (every parameter
    lives on one stage: nothing else is reduced)."""
    slots = 2 * (micro + stages - 1)
    sends = slots if schedule == "gpipe" else 2 * slots
    want = {"collective-permute": sends * (batch // micro) * width * F32, "all-reduce": METRIC_SCALARS}
    return {**want, "total": sum(want.values())}


@requires_devices(4)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8)])
def test_pipeline_sends_what_its_schedule_says(schedule, stages, micro):
    got = measured(stages, strategy="pipeline", mesh=f"stage={stages}", schedule=schedule,
                   microbatches=micro, batch_size=64, pipeline_impl="spmd", **STACK)
    assert got == pipeline_bytes(schedule, stages, micro, 64, 64)


@requires_devices(4)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_heterogeneous_stages_send_the_widest_boundary(schedule):
    """In one SPMD program, stages of different shapes send one buffer as wide as the widest
    boundary (padded); the host-driven form sends each boundary's own shape
    (tests/parallel/pipeline/test_pipeline.py)."""
    got = measured(4, strategy="pipeline", mesh="stage=4", schedule=schedule, microbatches=4,
                   batch_size=32, model="cnn", width=None, depth=None, stage_boundaries=(1, 2, 3),
                   pipeline_impl="spmd")
    assert got == pipeline_bytes(schedule, 4, 4, 32, max(CNN_BOUNDARIES))


def channel_split_bytes(model: str, batch: int, tensor: int) -> dict[str, int]:
    """By collective, the operand bytes of a step. The CNN all-gathers conv1's output
    [B/T, 14, 14, 32] over the batch and conv2's [B, 7, 7, 64/T] over the channels, and
    reduce-scatters the partial logits [B, 10] over the batch; backward, the gathered gradients
    are reduce-scattered (the whole as operand) and the logits' gradient all-gathered; the
    replicated conv1 (3x3x1x32 + 32), fc2's bias (10) and the 3 metric sums all-reduced. Each
    ResNet-8 block all-reduces its output forward and its input gradient backward: [28,28,16]
    and [28,28,16], [14,14,32] and [28,28,16], [7,7,64] and [14,14,32]."""
    if model == "cnn":
        whole = batch * (14 * 14 * 32 + 7 * 7 * 64 + 10) * F32
        return {"all-gather": whole // tensor, "reduce-scatter": whole,
                "all-reduce": (3 * 3 * 32 + 32 + 10 + 3) * F32}
    blocks = [(28 * 28 * 16, 28 * 28 * 16), (14 * 14 * 32, 28 * 28 * 16), (7 * 7 * 64, 14 * 14 * 32)]
    return {"all-reduce": batch * sum(out + grad for out, grad in blocks) * F32}


@requires_devices(4)
@pytest.mark.parametrize("model,tensor", [("cnn", 2), ("cnn", 4), ("resnet", 2)])
def test_tensor_parallel_convs_move_what_the_shapes_say(model, tensor):
    want = channel_split_bytes(model, 32, tensor)
    got = measured(tensor, strategy="tensor", mesh=f"tensor={tensor}", model=model, width=None,
                   depth=None, batch_size=32)
    assert got == {**want, "total": sum(want.values())}


@requires_devices(2)
def test_tensor_auto_vit_all_reduces_half_again_as_much():
    """XLA all-reduces each of q, k and v's input gradients on its own (three backward
    all-reduces where Megatron's `f` has one): 6 per block instead of 4."""
    tokens = (28 // PATCH) ** 2
    got = measured(2, strategy="tensor-auto", mesh="tensor=2", model="vit", width=32, depth=2,
                   batch_size=32)
    assert got["total"] * 2 == 3 * megatron_bytes(32, 32, 2, sub_blocks=2, tokens=tokens)
