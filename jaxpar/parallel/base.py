"""The strategy interface: how one training step is placed on a device mesh (docs/design.md).

    strategy = STRATEGIES[name](config)
    mesh = strategy.make_mesh(jax.devices())
    state = strategy.init(model, tx, mesh)          # placed: replicated, sharded or staged
    programs = strategy.compile("step", state, batch)  # optional: seconds, FLOPs, bytes
    state, sums = strategy.step(state, strategy.place_batch(batch))
    totals = strategy.host_sums(sums)               # waits; {'loss_sum': ..., ...} floats
    params = strategy.to_reference(state)           # single-device layout

A strategy owns placement and how gradients are combined; the loss, the optimizer update and
the metrics come from `jaxpar.step` unchanged.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx

from jaxpar import data as datalib
from jaxpar.profiling import measure
from jaxpar import mesh as meshlib
from jaxpar.config import TrainConfig
from jaxpar.models import option_value
from jaxpar.step import Params, TrainState
from jaxpar.parallel.layout import host_copy
from jaxpar.parallel.spec import StrategySpec


def model_option(config: TrainConfig, option: str):
    """The model's `option` (depth, width, ...) as the run will build it: given, or its default."""
    return option_value(config.model.model, option, getattr(config.model, option))


# The option of strategies whose step can be chained K times in one program (`Strategy.steps`).
STEPS_OPTION = "steps_per_dispatch"

class Strategy(StrategySpec):
    """Base class of every strategy: how one step runs on a mesh (the module docstring); what
    the strategy is and supports: `StrategySpec`."""

    def __init__(self, config: TrainConfig):
        self.check_model(config.model)
        self.config = config
        self.mesh = None
        self.graphdef: nnx.GraphDef | None = None
        self.tx: optax.GradientTransformation | None = None
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self.compiled: dict[str, Any] = {}  # program name -> AOT-compiled executable

    # --- placement -------------------------------------------------------------------------
    def make_mesh(self, devices) -> jax.sharding.Mesh:
        """The mesh of `mesh_layout` over `devices` (the first ones, when it uses fewer)."""
        devices = list(devices)
        axes = self.mesh_layout(devices)
        return meshlib.make_mesh(axes, devices[:math.prod(axes.values())])

    def mesh_layout(self, devices) -> dict[str, int]:
        """`mesh_axes` outermost first, as the mesh lays them over `devices` (numbered process
        by process, so the last axes sit within a process): as --mesh lists them, else, over
        several processes, the axes that talk most within a process (`meshlib.arrange`)."""
        axes = self.mesh_axes(self.config.parallel.mesh, len(devices))
        if self.config.parallel.mesh or len({d.process_index for d in devices}) == 1:
            return axes
        return meshlib.arrange(axes)

    def init(self, model: nnx.Module, tx: optax.GradientTransformation, mesh) -> TrainState:
        raise NotImplementedError

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        raise NotImplementedError

    def rows_multiple(self) -> int:
        """The number a placed batch's rows must be a multiple of (its data shards)."""
        return 1

    def pad(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Pad with weight-0 rows to a multiple of `rows_multiple`. Every strategy divides its
        loss and metrics by weight totals, so padding changes neither: any batch, an uneven
        last evaluation batch included, runs on any mesh."""
        unit = self.rows_multiple()
        return datalib.pad_batch(batch, -(-len(batch["label"]) // unit) * unit)

    # --- programs --------------------------------------------------------------------------
    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step; returns the new state and global metric sums."""
        return self._call("step", state, batch)

    def steps(self, state: TrainState, batches: list[dict]) -> tuple[TrainState, list[dict]]:
        """`len(batches)` optimizer steps in one program (--steps-per-dispatch K): the same
        steps as K calls of `step`, with one dispatch and one wait where K calls pay K. Only
        for strategies that list "steps_per_dispatch" in `options`. Returns the new state and
        each step's metric sums, in order."""
        return self._call("steps", state, tuple(batches))

    def eval_step(self, state: TrainState, batch: dict) -> dict:
        """Global metric sums of one evaluation batch."""
        return self._call("eval_step", state, batch)

    def host_sums(self, sums: dict) -> dict[str, float]:
        """`step`'s or `eval_step`'s metric sums as host floats (waits for them). Every process
        calls it at the same points (under jax.distributed it may gather)."""
        return {k: float(v) for k, v in host_copy(sums).items()}

    def gradients(self, state: TrainState, batch: dict) -> Params:
        """Gradients of the global-batch loss, in the reference layout, on host (for
        equivalence tests; gathered from every process of a global mesh)."""
        return host_copy(self._call("gradients", state, batch))

    def compile(self, name: str, state: TrainState, batch: dict) -> measure.Programs:
        """AOT-compile every program that `name` ('step', 'eval_step') runs, for these
        arguments; later calls run the executables (unless `runs_executables` is False).

        Returns:
          a `measure.Programs`: the seconds spent lowering and compiling, and each program
          with how it counts toward one call (FLOPs, memory, collective bytes).
        """
        start = time.perf_counter()
        executable = getattr(self, f"_jit_{name}").lower(state, batch).compile()
        seconds = time.perf_counter() - start
        if self.runs_executables:
            self.compiled[name] = executable
        return measure.Programs(name, seconds, (self._program(name, executable),))

    def _program(self, name: str, executable) -> measure.Program:
        """How program `name` counts toward a call: one SPMD share on every mesh device."""
        return measure.Program(name, executable, devices=self.mesh.devices.size)

    def to_reference(self, state: TrainState) -> Params:
        """Parameters as the single-device run holds them (unsharded, unstacked) on host."""
        return self.state_to_reference(state).params

    def state_to_reference(self, state: TrainState) -> TrainState:
        """The whole state (parameters, optimizer state, step) in the single-device layout, on
        host: what checkpoints hold, so a run can move between strategies and meshes.
        Strategies that shard or stack state override this."""
        return host_copy(state)

    def state_from_reference(self, ref: TrainState) -> TrainState:
        """Inverse of `state_to_reference`: place a reference-layout state for this strategy.
        Call after `init` (which fixes the mesh and programs)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Mesh shape, axis use, etc. for results JSON."""
        shape = meshlib.mesh_shape(self.mesh) if self.mesh is not None else {}
        out = {"strategy": self.name, "mesh": shape, "devices": int(np.prod(list(shape.values()) or [1]))}
        count = len({d.process_index for d in self.mesh.devices.flat}) if self.mesh is not None else 1
        if count > 1:  # one global mesh over processes: which axes cross them
            per = self.mesh.devices.size // count
            out["process_layout"] = {"processes": count, "devices_per_process": per,
                                      "axes": meshlib.process_layout(shape, per)}
        return out

    def theory(self) -> dict[str, int]:
        """Expected collective operand bytes per step by op (and 'total'); {} = none expected."""
        return {}

    def accounting(self, programs: measure.Programs, state: TrainState) -> dict:
        """Communication and memory metrics for results JSON, from `compile("step", ...)`."""
        collective = programs.collective_bytes
        return {
            "collective_bytes_per_step": collective["total"],
            "collective_bytes_by_op": collective,
            "collective_bytes_theory": self.theory(),
            "state_bytes_per_device": measure.state_bytes_per_device(state),
            "memory_per_device": programs.memory,
        }

    # --- helpers for subclasses ------------------------------------------------------------
    def _register(self, name: str, fn: Callable, transform: Callable = jax.jit, **kwargs) -> None:
        """Compile-wrap `fn` (jit, or e.g. pmap) under `name`, counting traces (a compiled
        step must not retrace)."""

        @functools.wraps(fn)
        def counted(*args, **kw):
            self.trace_counts[name] += 1
            return fn(*args, **kw)

        setattr(self, f"_jit_{name}", transform(counted, **kwargs))
        if name == "step" and STEPS_OPTION in self.options:
            self._register_steps(getattr(self, "_jit_step"))

    def _register_steps(self, step: Callable) -> None:
        """The program `steps` runs: the jitted `step` called once per batch, written out (not
        a `lax.scan`: XLA:CPU runs convolutions inside a loop body some 25x slower). Each
        inner call keeps the shardings `step` was registered with."""

        def chained(state, batches):
            self.trace_counts["steps"] += 1
            sums = []
            for batch in batches:
                state, one = step(state, batch)
                sums.append(one)
            return state, sums

        self._jit_steps = jax.jit(chained, donate_argnums=0)

    def _call(self, name: str, *args):
        program = self.compiled.get(name) or getattr(self, f"_jit_{name}")
        return program(*args)
