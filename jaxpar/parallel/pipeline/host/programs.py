"""The host-driven pipeline's programs: each stage function jitted once, compiled ahead of
time per device (`aot`), and called on the device of its arguments.

    table = ProgramTable(trace_counts)
    register_stage_programs(table, fns)         # fwd{s}, train_fwd{s}, bwd{s}, last, update{s}, ...
    table.get("train_fwd0", "step", device)(params, stats, x, z)

On another process's device (one global mesh under jax.distributed) a program is not run
here: `get` returns what it would return there as handles without data, which this process
only passes on (`processes.move`).
"""

from __future__ import annotations

import collections
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel.pipeline.host import timeline
from jaxpar.parallel.pipeline.stage_fns import StageFunctions
from jaxpar.parallel.transport import processes


class ProgramTable:
    """Jitted programs by name (each counting its traces: a compiled step must not retrace),
    their AOT executables by (call, name, device id), and stamped variants for timelines."""

    def __init__(self, trace_counts: collections.Counter):
        self.trace_counts = trace_counts
        self.fns: dict[str, Callable] = {}
        self.jitted: dict[str, Callable] = {}
        self.compiled: dict[tuple, object] = {}
        self.stamps = timeline.Stamps()
        self._stamped: dict[str, Callable] = {}
        self._shapes_elsewhere: dict = {}

    def register(self, name: str, fn: Callable, **jit_kwargs) -> None:
        @functools.wraps(fn)
        def counted(*args, **kw):
            self.trace_counts[name] += 1
            return fn(*args, **kw)

        self.fns[name] = fn
        self.jitted[name] = jax.jit(counted, **jit_kwargs)

    def get(self, name: str, kind: str, device) -> Callable:
        """Program `name` as AOT-compiled for `kind` ('step', 'eval_step') on `device`, else
        jitted; on another process's device, what it returns there (`_elsewhere`)."""
        if not processes.owns(device):
            return functools.partial(self._elsewhere, name, device)
        return self.compiled.get((kind, name, device.id)) or self.jitted[name]

    def _elsewhere(self, name, device, *args):
        key = (name, device.id)
        if key not in self._shapes_elsewhere:
            self._shapes_elsewhere[key] = jax.eval_shape(self.fns[name], *args)
        return jax.tree.map(lambda a: processes.handle(a.shape, a.dtype, device), self._shapes_elsewhere[key])

    def stamped(self, name: str) -> Callable:
        """Program `name` stamping its start and end into `self.stamps` (`timeline`)."""
        if name not in self._stamped:
            self._stamped[name] = jax.jit(timeline.stamped(self.fns[name], self.stamps))
        return self._stamped[name]


def register_stage_programs(table: ProgramTable, fns: StageFunctions, split: bool = False) -> None:
    """Every stage's programs: eval and training forwards, backwards (`split`: input and
    weight gradients apart), the last stage's fused step, accumulators, updates, and each
    replica's micro-batch split."""
    S, donate = fns.stages, lambda *nums: {"donate_argnums": nums}  # noqa: E731 (accumulators in place)
    if split:
        _register_split(table, fns)
    for s in range(S - 1):
        table.register(f"fwd{s}", lambda p, z, x, s=s: fns.forward(s, p, z, x, False)[0])
        table.register(f"train_fwd{s}", lambda *a, s=s: fns.train_forward(s, *a), **donate(3))
        if fns.remat:
            table.register(f"bwd{s}", lambda *a, s=s: fns.backward_remat(s, *a), **donate(4))
        else:
            table.register(f"bwd{s}", lambda *a, s=s: fns.backward(s, *a), **donate(2))
    table.register("last", fns.last, **donate(6, 7, 8))
    table.register("last_eval", fns.last_eval)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
    for s in range(S):
        table.register(f"zeros{s}", lambda p, z, s=s: fns.zeros(s, p, z))
        table.register(f"update{s}", fns.update, **donate(0, 1))
        if fns.replicas > 1:  # per stage: a device holds two stages' copies
            table.register(f"add{s}", add)
    for r in range(fns.replicas):
        table.register(f"split_images{r}", lambda x, r=r: fns.split_images(r, x))
        table.register(f"split_labels{r}", lambda a, w, r=r: fns.split_labels(r, a, w))
    if fns.replicas > 1:
        table.register("add_sums", add)



def _register_split(table: ProgramTable, fns: StageFunctions) -> None:
    """The split backward's programs: layer-by-layer forwards (keeping each layer's vjp), the
    input gradient (keeping each layer's cotangent; with remat recomputing the forward), the
    weight gradient, and the last stage's forward, loss and input gradient."""
    for s in range(fns.stages - 1):
        table.register(f"layers_fwd{s}", lambda *a, s=s: fns.layers_forward(s, *a), donate_argnums=(3,))
        if fns.remat:  # (input gradient, cotangents, the recomputed vjps)
            table.register(f"bwd_in{s}", lambda p, z, x, g, s=s: _remat_input(fns, s, p, z, x, g))
        else:
            table.register(f"bwd_in{s}", fns.backward_input)
    for s in range(fns.stages):
        table.register(f"bwd_w{s}", fns.backward_weight, donate_argnums=(2,))
    table.register("last_in", fns.last_input, donate_argnums=(6, 7))


def _remat_input(fns: StageFunctions, s, params, stats, x, g):
    """With remat: the stage's forward recomputed layer by layer from its input, then its input
    gradient; the vjps go on to the weight gradient."""
    _, vjps, _ = fns.layers_forward(s, params, stats, x, fns.zeros(s, params, stats)[1])
    dx, cotangents = fns.backward_input(vjps, g)
    return dx, cotangents, vjps
