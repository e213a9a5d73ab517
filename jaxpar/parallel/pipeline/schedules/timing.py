"""Replaying a schedule: when each action can run, whether every one ever does, and what that
costs (bubble, micro-batches in flight).

`simulate` runs each device's list in order, an action starting once its device is free and
the actions it needs have ended (`actions.needs`); given each action's duration it gives
every start and end. With every action one slot long that is the schedule's table, the view
the SPMD program's slot loop, the host walk and the figures use:

    rows = table(schedule)          # rows[t][d]: device d's action in slot t, or None
    bubble_fraction(rows)           # share of device-slots idle: (S-1)/(M+S-1) for GPipe and 1F1B

`check` is the one validation every schedule passes before it runs: each forward and
backward of every (micro-batch, stage) exactly once, on the stage's device, in its replica,
and the lists never wait forever (a device whose next action needs one that can only come
later in some list: a deadlock).
"""

from __future__ import annotations

import functools
from typing import Callable

from jaxpar.parallel.pipeline.schedules.actions import (BACKWARD, FORWARD, INPUT, WEIGHT, Action,
                                                         Schedule, ScheduleError, needs)

Slot = tuple | None  # the table's entry: ("F" | "B", micro-batch) (+ replica, with replicas)


def expected(schedule: Schedule) -> set[Action]:
    """A forward of every (micro-batch, stage) and its backward, whole or in two."""
    out = set()
    for m in range(schedule.microbatches):
        r = schedule.replica_of(m)
        for s in range(schedule.stages):
            kind = schedule.backward_kind(m, s, r)
            out |= {Action(FORWARD, m, s, r)} | ({Action(BACKWARD, m, s, r)} if kind == BACKWARD else
                                                   {Action(INPUT, m, s, r), Action(WEIGHT, m, s, r)})
    return out


def check(schedule: Schedule) -> Schedule:
    """`schedule` if it can run; ScheduleError naming what is wrong otherwise."""
    seen: dict[Action, int] = {}
    for d, lst in enumerate(schedule.lists):
        for a in lst:
            if a in seen:
                raise ScheduleError(f"schedule {schedule.name}: {a} listed twice (devices {seen[a]} and {d})")
            if a.replica >= schedule.replicas or schedule.device_of(a.stage, a.replica) != d:
                raise ScheduleError(f"schedule {schedule.name}: {a} listed on device {d}, not where its "
                                    f"stage lives")
            seen[a] = d
    want = expected(schedule)
    if set(seen) != want:
        missing, extra = sorted(want - set(seen)), sorted(set(seen) - want)
        raise ScheduleError(f"schedule {schedule.name}: missing {missing[:3]}, unexpected {extra[:3]}")
    simulate(schedule)
    return schedule


def simulate(schedule: Schedule, duration: Callable[[Action], float] = lambda a: 1.0,
             latency: float = 0.0) -> dict[Action, tuple[float, float]]:
    """(start, end) of every action, each device running its list in order, what another
    device computed arriving `latency` after it ended (ScheduleError when some device's
    next action waits on one that never ends: a deadlock)."""
    times: dict[Action, tuple[float, float]] = {}
    position = [0] * schedule.devices
    free = [0.0] * schedule.devices
    remaining = sum(len(lst) for lst in schedule.lists)
    while remaining:
        progressed = False
        for d, lst in enumerate(schedule.lists):
            while position[d] < len(lst):
                a = lst[position[d]]
                before = needs(a, schedule)
                if any(b not in times for b in before):
                    break
                start = max([free[d]] + [times[b][1] + (latency if schedule.device_of(b.stage, b.replica) != d
                                                        else 0.0) for b in before])
                times[a] = (start, start + duration(a))
                free[d] = times[a][1]
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {d: lst[position[d]] for d, lst in enumerate(schedule.lists) if position[d] < len(lst)}
            raise ScheduleError(f"schedule {schedule.name} deadlocks: each device's next action waits "
                                f"for one that never runs ({stuck})")
    return times


@functools.lru_cache(maxsize=256)
def rows(schedule: Schedule) -> tuple[tuple[Action | None, ...], ...]:
    """The table of actions: rows[t][d] is what device d runs in slot t (one slot each).
    Replayed once per schedule (a Schedule is immutable): a host-driven pipeline walks it
    every step."""
    times = simulate(schedule)
    out: list[list[Action | None]] = [[None] * schedule.devices for _ in range(int(max(e for _, e in times.values())))]
    for d, lst in enumerate(schedule.lists):
        for a in lst:
            out[int(times[a][0])][d] = a
    return tuple(map(tuple, out))


def table(schedule: Schedule) -> list[list[Slot]]:
    """`rows` as plain tuples: (kind, micro-batch), with a replica index when there are two
    copies, and the stage when a device holds several stages of one copy."""
    def slot(a):
        if a is None:
            return None
        if schedule.replicas == 1 and schedule.stages_per_device > 1:
            return (a.kind, a.microbatch, a.replica, a.stage)
        return (a.kind, a.microbatch, a.replica) if schedule.replicas > 1 else (a.kind, a.microbatch)
    return [[slot(a) for a in row] for row in rows(schedule)]


def op(slot: Slot) -> tuple[str, int, int]:
    """(kind, micro-batch, replica) of a table entry (replica 0 without replicas)."""
    return (slot[0], slot[1], slot[2] if len(slot) > 2 else 0)


def bubble_fraction(table_rows: list[list]) -> float:
    """Share of device-slots spent idle."""
    slots = len(table_rows) * len(table_rows[0])
    busy = sum(slot is not None for row in table_rows for slot in row)
    return 1.0 - busy / slots


def peak_in_flight(table_rows: list[list]) -> list[int]:
    """Per device, the most (micro-batch, stage) forwards that ran there whose backward has
    not finished (a split backward finishes with its weight gradient): the activations it
    must keep."""
    S = len(table_rows[0])
    peaks, live = [0] * S, [0] * S
    change = {FORWARD: 1, BACKWARD: -1, INPUT: 0, WEIGHT: -1}
    for row in table_rows:
        for d, slot in enumerate(row):
            if slot:
                live[d] += change[slot[0]]
                peaks[d] = max(peaks[d], live[d])
    return peaks


# Each kind's time in units of a forward's, as the zero-bubble paper takes them (a backward
# twice a forward, split into input and weight gradients of one forward each): the weights
# `timed_bubble` uses when no measured times are given.
UNIT_TIMES = {FORWARD: 1.0, BACKWARD: 2.0, INPUT: 1.0, WEIGHT: 1.0}


def timed_bubble(schedule: Schedule, seconds: dict | None = None, latency: float = 0.0) -> float:
    """The share of devices x the step's span that devices idle when each action takes
    `seconds[kind]` (or `seconds[kind, stage]`; default UNIT_TIMES) and a message `latency`:
    the schedule's bubble from its own lists, for measured forward, backward, input- and
    weight-gradient times."""
    span, busy = replay(schedule, seconds, latency)
    return 1.0 - busy / (schedule.devices * span)


def timed_idle(schedule: Schedule, seconds: dict, latency: float = 0.0) -> float:
    """What a device idles on average over a step replayed with measured `seconds` and
    `latency` (as `timed_bubble` takes them), in their unit: the bubble as a time, beside a
    measured one."""
    span, busy = replay(schedule, seconds, latency)
    return span - busy / schedule.devices


def replay(schedule: Schedule, seconds: dict | None = None, latency: float = 0.0) -> tuple[float, float]:
    """(the step's span, every device's busy time summed) when each action takes its
    `seconds` and a message `latency` (as `timed_bubble` takes them)."""
    seconds = seconds or UNIT_TIMES

    def took(a) -> float:
        """Its time: by the action itself, else by (kind, stage), else by kind; a whole
        backward measured only in halves (a stage that split it), their sum."""
        for key in (a, (a.kind, a.stage), a.kind):
            if key in seconds:
                return seconds[key]
        if a.kind == BACKWARD:
            return took(a._replace(kind=INPUT)) + took(a._replace(kind=WEIGHT))
        return 0.0  # never measured on its own (run inside another program)
    times = simulate(schedule, took, latency)
    span = max(e for _, e in times.values()) - min(s for s, _ in times.values())
    return span, sum(e - s for s, e in times.values())


def bubble_theory(stages: int, microbatches: int) -> float:
    """GPipe's (S - 1) / (M + S - 1) (1F1B's too)."""
    return (stages - 1) / (microbatches + stages - 1)


def gems_bubble_theory(stages: int, microbatches: int) -> float:
    """Bidirectional replicas' (S - 2) / (2M + S - 2) for even S (Chimera's, M counting both
    replicas' micro-batches): what the `gems` table idles when M is a multiple of S; other
    M idle a little longer, still less than GPipe (tested)."""
    return (stages - 2) / (2 * microbatches + stages - 2)
