"""One generator per schedule: (devices S, micro-batches M) -> a `Schedule`, each device's list.

- gpipe (fill-drain): every device runs all M forwards, then all M backwards.
- 1f1b (PipeDream-Flush): device s runs min(S - s, M) forwards, then alternates a backward
  and a forward, then the remaining backwards: at most S - s micro-batches in flight on stage
  s, so it keeps fewer activations than GPipe for the same bubble.
- gems (bidirectional replicas, GEMS-MAST / Chimera): two copies of the model on the same S
  devices, replica 1 with its stages in reverse device order; micro-batches [0, M/2) go down
  replica 0 and [M/2, M) up replica 1. Each slot a device runs a ready backward (the oldest
  first) or a forward of the replica with fewer micro-batches in flight there (1F1B's limit
  per replica), so one replica's work fills the other's bubble.

The schedules with several stages per device (`interleaved`: looped-bfs, interleaved-1f1b,
zb-h1; `vshape`: zbv, dualpipev) are PyTorch's orders. A new schedule is one function
returning a `Schedule` and its line in GENERATORS; `timing.check` then proves it runs
(docs/strategies.md, adding a schedule).
"""

from __future__ import annotations

from jaxpar.parallel.pipeline.schedules import interleaved, vshape
from jaxpar.parallel.pipeline.schedules.actions import BACKWARD, FORWARD, Action, Schedule, ScheduleError


def straight(stages: int) -> tuple[tuple[int, ...], ...]:
    """One copy of the model, stage s on device s."""
    return (tuple(range(stages)),)


def fill_drain(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    lists = tuple(tuple([Action(FORWARD, m, s) for m in range(microbatches)]
                        + [Action(BACKWARD, m, s) for m in range(microbatches)]) for s in range(stages))
    return Schedule("gpipe", microbatches, straight(stages), lists)


def one_f_one_b(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    M, lists = microbatches, []
    for s in range(stages):
        warm = min(stages - s, M)
        order = [Action(FORWARD, m, s) for m in range(warm)]
        for i in range(M - warm):
            order += [Action(BACKWARD, i, s), Action(FORWARD, warm + i, s)]
        order += [Action(BACKWARD, m, s) for m in range(M - warm, M)]
        lists.append(tuple(order))
    return Schedule("1f1b", M, straight(stages), tuple(lists))


def mirrored(stages: int) -> tuple[tuple[int, ...], ...]:
    """Two copies: replica 0's stage s on device s, replica 1's on device S-1-s."""
    return (tuple(range(stages)), tuple(reversed(range(stages))))


def bidirectional(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Simulated slot by slot (each action one slot), each device taking its work greedily."""
    if microbatches % 2 or stages % 2:
        raise ScheduleError(f"--schedule gems needs an even number of stages and of micro-batches (half "
                            f"down each replica); got --mesh stage={stages}, --microbatches {microbatches}")
    S, half = stages, microbatches // 2
    place = mirrored(S)
    micro = {0: list(range(half)), 1: list(range(half, microbatches))}
    done: dict[Action, int] = {}  # action -> slot it ran in
    next_f = {(r, s): 0 for r in (0, 1) for s in range(S)}
    next_b = dict(next_f)
    lists: list[list[Action]] = [[] for _ in range(S)]
    t = 0
    while any(i < half for i in next_b.values()):
        picked = [_gems_pick(d, t, S, half, micro, done, next_f, next_b, place) for d in range(S)]
        for d, a in enumerate(picked):
            if a:
                done[a] = t
                (next_f if a.kind == FORWARD else next_b)[(a.replica, a.stage)] += 1
                lists[d].append(a)
        t += 1
        if t > 4 * (microbatches + S) + 8:
            raise RuntimeError("GEMS schedule did not finish")  # cannot happen; guards the loop
    return Schedule("gems", microbatches, place, tuple(tuple(x) for x in lists))


def _gems_pick(d, t, S, half, micro, done, next_f, next_b, place) -> Action | None:
    """Device d's work in slot t: the ready backward whose micro-batch started first, else a
    forward of the replica with fewer micro-batches in flight here."""
    ran = lambda a: done.get(a, t) < t  # noqa: E731  (finished in an earlier slot)
    ready = []
    for r in (0, 1):
        s = place[r].index(d)
        i = next_b[(r, s)]
        if i < half:
            m = micro[r][i]
            before = Action(FORWARD, m, s, r) if s == S - 1 else Action(BACKWARD, m, s + 1, r)
            if ran(before):
                ready.append((done[Action(FORWARD, m, 0, r)], Action(BACKWARD, m, s, r)))
    if ready:
        return min(ready)[1]
    in_flight = {r: next_f[(r, place[r].index(d))] - next_b[(r, place[r].index(d))] for r in (0, 1)}
    for r in sorted((0, 1), key=lambda r: (in_flight[r], r)):
        s = place[r].index(d)
        i = next_f[(r, s)]
        if i < half and in_flight[r] < S - s and (s == 0 or ran(Action(FORWARD, micro[r][i], s - 1, r))):
            return Action(FORWARD, micro[r][i], s, r)
    return None


# Every schedule by name: its generator and its stages per device when --virtual-stages is
# not given; the `pipeline` strategy's --schedule choices are SCHEDULES (gems is a strategy).
GENERATORS = {"gpipe": fill_drain, "1f1b": one_f_one_b, "gems": bidirectional,
              "interleaved-1f1b": interleaved.interleaved_1f1b, "looped-bfs": interleaved.looped_bfs,
              "zb-h1": interleaved.zb_h1, "zbv": vshape.zbv, "dualpipev": vshape.dualpipev}
VIRTUAL = {"interleaved-1f1b": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}  # others: 1
FIXED_VIRTUAL = ("gpipe", "1f1b", "gems", "zbv", "dualpipev")  # their stages per device are theirs
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")
