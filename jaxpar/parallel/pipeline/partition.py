"""Cutting a model's layers (`model.layers()`) into S consecutive stages balanced by FLOPs.

A layer's cost is XLA's cost analysis (HLO FLOPs of the lowered program, nothing compiled or
run) of its training work on one example: its forward in training mode and its backward,
the gradients of its parameters and of its input (the first layer's input is the image,
whose gradient nobody computes). FLOPs, not parameter bytes: the slowest stage sets a
pipeline's pace, and a convolution's parameters say little about its time (the CNN's conv2
holds 4% of its parameters and ~60% of its FLOPs). The cut minimises the largest stage's
FLOPs over every way of cutting the sequence (dynamic programming over the layers), so
stages differ in their layer counts when the layers differ in cost.

`--stage-boundaries 2,5` overrides the cut: the first layer of each stage after the first.

    layers = model_layers(config.model, spec)         # [(name, flops per example), ...]
    starts = cut(config, stages=4)                    # (0, 2, 3, 5): stage s = [starts[s], starts[s+1])
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import data as datalib
from jaxpar.config import ModelConfig, TrainConfig
from jaxpar.errors import ConfigError
from jaxpar.models import MODELS, abstract_model, takes
from jaxpar.step import split_model


def model_layers(model_config: ModelConfig, spec: datalib.Spec = datalib.BUILTIN_SPEC
                 ) -> tuple[tuple[str, float], ...]:
    """(name, training FLOPs per example) of each layer of the model `model_config` builds
    for images of `spec` (the dataset's), from XLA's cost analysis of each layer's forward and
    backward (shapes only: the model is traced with `nnx.eval_shape`, nothing is allocated).
    Cached per model configuration, dataset spec and registered factory (a name registered
    again is another model)."""
    return _model_layers(model_config, spec, MODELS[model_config.model])


@functools.lru_cache(maxsize=32)
def _model_layers(model_config: ModelConfig, spec: datalib.Spec, factory
                  ) -> tuple[tuple[str, float], ...]:
    if "conv_impl" in takes(model_config.model):
        # Counted on the CPU forms: XLA's cost analysis cannot see oneDNN's custom calls, and
        # the count is of the arithmetic, the same in every form.
        model_config = dataclasses.replace(model_config, conv_impl="cpu")
    model = abstract_model(model_config, spec)
    graphdef, params, rest = split_model(model)
    params, rest = _on_cpu(params), _on_cpu(rest)
    h = _on_cpu(jax.ShapeDtypeStruct((1, *spec.image_shape), jnp.float32))
    found = []
    for i, layer in enumerate(model.layers()):
        def run(p, x, r, i=i):
            return nnx.merge(graphdef, p, r).layers()[i](x, True)

        lowered = jax.jit(functools.partial(train_work, run, i > 0)).lower(params, h, rest)
        found.append((layer.name, _flops(lowered)))
        h = jax.eval_shape(run, params, h, rest)
    return tuple(found)


def _on_cpu(tree):
    """Shapes placed on the CPU, so that a layer is lowered (not run) for XLA:CPU, whose cost
    analysis counts a lowered module's FLOPs on any machine: on a GPU machine with jax 0.11
    the CUDA plugin's analysis of a lowered module had no FLOPs (a profile of zeros)."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), tree)


def _flops(lowered) -> float:
    """FLOPs of a lowered program from XLA's cost analysis, else (a backend that analyses only
    compiled programs) of the compiled one, which counts what XLA's simplifications leave
    (the MLP's first layer: 0.75x the lowered count)."""
    for analyse in (lowered.cost_analysis, lambda: lowered.compile().cost_analysis()):
        cost = analyse()
        cost = cost[0] if isinstance(cost, list) and cost else cost
        if cost and cost.get("flops"):
            return float(cost["flops"])
    return 0.0


def train_work(run, input_grad: bool, params, x, rest):
    """A layer's forward and backward: the gradients of its parameters (and of its input
    when `input_grad`), its output standing in for the incoming gradient."""
    if not input_grad:
        out, vjp = jax.vjp(lambda p: run(p, x, rest), params)
    else:
        out, vjp = jax.vjp(lambda p, h: run(p, h, rest), params, x)
    return vjp(out)


def balanced(costs: list[float], stages: int) -> tuple[int, ...]:
    """First layer of each of `stages` consecutive non-empty stages minimising the largest
    stage's summed cost (ties: the earliest cut found)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    span = lambda a, b: prefix[b] - prefix[a]  # noqa: E731
    # best[s][i]: (largest stage cost, starts) cutting layers [0, i) into s stages
    best = {(1, i): (span(0, i), (0,)) for i in range(1, n + 1)}
    for s in range(2, stages + 1):
        for i in range(s, n + 1):
            best[(s, i)] = min(((max(best[(s - 1, j)][0], span(j, i)), best[(s - 1, j)][1] + (j,))
                                for j in range(s - 1, i)), key=lambda x: x[0])
    return best[(stages, n)][1]


def boundary_problems(boundaries, names: list[str], stages: int) -> list[str]:
    """What is wrong with `--stage-boundaries` for a model with layers `names` cut into
    `stages` stages, one sentence naming the fix; [] when it is usable (or not given)."""
    n = len(names)
    listing = ", ".join(f"{i} {name}" for i, name in enumerate(names))
    if stages > n:
        return [f"--mesh stage={stages} needs at least {stages} layers, one per stage, but the model "
                f"has {n} layers ({listing}); use fewer stages or a deeper model (--depth, where "
                f"the model takes it)."]
    if boundaries is None:
        return []
    b = list(boundaries)
    if len(b) != stages - 1 or b != sorted(set(b)) or not all(0 < x < n for x in b):
        return [f"--stage-boundaries {','.join(map(str, b))} must be {stages - 1} increasing layer "
                f"indices between 1 and {n - 1} (the first layer of each stage after the first); "
                f"the model's layers are {listing}."]
    return []


def cut(config: TrainConfig, stages: int) -> tuple[int, ...]:
    """First layer of each stage: `--stage-boundaries` when given, else balanced by FLOPs.
    ConfigError naming the fix when the model cannot be cut so."""
    layers = model_layers(config.model, datalib.spec(config.data))
    boundaries = config.parallel.stage_boundaries
    problems = boundary_problems(boundaries, [n for n, _ in layers], stages)
    if problems:
        raise ConfigError(" ".join(problems))
    if boundaries is not None:
        return (0, *boundaries)
    return balanced([c for _, c in layers], stages)


def layer_names(model_config: ModelConfig) -> list[str]:
    """The names of the model's layers, in order (no cost analysis: for checks)."""
    return [layer.name for layer in abstract_model(model_config).layers()]
