"""A pipeline's stage boundary inside a layer: the CNN's conv2 cut by its output channels.

The CNN's conv2 is ~85% of its training FLOPs, so any cut between whole layers leaves one
stage with at least that: two stages cannot beat one device (bound 0.99x at M=8, the
measured 2-rank pipelines 0.86-1.04x). Held as two convolutions over the same input (conv2's
first k output channels, then the rest: `jaxpar.models.cnn.CNNCut`, the same function), the
model cuts between them: stage 0 runs conv1 and conv2[:k] and hands on conv1's output with
its k pooled channels; stage 1 runs conv2[k:] on that output, joins the channels and goes on.
k balances the stages' training FLOPs (a convolution's FLOPs, its gradients' and its ReLU,
pool and batch norm's are linear in its output channels, so conv2's measured count is split
in proportion), at a multiple of 8, the width XLA:CPU vectorises channels by.

The strategies whose stages overlap on workers of their own use the cut inside conv2 when it lowers
the costliest stage by 5% or more and `--stage-boundaries` is not given: `mpi-pipeline` (a
rank each), and `pipeline` and `gems` as stage programs on accelerators and across processes.
On CPU devices simulated in one process those keep whole layers: they share the cores `single`
already fills (`PipelineStrategy.cuts_inside_layers`; the bounds study, 2 devices, CNN cut
inside conv2: GPipe 1.08x `single`, 1F1B 1.37x, against 1.22x and 1.16x cut after it). Where
each stage has a worker of its own balance pays: CNN 1F1B on 2 single-threaded ranks walked
from the host, 40-44 ms cut inside conv2 (with the collective hops before transfers, 53 ms
cut inside and 58 ms after it); simulated devices each on one thread (`--single-thread`, as
ranks are): 1F1B 22.9-23.0 ms cut inside conv2 against 30.6-40.7 after it, GPipe 32.4-33.8
against 32.3-32.7. `layer-split` (one stage at a time) and `hybrid` (tensor-split stages)
keep whole layers too. States convert at the strategy's edge (`to_view`, `from_view`):
checkpoints, gradients and `state_to_reference` stay in the model's own layout.

    plan = inner_cut.plan(config, stages=2, inside=True)
    plan.starts, plan.names      # (0, 2), ("conv1", "conv2[:32]", "conv2[32:64]", "fc1", "fc2")
    cut = plan.stages(model, image_shape)  # the model as CNNCut (conv2 in two layers), and
                                           # per stage its layers, keys, names; boundary shapes
    state = plan.to_view(reference_state)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import data as datalib
from jaxpar.config import TrainConfig
from jaxpar.models import sequence
from jaxpar.models.cnn import CNN, CNNCut
from jaxpar.parallel.pipeline import partition

# The CNN's entries held in two parts by `CNNCut`, each split on its last axis (channels).
PARTS = {"conv2": ("conv2a", "conv2b"), "bn2": ("bn2a", "bn2b")}
GAIN = 0.95  # the cut inside conv2 is taken when its costliest stage is at most this of whole layers'
ALIGN = 8    # k a multiple of this


class Cut(NamedTuple):
    """A model cut by a `Plan`: the model in the cut's layout and, per stage, its layers'
    indices, parameter keys and names, and the per-example shape each stage but the last
    hands on."""
    model: Any
    ranges: list[range]
    keys: list[list[tuple]]
    names: list[list[str]]
    boundaries: list[tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Stages (`starts`, the first layer of each) over `names` costing `costs` (training FLOPs
    per example); `channels` is k when conv2 is held in two parts, None for whole layers."""
    starts: tuple[int, ...]
    names: tuple[str, ...]
    costs: tuple[float, ...]
    channels: int | None = None

    def stage_costs(self) -> list[float]:
        ends = (*self.starts[1:], len(self.costs))
        return [sum(self.costs[a:b]) for a, b in zip(self.starts, ends)]

    def speedup_bound(self, bubble: float) -> float:
        """The most S stages with a schedule idling `bubble` of the time can speed a step up
        on S dedicated workers: the step's FLOPs over the costliest stage's, less the bubble.
        A cut no better balanced than the layers allow bounds it (the CNN cut between whole
        layers: conv2's ~85% of the FLOPs keeps 2 stages under 1x whatever the schedule)."""
        costs = self.stage_costs()
        return sum(costs) / max(costs) * (1.0 - bubble)

    def describe(self) -> dict:
        return {"cut_inside": None if self.channels is None else f"conv2 after output channel {self.channels}"}

    # --- the model and its trees in the cut's layout ------------------------------------------
    def model(self, model, image_shape: tuple[int, ...]):
        return model if self.channels is None else CNNCut(model, self.channels, image_shape)

    def stages(self, model, image_shape: tuple[int, ...]) -> Cut:
        """`model` cut into the plan's stages (shapes only: nothing is run)."""
        model = self.model(model, image_shape)
        layers = model.layers()
        ranges = [range(a, b) for a, b in zip(self.starts, (*self.starts[1:], len(layers)))]
        h, boundaries = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32), []
        for r in ranges[:-1]:
            h = jax.eval_shape(lambda x, r=r: sequence.apply([layers[i] for i in r], x), h)
            boundaries.append(h.shape[1:])
        return Cut(model, ranges, [[k for i in r for k in layers[i].keys] for r in ranges],
                      [[layers[i].name for i in r] for r in ranges], boundaries)

    def to_view(self, tree):
        """`tree` (a state, parameters, optimizer state: any tree whose dicts may hold the
        model's entries) with conv2 and bn2 held in their two parts."""
        return tree if self.channels is None else _map_dicts(tree, self._split)

    def from_view(self, tree):
        """The inverse of `to_view`: the parts joined into the model's own entries."""
        return tree if self.channels is None else _map_dicts(tree, _join)

    def _split(self, d: dict) -> dict:
        out = {k: v for k, v in d.items() if k not in PARTS}
        for name, (a, b) in PARTS.items():
            if name in d:
                out[a] = jax.tree.map(lambda v: v[..., :self.channels], d[name])
                out[b] = jax.tree.map(lambda v: v[..., self.channels:], d[name])
        return out


def _join(d: dict) -> dict:
    out = {k: v for k, v in d.items() if k not in {p for parts in PARTS.values() for p in parts}}
    for name, (a, b) in PARTS.items():
        if a in d:
            out[name] = jax.tree.map(lambda x, y: np.concatenate([np.asarray(x), np.asarray(y)], -1), d[a], d[b])
    return out


def _map_dicts(tree, fn):
    """`fn` on every dict of `tree` holding one of the parted entries (parameters, Adam's
    moments, batch-norm statistics); other leaves as they are."""
    names = set(PARTS) | {p for parts in PARTS.values() for p in parts}
    holds = lambda x: isinstance(x, dict) and bool(names & set(x))  # noqa: E731
    return jax.tree.map(lambda x: fn(x) if holds(x) else x, tree, is_leaf=holds)


def plan(config: TrainConfig, stages: int, inside: bool) -> Plan:
    """How to cut the model of `config` into `stages` stages: `partition.cut`'s whole layers,
    or (`inside`, the CNN, no `--stage-boundaries`) conv2 in two parts where that lowers the
    costliest stage."""
    layers = partition.model_layers(config.model, datalib.spec(config.data))
    names, costs = tuple(n for n, _ in layers), tuple(c for _, c in layers)
    whole = Plan(partition.cut(config, stages) if stages > 1 else (0,), names, costs)
    if not (inside and config.parallel.stage_boundaries is None and config.model.model == "cnn"):
        return whole
    return finest(names, costs, stages) or whole


def finest(names: tuple[str, ...], costs: tuple[float, ...], stages: int) -> Plan | None:
    """The best cut of the CNN's layers `names` (costing `costs`) into `stages` stages with
    conv2 in two parts, or None where whole layers do about as well (within GAIN)."""
    if stages < 2 or tuple(names[:2]) != ("conv1", "conv2"):
        return None
    whole = max(Plan(partition.balanced(list(costs), stages), tuple(names), tuple(costs)).stage_costs())
    best = None
    for k in range(ALIGN, CNN.CONV2_FEATURES, ALIGN):
        share = k / CNN.CONV2_FEATURES
        fine = Plan((), (names[0], f"conv2[:{k}]", f"conv2[{k}:{CNN.CONV2_FEATURES}]", *names[2:]),
                    (costs[0], costs[1] * share, costs[1] * (1 - share), *costs[2:]), k)
        fine = dataclasses.replace(fine, starts=partition.balanced(list(fine.costs), stages))
        worst = max(fine.stage_costs())
        if 2 in fine.starts and worst <= GAIN * whole and (best is None or worst < max(best.stage_costs())):
            best = fine
    return best
