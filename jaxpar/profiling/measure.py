"""Measurements of compiled programs: time, FLOPs, memory and collective bytes.

Communication is read from the compiled HLO (docs/design.md): every collective op, its
operand bytes, the trip counts of the loops it sits in (a pipeline's per-tick `ppermute`
inside a `scan` counts once per tick) and whether it sits in a conditional's branch (taken
only some steps: local-sgd's average).

    stats = program_stats(compiled)          # flops, memory, collectives of one executable
    programs = strategy.compile("step", state, batch)   # a Programs: every program of a step
    ms = time_calls(lambda: step(...), n=20) # steady-state wall times, one call in flight
"""

from __future__ import annotations

import functools
import re
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from jaxpar.models import onednn

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# mpi4jax's collectives are custom calls (custom_call_target="mpi_allreduce_ffi"): counted as
# ops "mpi_allreduce", "mpi_gather", ... with the bytes of their data operand.
_MPI_TARGET = re.compile(r'custom_call_target="(mpi_\w+?)_ffi"')
_OPERANDS = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"=\s*(\(.*?\)|[a-z]+\d*\[[\d,]*\](?:\{[^}]*\})?)\s+([a-z\-]+)\(")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCH = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in an HLO type string like `(f32[2,3]{1,0}, s32[])`."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)  # iota form [groups, size]<=[N]
    if m:
        return int(m.group(2))
    return 1


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The HLO module's computations ({name: body lines}) and the name of its entry."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line.strip()) if line.rstrip().endswith("{") else None
        if m and not line.startswith(" "):
            current = m.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)
    return bodies, entry


def _run_counts(bodies: dict[str, list[str]], entry: str) -> tuple[dict[str, int], dict[str, int]]:
    """How many times each computation runs per program run (while bodies x trip count), and
    how many of those runs sit inside a conditional's branch (taken only when chosen)."""
    runs: dict[str, int] = defaultdict(int)
    in_branch: dict[str, int] = defaultdict(int)
    runs[entry] = 1
    order = [entry]
    for name in order:  # breadth-first over the call graph
        for line in bodies.get(name, []):
            trip = _TRIP.search(line)
            branches = _BRANCH.findall(line)
            for b in _BRANCHES.findall(line):
                branches += [c.strip().lstrip("%") for c in b.split(",")]
            for callee in _CALLEE.findall(line) + branches:
                mult = int(trip.group(1)) if (trip and f"body=%{callee}" in line) else 1
                if callee not in runs:
                    order.append(callee)
                runs[callee] += runs[name] * mult
                in_branch[callee] += (runs[name] if callee in branches else in_branch[name]) * mult
    return runs, in_branch


def collectives(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective in an HLO module with its operand bytes and how often it runs.

    Returns:
      [{'op', 'bytes' (operand bytes of one execution), 'count' (executions per program run,
        loop trip counts multiplied in), 'group_size' (None for mpi4jax calls), 'in_branch'
        (True: inside a conditional's branch, so it runs only when that branch is taken)}];
      a collective reached both inside and outside a branch is listed once for each.
    """
    bodies, entry = _computations(hlo_text)
    if entry is None:
        return []
    runs, in_branch = _run_counts(bodies, entry)
    found = []
    for name, lines in bodies.items():
        if not runs.get(name, 0):
            continue
        for line in lines:
            one = _collective(line)
            if one is None:
                continue
            for branch, count in ((False, runs[name] - in_branch[name]), (True, in_branch[name])):
                if count:
                    found.append({**one, "count": count, "in_branch": branch})
    return found


def _collective(line: str) -> dict[str, Any] | None:
    """The op, operand bytes and group size of one HLO instruction, if it is a collective."""
    m = _INSTRUCTION.search(line)
    if not m:
        return None
    result_type, op = m.groups()
    if op == "custom-call":
        return _mpi_call(line, result_type)
    base = op.removesuffix("-start")
    if base not in COLLECTIVES or op.endswith("-done"):
        return None
    nbytes = shape_bytes(result_type)
    group = _group_size(line)
    if op.endswith("-start") and result_type.startswith("("):
        # async start returns (operand, result, ...): count the operand only
        nbytes = shape_bytes(result_type.split(")")[0].split(",")[0] + "]")
    if base == "all-gather":
        nbytes //= max(group, 1)  # result is the gathered array: operand is 1/N of it
    elif base == "reduce-scatter":
        nbytes *= group           # result is one shard: operand is N of them
    return {"op": base, "bytes": nbytes, "group_size": group}


def _mpi_call(line: str, result_type: str) -> dict[str, Any] | None:
    """An mpi4jax custom call's op and operand bytes (its first operand; the second is the
    ordering token); a receive, whose only operand is the token, counts the bytes it
    returns. The communicator's size is not in the HLO: group_size is None."""
    target, operands = _MPI_TARGET.search(line), _OPERANDS.search(line)
    if not (target and operands):
        return None
    first = _SHAPE.search(operands.group(1))
    nbytes = (shape_bytes(first.group(0)) if first else 0) or shape_bytes(result_type)
    return {"op": target.group(1), "bytes": nbytes, "group_size": None}


def collective_bytes(hlo_text: str, branch_every: int = 1) -> dict[str, int]:
    """Operand bytes per program run, by collective kind, plus 'total'.

    Args:
      branch_every: a conditional's branch is taken once every this many runs (local-sgd's
        average: k); collectives inside one count 1/branch_every of their bytes per run.
    """
    always: dict[str, int] = defaultdict(int)
    branch: dict[str, int] = defaultdict(int)
    for c in collectives(hlo_text):
        (branch if c["in_branch"] else always)[c["op"]] += c["bytes"] * c["count"]
    totals = {op: always.get(op, 0) + branch.get(op, 0) // branch_every
              for op in {**always, **branch}}
    totals["total"] = sum(totals.values())
    return totals


def program_stats(compiled, branch_every: int = 1) -> dict[str, Any]:
    """FLOPs, memory per device and collective bytes of one compiled executable.

    FLOPs come from XLA's cost analysis, which counts a loop body once (programs with loops
    report `has_loops: True` so nobody mistakes it for the total), plus the oneDNN
    convolutions' (custom calls it cannot see: `onednn.hlo_flops`).

    Args:
      branch_every: see `collective_bytes`.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    return {
        "flops": (float(cost.get("flops", 0.0)) if cost else 0.0) + onednn.hlo_flops(text),
        "has_loops": " while(" in text,
        "collective_bytes": collective_bytes(text, branch_every),
        "memory": {
            "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0)),
            "output_bytes": int(getattr(mem, "output_size_in_bytes", 0)),
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
            "alias_bytes": int(getattr(mem, "alias_size_in_bytes", 0)),
        },
    }


@dataclass(frozen=True)
class Program:
    """One compiled executable of a strategy and how it counts toward one call of its entry
    point (a training step, say)."""

    name: str
    executable: Any      # jax.stages.Compiled
    devices: int = 1     # devices that each run a share of it (SPMD: the mesh; a stage: 1)
    branch_every: int = 1  # its conditional branch runs once every this many calls (local-sgd)
    calls: int = 1       # times one call of the entry point runs it (a stage: once per micro-batch)
    stage: int | None = None  # the pipeline stage whose device runs it (host-driven stages)

    @functools.cached_property
    def stats(self) -> dict[str, Any]:
        """`program_stats` of the executable (computed on first use: it reads the HLO)."""
        return program_stats(self.executable, self.branch_every)


@dataclass(frozen=True)
class Programs:
    """What `Strategy.compile(name, state, batch)` gives, the same for every strategy: the
    seconds it took and every program one call of `name` runs (layer-split: one per stage
    and kind; the rest: one SPMD program), with their statistics added up.

        programs = strategy.compile("step", state, batch)
        programs.seconds, programs.flops, programs.memory, programs.collective_bytes
    """

    name: str                        # the entry point: 'step' or 'eval_step'
    seconds: float                   # lowering and compiling every program
    parts: tuple[Program, ...]

    @property
    def flops(self) -> float:
        """FLOPs of one call on every device together: an SPMD program's cost analysis is
        one device's share, so it counts once per device that runs it. A conditional's branch
        counts on every call, as XLA's cost analysis gives it (local-sgd's average: a few
        element-wise FLOPs per parameter, though it runs once every k steps)."""
        return sum(p.stats["flops"] * p.devices * p.calls for p in self.parts)

    @property
    def memory(self) -> dict[str, int]:
        """Memory per device: field-wise the most any one program needs."""
        return max_memory([p.stats["memory"] for p in self.parts])

    @property
    def collective_bytes(self) -> dict[str, int]:
        """Collective operand bytes per call by op, plus 'total', over every program."""
        totals: dict[str, int] = defaultdict(int)
        for p in self.parts:
            for op, nbytes in p.stats["collective_bytes"].items():
                if op != "total":
                    totals[op] += nbytes * p.calls
        return {**totals, "total": sum(totals.values())}

    @property
    def has_loops(self) -> bool:
        """Some program has a loop, whose body XLA's FLOP count includes once."""
        return any(p.stats["has_loops"] for p in self.parts)

    def part(self, name: str) -> Program:
        """The program called `name` (layer-split: 'train_fwd0', 'last', 'update1', ...)."""
        return next(p for p in self.parts if p.name == name)


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 2) -> list[float]:
    """Wall seconds of `n` calls of `fn`, each waited for (one call in flight at a time)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def median_ms(times: list[float]) -> float:
    return 1000.0 * statistics.median(times)


def matmul_peak(devices, n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """Achieved f32 matmul GFLOP/s with one n x n matmul on every device at once.

    This is the ceiling a training step's achieved FLOP/s is compared with: simulated CPU
    devices share the cores, so N devices together reach about what one does.
    """

    devices = list(devices)
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    a = jax.device_put(jnp.ones((len(devices), n, n), jnp.float32), sharding)
    mm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=sharding)
    times = time_calls(lambda: mm(a), repeats)
    flops = 2.0 * n ** 3 * len(devices)
    return {"gflops": flops / statistics.median(times) / 1e9, "n": n, "devices": len(devices)}


def tree_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) in `tree`."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def state_bytes_per_device(state) -> int:
    """Bytes of parameters + optimizer state on the fullest device (the one that runs out of
    memory first), from each array's sharding, so it also works for arrays spanning several
    processes and for states whose parts live on different devices (layer-split's stages).
    Host arrays (no sharding) count on every device."""
    per_device: dict[Any, int] = defaultdict(int)
    host = 0
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        itemsize = np.dtype(leaf.dtype).itemsize
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            host += int(np.prod(np.shape(leaf))) * itemsize
            continue
        for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
            rows = [len(range(*i.indices(n))) for i, n in zip(index, leaf.shape)]
            per_device[device] += int(np.prod(rows)) * itemsize
    return int(max(per_device.values(), default=0) + host)


def max_memory(stats: list[dict[str, Any]]) -> dict[str, int]:
    """Field-wise maximum of several programs' `program_stats(...)["memory"]`: the memory per
    device of a strategy that runs several programs (each on its own device or one at a time)."""
    return {k: max(m[k] for m in stats) for k in stats[0]}
