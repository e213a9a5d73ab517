"""Pipeline schedules (GPipe, 1F1B, GEMS) as tables, with their bubble and memory in flight.

A table says what each device does in each time slot: a micro-batch's forward (F) or
backward (B) through one stage, F and B one slot each.

    table = schedule("1f1b", stages=4, microbatches=8)
    table[t][d] -> ("F", m) | ("B", m) | ("F", m, r) | None     (r: replica, gems only)
    bubble_fraction(table) == (S - 1) / (M + S - 1)

GPipe runs all forwards, then all backwards (fill-drain). 1F1B (PipeDream-Flush) starts
backwards as soon as they are ready and lets stage s hold at most S - s micro-batches in
flight, so it stores fewer activations for the same bubble. GEMS (bidirectional replicas,
the GEMS-MAST / Chimera idea) keeps two copies of the model on the same S devices, replica 1
with its stages in reverse device order (stage s of replica r on device `device_of(s, r)`),
and gives each replica half of the micro-batches: one replica's forwards run while the
other's stages would idle, so the bubble shrinks (even S) at the same activation memory as
1F1B (the same in-flight rule per replica). The tables drive the slot loop of `pipeline`
and `gems` (`slot_program`), the bubble accounting and the schedule figure.
"""

from __future__ import annotations

import numpy as np

Slot = tuple | None  # ("F" | "B", micro-batch) or, in a GEMS table, (kind, micro-batch, replica)


def gpipe(stages: int, microbatches: int) -> list[list[Slot]]:
    """Fill-drain: F(m, s) at slot m + s; B(m, s) after every forward, mirrored."""
    S, M = stages, microbatches
    fwd_slots = M + S - 1
    table: list[list[Slot]] = [[None] * S for _ in range(2 * fwd_slots)]
    for m in range(M):
        for s in range(S):
            table[m + s][s] = ("F", m)
            table[fwd_slots + m + (S - 1 - s)][s] = ("B", m)
    return table


def one_f_one_b(stages: int, microbatches: int) -> list[list[Slot]]:
    """PipeDream-Flush, simulated slot by slot: a ready backward goes first; a forward runs
    only while fewer than S - s micro-batches are in flight on stage s."""
    S, M = stages, microbatches
    f_done: dict[tuple[int, int], int] = {}  # (m, s) -> slot it ran in
    b_done: dict[tuple[int, int], int] = {}
    next_f = [0] * S
    next_b = [0] * S
    table: list[list[Slot]] = []
    t = 0
    while any(b < M for b in next_b):
        row: list[Slot] = [None] * S
        for s in range(S):
            m = next_b[s]
            if m < M:
                ready = (f_done.get((m, s), t) < t) if s == S - 1 else (b_done.get((m, s + 1), t) < t)
                if ready:
                    row[s] = ("B", m)
                    continue
            m = next_f[s]
            in_flight = next_f[s] - next_b[s]
            if m < M and in_flight < S - s and (s == 0 or f_done.get((m, s - 1), t) < t):
                row[s] = ("F", m)
        for s, slot in enumerate(row):
            if slot and slot[0] == "F":
                f_done[(slot[1], s)] = t
                next_f[s] += 1
            elif slot:
                b_done[(slot[1], s)] = t
                next_b[s] += 1
        table.append(row)
        t += 1
        if t > 4 * (M + S) + 8:
            raise RuntimeError("1F1B schedule did not finish")  # cannot happen; guards the loop
    return table


def device_of(stage: int, replica: int, stages: int) -> int:
    """The device holding `stage` of `replica` (replica 1 runs its stages in reverse device
    order); its own inverse: the stage a device holds for a replica."""
    return stage if replica == 0 else stages - 1 - stage


stage_of = device_of


def op(slot: Slot) -> tuple[str, int, int]:
    """(kind, micro-batch, replica) of a table entry (replica 0 outside GEMS)."""
    return (slot[0], slot[1], slot[2] if len(slot) > 2 else 0)


def gems(stages: int, microbatches: int) -> list[list[Slot]]:
    """Bidirectional replicas: micro-batches [0, M/2) go down replica 0, [M/2, M) up replica
    1. Each slot a device runs a ready backward (the oldest first) or else a forward, each
    replica's stage s holding at most S - s micro-batches in flight (1F1B's rule)."""
    S, M = stages, microbatches
    half = M // 2
    micro = {0: list(range(half)), 1: list(range(half, M))}
    f_done: dict[tuple[int, int, int], int] = {}  # (replica, m, stage) -> slot it ran in
    b_done: dict[tuple[int, int, int], int] = {}
    next_f = {(r, s): 0 for r in (0, 1) for s in range(S)}
    next_b = dict(next_f)
    table: list[list[Slot]] = []
    t = 0
    while any(i < half for i in next_b.values()):
        row: list[Slot] = [_gems_pick(d, t, S, half, micro, f_done, b_done, next_f, next_b)
                           for d in range(S)]
        for d, slot in enumerate(row):
            if slot:
                kind, m, r = slot
                s = stage_of(d, r, S)
                (f_done if kind == "F" else b_done)[(r, m, s)] = t
                (next_f if kind == "F" else next_b)[(r, s)] += 1
        table.append(row)
        t += 1
        if t > 4 * (M + S) + 8:
            raise RuntimeError("GEMS schedule did not finish")  # cannot happen; guards the loop
    return table


def _gems_pick(d, t, S, half, micro, f_done, b_done, next_f, next_b) -> Slot:
    """Device d's work in slot t: the ready backward whose micro-batch started first, else a
    forward of the replica with fewer micro-batches in flight here."""
    ready = []
    for r in (0, 1):
        s, i = stage_of(d, r, S), next_b[(r, stage_of(d, r, S))]
        if i < half:
            m = micro[r][i]
            before = f_done.get((r, m, s), t) if s == S - 1 else b_done.get((r, m, s + 1), t)
            if before < t:
                ready.append((f_done[(r, m, 0)], ("B", m, r)))
    if ready:
        return min(ready)[1]
    in_flight = {r: next_f[(r, stage_of(d, r, S))] - next_b[(r, stage_of(d, r, S))] for r in (0, 1)}
    for r in sorted((0, 1), key=lambda r: (in_flight[r], r)):
        s, i = stage_of(d, r, S), next_f[(r, stage_of(d, r, S))]
        if i < half and in_flight[r] < S - s and (s == 0 or f_done.get((r, micro[r][i], s - 1), t) < t):
            return ("F", micro[r][i], r)
    return None


# The pipeline strategy's --schedule choices; TABLES adds the schedules of other strategies.
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
TABLES = {**SCHEDULES, "gems": gems}


def schedule(name: str, stages: int, microbatches: int) -> list[list[Slot]]:
    return TABLES[name](stages, microbatches)


def bubble_fraction(table: list[list[Slot]]) -> float:
    """Share of stage-slots spent idle."""
    slots = len(table) * len(table[0])
    busy = sum(slot is not None for row in table for slot in row)
    return 1.0 - busy / slots


def bubble_theory(stages: int, microbatches: int) -> float:
    """GPipe's (S - 1) / (M + S - 1) (1F1B's too)."""
    return (stages - 1) / (microbatches + stages - 1)


def gems_bubble_theory(stages: int, microbatches: int) -> float:
    """Bidirectional replicas' (S - 2) / (2M + S - 2) for even S (Chimera's, M counting both
    replicas' micro-batches): what the `gems` table idles when M is a multiple of S; other
    M idle a little longer, still less than GPipe (tested)."""
    return (stages - 2) / (2 * microbatches + stages - 2)


def peak_in_flight(table: list[list[Slot]]) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and backward has not: the
    activations that stage must keep."""
    S = len(table[0])
    peaks, live = [0] * S, [0] * S
    for row in table:
        for s, slot in enumerate(row):
            if slot:
                live[s] += 1 if slot[0] == "F" else -1
                peaks[s] = max(peaks[s], live[s])
    return peaks


def slot_program(table: list[list[Slot]]) -> tuple[np.ndarray, np.ndarray, int]:
    """A table compiled for the slot loop: what each device does, and where its messages wait.

    A message (a stage input sent forward, a gradient sent back) waits in a slot of the
    receiving device's inbox from the end of the slot it was sent in until the backward that
    uses it (a stage input is kept for the backward, which recomputes the stage from it);
    slots are reused as soon as they are free.

    Returns:
      ops [T, S, 6] int32, per slot and device: kind (0 idle, 1 F, 2 B), stage, replica,
        micro-batch, the inbox slot of the stage input (-1: stage 0 reads the images) and of
        the incoming gradient (-1: none);
      recv [T, S, 2] int32: the inbox slot where what device d-1 (0) or d+1 (1) sent in slot
        t is kept (-1: nothing for this device);
      the inbox size (slots per device).
    """
    T, S = len(table), len(table[0])
    ops = np.zeros((T, S, 6), np.int32)
    ops[..., 4:] = -1
    recv = -np.ones((T, S, 2), np.int32)
    held: dict[tuple, int] = {}   # (device, "act" | "grad", replica, m) -> inbox slot
    used: list[set[int]] = [set() for _ in range(S)]
    size = 0
    for t, row in enumerate(table):
        for d, slot in enumerate(row):  # reads, then frees after a backward
            if not slot:
                continue
            kind, m, r = op(slot)
            s = stage_of(d, r, S)
            act = held[(d, "act", r, m)] if s > 0 else -1
            grad = held[(d, "grad", r, m)] if kind == "B" and s < S - 1 else -1
            ops[t, d] = (1 if kind == "F" else 2, s, r, m, act, grad)
            if kind == "B":
                for what in ("act", "grad"):
                    used[d].discard(held.pop((d, what, r, m), -1))
        for d, slot in enumerate(row):  # sends arrive at the end of the slot
            if not slot:
                continue
            kind, m, r = op(slot)
            s = stage_of(d, r, S)
            if (kind == "F" and s == S - 1) or (kind == "B" and s == 0):
                continue  # the last stage's output is the loss; stage 0's gradient ends here
            to = device_of(s + 1 if kind == "F" else s - 1, r, S)
            free = min(set(range(len(used[to]) + 1)) - used[to])
            used[to].add(free)
            held[(to, "act" if kind == "F" else "grad", r, m)] = free
            recv[t, to, 0 if to == d + 1 else 1] = free
            size = max(size, free + 1)
    return ops, recv, size
