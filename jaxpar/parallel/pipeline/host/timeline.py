"""A measured timeline of one host-driven pipeline step: when each device runs which
micro-batch's forward or backward, stamped by the device itself.

Every stage program of the step is run in a stamped variant: the same function with an
`io_callback` that takes the host clock once its inputs are ready (the stage's work depends
on the stamp) and once its outputs are (the returned outputs depend on the stamp), so a
stamp marks when the device actually began and finished, not when the host dispatched.
Stamps cost a callback and one element-wise pass over each tensor; the timeline is for
seeing the schedule, not for the step time (`bench` measures that without stamps).

    events = timeline(lambda: walk(..., "timeline"), stamps)   # [{"device", "stage", "kind", "microbatch", "start_ms", "end_ms"}]
    idle_fraction(events, devices=S)
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


class Stamps:
    """Host clock readings by tag, and what each tag ran."""

    def __init__(self):
        self.times: dict[int, list[float | None]] = {}
        self.ops: list[dict] = []

    def clear(self) -> None:
        self.times.clear()
        self.ops.clear()

    def tag(self, **op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def record(self, edge: int, tag, _dependency) -> np.ndarray:
        self.times.setdefault(int(tag), [None, None])[edge] = time.perf_counter()
        return np.zeros((), np.float32)


def _floats(tree):
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating) and x.size]


def _stamp(stamps: Stamps, edge: int, tag, tree):
    """`tree` made to depend on a stamp taken once every float leaf of it is computed."""
    leaves = _floats(tree)
    dependency = sum(x.ravel()[-1] for x in leaves) if leaves else jnp.zeros((), jnp.float32)
    t = io_callback(functools.partial(stamps.record, edge), jax.ShapeDtypeStruct((), jnp.float32),
                    tag, dependency)
    tie = lambda x: x + t.astype(x.dtype) * 0 if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    return jax.tree.map(tie, tree)


def stamped(fn, stamps: Stamps):
    """`fn` taking a leading tag, stamping its start and its end."""
    def run(tag, *args):
        return _stamp(stamps, 1, tag, fn(*_stamp(stamps, 0, tag, args)))
    return run


def timeline(stamped_step, stamps: Stamps) -> list[dict]:
    """One step stamped (`stamped_step()` runs it with the stamped programs, which record into
    `stamps`): an event per stage program run, times in ms from the first start. The step runs
    twice (the first compiles the stamped programs)."""
    for _ in range(2):
        stamps.clear()
        jax.block_until_ready(stamped_step())
    begin = min(t[0] for t in stamps.times.values())
    events = []
    for tag, op in enumerate(stamps.ops):
        if tag not in stamps.times:
            continue  # a program of another process's device (jax.distributed): its own timeline
        start, end = stamps.times[tag]
        events.append({**op, "start_ms": 1000 * (start - begin), "end_ms": 1000 * (end - begin)})
    return events


def idle_fraction(events: list[dict], devices: int) -> float:
    """Share of devices x the span of the stage work (forwards and backwards) in which a
    device ran none of it: the measured bubble."""
    work = [e for e in events if e["kind"] in ("F", "B", "I", "W", "F+B", "F+I")]
    span = max(e["end_ms"] for e in work) - min(e["start_ms"] for e in work)
    busy = 0.0
    for d in {e["device"] for e in work}:
        busy += _covered(sorted((e["start_ms"], e["end_ms"]) for e in work if e["device"] == d))
    return 1.0 - busy / (devices * span)


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of sorted intervals (programs on one device may overlap)."""
    total, reach = 0.0, -np.inf
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
