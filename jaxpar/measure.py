"""Measurements of compiled programs: time, FLOPs, memory and collective bytes.

Communication is read from the compiled HLO (DESIGN.md invariant 4): every collective op,
its operand bytes, and the trip counts of the loops it sits in, so a pipeline's per-tick
`ppermute` inside a `scan` counts once per tick.

    stats = program_stats(compiled)          # flops, memory, collectives of one executable
    ms = time_calls(lambda: step(...), n=20) # steady-state wall times, one call in flight
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

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
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
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


def collectives(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective in an HLO module with its operand bytes and how often it runs.

    Returns:
      [{'op', 'bytes' (operand bytes of one execution), 'count' (executions per program run,
        loop trip counts multiplied in), 'group_size' (None for mpi4jax calls)}]
    """
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
    if entry is None:
        return []

    # How many times each computation runs per program run (while bodies x trip count).
    runs: dict[str, int] = defaultdict(int)
    runs[entry] = 1
    order = [entry]
    for name in order:  # breadth-first over the call graph
        for line in bodies.get(name, []):
            trip = _TRIP.search(line)
            callees = _CALLEE.findall(line)
            for b in _BRANCHES.findall(line):
                callees += [c.strip().lstrip("%") for c in b.split(",")]
            for callee in callees:
                mult = int(trip.group(1)) if (trip and f"body=%{callee}" in line) else 1
                if callee not in runs:
                    order.append(callee)
                runs[callee] += runs[name] * mult

    found = []
    for name, lines in bodies.items():
        for line in lines:
            m = _INSTRUCTION.search(line)
            if not m:
                continue
            result_type, op = m.groups()
            if op == "custom-call" and runs.get(name, 0):
                mpi = _mpi_call(line)
                if mpi:
                    found.append({**mpi, "count": runs[name]})
                continue
            base = op.removesuffix("-start")
            if base not in COLLECTIVES or op.endswith("-done") or runs.get(name, 0) == 0:
                continue
            nbytes = shape_bytes(result_type)
            group = _group_size(line)
            if op.endswith("-start") and result_type.startswith("("):
                # async start returns (operand, result, ...): count the operand only
                nbytes = shape_bytes(result_type.split(")")[0].split(",")[0] + "]")
            if base == "all-gather":
                nbytes //= max(group, 1)  # result is the gathered array: operand is 1/N of it
            elif base == "reduce-scatter":
                nbytes *= group           # result is one shard: operand is N of them
            found.append({"op": base, "bytes": nbytes, "count": runs[name], "group_size": group})
    return found


def _mpi_call(line: str) -> dict[str, Any] | None:
    """An mpi4jax custom call's op and operand bytes (its first operand; the second is the
    ordering token). The communicator's size is not in the HLO: group_size is None."""
    target, operands = _MPI_TARGET.search(line), _OPERANDS.search(line)
    if not (target and operands):
        return None
    first = _SHAPE.search(operands.group(1))
    return {"op": target.group(1), "bytes": shape_bytes(first.group(0)) if first else 0,
            "group_size": None}


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Operand bytes per program run, by collective kind, plus 'total'."""
    totals: dict[str, int] = defaultdict(int)
    for c in collectives(hlo_text):
        totals[c["op"]] += c["bytes"] * c["count"]
    totals["total"] = sum(totals.values())
    return dict(totals)


def program_stats(compiled) -> dict[str, Any]:
    """FLOPs, memory per device and collective bytes of one compiled executable.

    FLOPs come from XLA's cost analysis, which counts a loop body once; programs with loops
    report `flops_per_loop_trip_counted_once: True` so nobody mistakes it for the total.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    stats = {
        "flops": float(cost.get("flops", 0.0)) if cost else 0.0,
        "has_loops": " while(" in text,
        "collective_bytes": collective_bytes(text),
        "memory": {
            "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0)),
            "output_bytes": int(getattr(mem, "output_size_in_bytes", 0)),
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
            "alias_bytes": int(getattr(mem, "alias_size_in_bytes", 0)),
        },
    }
    return stats


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
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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


def step_flops(program_flops: float, accounting: dict[str, Any], devices: int) -> float:
    """FLOPs of one whole training step on every device together, from XLA's cost analysis.

    Args:
      program_flops: `program_stats(compiled)["flops"]` of the step program; for an SPMD
        program that is one device's share, and the step runs on all `devices`.
      accounting: `strategy.accounting(...)`; layer-split runs one program per stage, each on
        one device, and reports their sum as `flops_all_stage_programs`.
    """
    return accounting.get("flops_all_stage_programs") or program_flops * devices


def max_memory(stats: list[dict[str, Any]]) -> dict[str, int]:
    """Field-wise maximum of several programs' `program_stats(...)["memory"]`: the memory per
    device of a strategy that runs several programs (each on its own device or one at a time)."""
    return {k: max(m[k] for m in stats) for k in stats[0]}
