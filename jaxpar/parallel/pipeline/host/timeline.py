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

A step that runs as one program per process (`column`, across processes) is stamped inside
those programs instead, every timed step: a custom call (`p2p.stamp`) reads the host's
monotonic clock as each action and receive begins and ends, a few microseconds each, no
interpreter involved; `program_timeline` gathers every process's stamps and says what they
show: the bubble each step lived beside its table replayed with the same step's times.

    steps = program_steps(lowered, mine, p2p.take_stamps())   # per device: (steps, stamps) ns
    program_timeline(schedule, lowered, mine, stamps, sent_early(schedule))   # a collective
"""

from __future__ import annotations

import functools
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxpar.parallel.pipeline.device_program import stamp_marks
from jaxpar.parallel.pipeline.schedules import FORWARD, Action, Schedule, Send, timed_bubble, timed_idle
from jaxpar.parallel.transport import addresses


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


# --- a step run as one program per device, stamped inside its programs (`p2p.stamp`) ------------
def device_mark(device: int, mark: int) -> int:
    """A stamp's mark: `device_program.execute`'s, with the device whose program stamped it."""
    return device << 32 | mark


def program_steps(lowered, devices, stamps: np.ndarray) -> dict[int, np.ndarray]:
    """Per device of `devices`, the clock its program read step by step (`stamps`: rows of
    (mark, ns), `p2p.take_stamps`): (steps, stamps a step) nanoseconds, column j taken at
    `stamp_marks(lowered[d])[j]`. RuntimeError unless they are whole steps in program order."""
    out = {}
    for d in devices:
        marks = np.asarray(stamp_marks(lowered[d]), np.int64)
        mine = stamps[stamps[:, 0] >> 32 == d]
        steps = len(mine) // len(marks)
        mine = mine[:steps * len(marks)].reshape(steps, len(marks), 2)
        if not steps or ((mine[:, :, 0] & 0xFFFFFFFF) != marks).any():
            raise RuntimeError(f"device {d}'s program stamps are not whole steps in program order "
                               f"({len(stamps)} stamps)")
        out[d] = mine[:, :, 1]
    return out


def program_events(ops, device: int, times_ms, begin_ms: float) -> list[dict]:
    """One step of a device's stamped ops (a `program_steps` row, in ms) as events in ms from
    `begin_ms`: each action, and each receive ("recv": the wait for a message)."""
    events, ends = [], iter(times_ms)
    for op in ops:
        if isinstance(op, Send):
            continue
        start, end = float(next(ends)), float(next(ends))
        if isinstance(op, Action):
            what = {"program": f"{op.kind}{op.stage}", "kind": op.kind, "stage": op.stage,
                    "replica": op.replica, "microbatch": op.microbatch}
        else:
            what = {"program": f"recv{op.source}", "kind": "recv", "stage": None, "replica": 0,
                    "microbatch": op.message.microbatch}
        events.append({"device": device, **what, "start_ms": start - begin_ms, "end_ms": end - begin_ms})
    return events


def program_timeline(schedule: Schedule, lowered, mine, stamps: np.ndarray, replayed: Schedule) -> dict:
    """The timed steps as their programs stamped them, every process's devices (a collective;
    `stamped_summary` reads them), beside the table replayed as the runtime lists it
    (`replayed`: `messages.sent_early`)."""
    steps = program_steps(lowered, mine, stamps)
    count = int(addresses.every_process(np.int32(min(len(t) for t in steps.values()))).min())
    # processes of one host share its clock: their times from the first stamp of all (gathered
    # as float32, nanoseconds since boot would lose their last 21 bits); else each its own
    one_clock = len(set(addresses.exchange(socket.gethostname()))) == 1
    first = min(int(t[:count].min()) for t in steps.values())
    begin = min(int(t) for t in addresses.exchange(str(first))) if one_clock else first
    width = max(len(stamp_marks(ops)) for ops in lowered)
    ms = np.full((count, schedule.devices, width), np.nan, np.float32)
    for d, times in steps.items():
        ms[:, d, :times.shape[1]] = (times[:count] - begin) / 1e6
    every = np.fmax.reduce(addresses.every_process(ms), axis=0)
    return stamped_summary(schedule, lowered, every, one_clock, replayed)


def stamped_summary(schedule: Schedule, lowered, ms: np.ndarray, one_clock: bool, replayed: Schedule) -> dict:
    """What the stamped steps say (`ms[step, device, j]`: the clock at `stamp_marks(lowered[d])[j]`):
    each action's mean time (`action_ms`, by kind and stage) and each device's median wait for
    messages a step (`receive_ms`); on one clock also the middle step's events, a message's
    latency (`latency_ms`: the mean time from an activation's send to its receive's end, over
    receives that began before it was sent; gradients cross the same links) and the bubble as
    the steps lived it (`idle_ms`: a step's span from its first action's start on any device
    to its last's end, less a device's mean time in actions; the median over steps). Beside
    it the table's (`idle_ms_timed`, and as a share `bubble_timed`): each step's table
    replayed with that step's own action times and the latency, the median over steps. Mean
    times would not do: with next to no bubble in its table (ZBV), a step idles mostly where
    its actions' times vary, which their means hide."""
    acted, sent, received, waits = _read(lowered, ms)
    by_kind: dict[tuple, list] = {}
    for a, (starts, ends) in acted.items():
        by_kind.setdefault((a.kind, a.stage), []).extend(ends - starts)
    latency_s = _latency_ms(sent, received) / 1000 if one_clock else 0.0
    each_step = [{a: float(ends[k] - starts[k]) / 1000 for a, (starts, ends) in acted.items()} for k in range(len(ms))]
    middle = len(ms) // 2
    return {"stamped": "in the step's programs", "one_clock": one_clock, "steps": len(ms),
            "events": ([e for d, ops in enumerate(lowered)
                        for e in program_events(ops, d, ms[middle, d], float(np.nanmin(ms[middle])))]
                       if one_clock else None),
            "action_ms": {f"{kind}{stage}": float(np.mean(v)) for (kind, stage), v in sorted(by_kind.items())},
            "receive_ms": waits, "latency_ms": 1000 * latency_s if one_clock else None,
            "idle_ms": _lived_idle_ms(acted, schedule.devices) if one_clock else None,
            "idle_ms_timed": 1000 * float(np.median([timed_idle(replayed, t, latency_s) for t in each_step])),
            "bubble_timed": float(np.median([timed_bubble(replayed, t, latency_s) for t in each_step]))}


def _read(lowered, ms: np.ndarray):
    """From the stamps (ms, per step): each action's start and end, each activation's send,
    each message's receive (start and end), and each device's median wait in receives a step."""
    acted, sent, received, waits = {}, {}, {}, []
    for d, ops in enumerate(lowered):
        starts, ends = ms[:, d, 0::2], ms[:, d, 1::2]  # by stamped op (actions and receives)
        waited = np.zeros(len(ms))
        j, previous = -1, None
        for op in ops:
            if isinstance(op, Send):
                # an activation leaves as the forward that computed it ends (it follows that
                # forward); a gradient may leave before its action ends (which goes on to
                # accumulate the weights' gradients), or, listed later, earlier still
                if op.message.kind == FORWARD and previous == Action(FORWARD, op.message.microbatch,
                                                                      op.message.sender, op.message.replica):
                    sent[op.message] = ends[:, j]
                continue
            j, previous = j + 1, op
            if isinstance(op, Action):
                acted[op] = (starts[:, j], ends[:, j])
            else:
                received[op.message] = (starts[:, j], ends[:, j])
                waited += ends[:, j] - starts[:, j]
        waits.append(float(np.median(waited)))
    return acted, sent, received, waits


def _latency_ms(sent: dict, received: dict) -> float:
    """The mean time from a message's send (of those in `sent`) to the end of a receive that
    began before it (that waited for it); 0 where none did. The mean, not the median: each
    delay on the critical path adds to the step, and a few are long (a rank woken late:
    ZBV's median was a quarter of its mean)."""
    late = [end - at for m, (started, ended) in received.items() if m in sent
            for start, end, at in zip(started, ended, sent[m]) if start < at]
    return float(np.mean(late)) if late else 0.0


def _lived_idle_ms(acted: dict, devices: int) -> float:
    """The median over steps of a step's span of actions (its first's start on any device to
    its last's end) less a device's mean time in actions."""
    first = np.min([starts for starts, _ in acted.values()], axis=0)
    last = np.max([ends for _, ends in acted.values()], axis=0)
    busy = sum(ends - starts for starts, ends in acted.values())
    return float(np.median(last - first - busy / devices))
