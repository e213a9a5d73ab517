"""Pipeline schedules (GPipe, 1F1B) as tables, with their bubble and memory in flight.

A table says which stage does which micro-batch's forward (F) or backward (B) in each time
slot, with F and B one slot each.

    table = schedule("1f1b", stages=4, microbatches=8)
    table[t][s] -> ("F", m) | ("B", m) | None
    bubble_fraction(table) == (S - 1) / (M + S - 1)

GPipe runs all forwards, then all backwards (fill-drain). 1F1B (PipeDream-Flush) starts
backwards as soon as they are ready and lets stage s hold at most S - s micro-batches in
flight, so it stores fewer activations for the same bubble. The tables drive the 1F1B
tick loop, the bubble accounting and the schedule figure.
"""

from __future__ import annotations

Slot = tuple[str, int] | None


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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(name: str, stages: int, microbatches: int) -> list[list[Slot]]:
    return SCHEDULES[name](stages, microbatches)


def bubble_fraction(table: list[list[Slot]]) -> float:
    """Share of stage-slots spent idle."""
    slots = len(table) * len(table[0])
    busy = sum(slot is not None for row in table for slot in row)
    return 1.0 - busy / slots


def bubble_theory(stages: int, microbatches: int) -> float:
    """GPipe's (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


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
