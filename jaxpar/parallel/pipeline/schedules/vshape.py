"""Schedules with two stages per device in a V (stage k on device k for k < S, on device
2S-1-k after: the first device holds the first and the last stage, so the loss and the
input meet on it), in the orders PyTorch's `torch.distributed.pipelining` lists them:

- zbv (Qi et al. 2023, arXiv 2401.10241 section 6; ScheduleZBVZeroBubble): zero-bubble
  1F1B in the V placement, each backward split into input and weight gradients, the weight
  gradients filling the bubble; near zero bubble when T_F = T_I = T_W;
- dualpipev (DeepSeek-V3's DualPipe in its V form; ScheduleDualPipeV): forward and backward
  chunks of different micro-batches paired (PyTorch runs each pair as one overlapped
  action; here the pair's forward, then its backward, in one slot each), the last
  backwards split so their weight gradients fill the drain.
"""

from __future__ import annotations

from jaxpar.parallel.pipeline.schedules.actions import (BACKWARD, FORWARD, INPUT, WEIGHT, Action,
                                                         Schedule, ScheduleError)


def v_shape(devices: int) -> tuple[tuple[int, ...], ...]:
    """Stage k on device k, then back: stage S + j on device S - 1 - j."""
    return (tuple(range(devices)) + tuple(reversed(range(devices))),)


def zbv(devices: int, microbatches: int, virtual: int = 2) -> Schedule:
    if virtual != 2:
        raise ScheduleError(f"--schedule zbv places exactly 2 stages per device in a V; drop "
                            f"--virtual-stages {virtual} (or pass 2)")
    S, M = devices, microbatches
    return Schedule("zbv", M, v_shape(S), tuple(tuple(_zbv_ops(d, S, M)) for d in range(S)))


def _zbv_ops(d: int, S: int, M: int) -> list[Action]:
    n = max(2 * S - 1, M)
    first, second = d, 2 * S - 1 - d
    f = {first: 0, second: 0}
    b = dict(f)
    out: list[Action] = []

    def add(kind, stage):
        counter = f if kind == FORWARD else b
        out.append(Action(kind, counter[stage], stage))
        counter[stage] += 1

    for _ in range(2 * (S - d) - 1):
        add(FORWARD, first)
    for _ in range(d):
        add(FORWARD, second)
        add(FORWARD, first)
    for _ in range(S - d):
        add(FORWARD, second)
        out += [Action(INPUT, b[second], second), Action(WEIGHT, b[second], second)]
        b[second] += 1
    while f[second] < f[first] or f[first] < n:
        if f[first] < n:
            add(FORWARD, first)
        out += [Action(INPUT, b[first], first), Action(WEIGHT, b[first], first)]
        b[first] += 1
        add(FORWARD, second)
        out += [Action(INPUT, b[second], second), Action(WEIGHT, b[second], second)]
        b[second] += 1
    w = dict(b)
    for _ in range(d):
        out += [Action(INPUT, b[first], first), Action(INPUT, b[second], second)]
        b[first] += 1
        b[second] += 1
    for _ in range(S - d):
        out += [Action(INPUT, b[first], first), Action(WEIGHT, w[first], first)]
        b[first] += 1
        w[first] += 1
    out += [Action(WEIGHT, m, second) for m in range(w[second], b[second])]
    out += [Action(WEIGHT, m, first) for m in range(w[first], b[first])]
    return [a for a in out if a.microbatch < M]  # the padding micro-batches (M < 2S-1) dropped


def dualpipev(devices: int, microbatches: int, virtual: int = 2) -> Schedule:
    if virtual != 2:
        raise ScheduleError(f"--schedule dualpipev places exactly 2 stages per device in a V; drop "
                            f"--virtual-stages {virtual} (or pass 2)")
    if microbatches < 2 * devices:
        raise ScheduleError(f"--schedule dualpipev needs at least as many micro-batches as stages: "
                            f"--microbatches {microbatches} on {devices} devices (2 x {devices} stages); "
                            f"use --microbatches {2 * devices} or more")
    S, M = devices, microbatches
    return Schedule("dualpipev", M, v_shape(S), tuple(tuple(_DualPipeV(d, S, M).ops()) for d in range(S)))


class _DualPipeV:
    """Device d's list of ScheduleDualPipeV (an overlapped forward-and-backward pair as its
    forward, then its backward)."""

    def __init__(self, d: int, S: int, M: int):
        self.d, self.S, self.M = d, S, M
        self.first, self.second = d, 2 * S - 1 - d
        self.count: dict[tuple[str, int], int] = {}
        self.weights: list[tuple[int, int]] = []   # (stage, micro-batch) awaiting their W
        self.out: list[Action] = []

    def add(self, kind: str, stage: int) -> None:
        key = (INPUT if kind == BACKWARD else kind, stage)
        m = self.count.get(key, 0)
        self.out.append(Action(kind, m, stage))
        self.count[key] = m + 1
        if kind == INPUT:
            self.weights.append((stage, m))

    def pair(self, forward_stage: int, backward_stage: int) -> None:
        self.add(FORWARD, forward_stage)
        self.add(BACKWARD, backward_stage)

    def weight(self) -> None:
        if self.weights:
            stage, m = self.weights.pop(0)
            self.out.append(Action(WEIGHT, m, stage))

    def ops(self) -> list[Action]:
        d, S, M, first, second = self.d, self.S, self.M, self.first, self.second
        for _ in range((S - d - 1) * 2):
            self.add(FORWARD, first)
        for _ in range(d + 1):
            self.add(FORWARD, first)
            self.add(FORWARD, second)
        for _ in range(S - d - 1):
            self.add(INPUT, second)
            self.weight()
            self.add(FORWARD, second)
        for i in range(M - 2 * S + d + 1):
            if i == 0 and d == S - 1:
                self.add(FORWARD, first)
                self.add(BACKWARD, second)
            else:
                self.pair(first, second)
            self.pair(second, first)
        for _ in range(S - d - 1):
            self.add(BACKWARD, second)
            self.pair(second, first)
        split = False
        for i in range(d + 1):
            split = split or (i == (d + 1) // 2 and d % 2 == 1)
            self.add(INPUT if split else BACKWARD, second)
            split = split or (i == (d + 1) // 2 and d % 2 == 0)
            self.add(INPUT if split else BACKWARD, first)
        for _ in range(S - d - 1):
            self.weight()
            self.add(INPUT if split else BACKWARD, first)
        for _ in range(d + 1):
            self.weight()
        return self.out
