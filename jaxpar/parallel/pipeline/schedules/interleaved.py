"""Schedules with several stages per device placed round-robin (stage k on device k mod S:
`--virtual-stages V` chunks each) and the zero-bubble 1F1B, in the orders PyTorch's
`torch.distributed.pipelining` lists them (so `peers` compares the same schedule):

- looped-bfs (Lamy-Poirier 2022, arXiv 2211.05953): each device runs every micro-batch's
  forward through its first chunk, then its next chunk, ..., then the backwards from its
  last chunk down (breadth first);
- interleaved-1f1b (Narayanan et al. 2021, arXiv 2104.04473, Megatron-LM): 1F1B over the
  S x V stages, depth first: a device's warm-up forwards, then one forward and one backward
  in turn, its chunks taken round by round of `rounds` micro-batches; the bubble of 1F1B
  divided by V;
- zb-h1 (Qi et al. 2023, arXiv 2401.10241, PyTorch's ScheduleInterleavedZeroBubble): 1F1B
  with each backward split into its input gradient (I, on the critical path) and its weight
  gradient (W), the W of device d held back d micro-batches to fill the bubble: about a
  third of 1F1B's bubble at 1F1B's activation memory (V = 1), interleaved for V > 1.
"""

from __future__ import annotations

from collections import defaultdict

from jaxpar.parallel.pipeline.schedules.actions import (BACKWARD, FORWARD, INPUT, WEIGHT, Action,
                                                         Schedule, ScheduleError)


def round_robin(devices: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    """Stage k on device k mod S (one copy of the model, S x V stages)."""
    return (tuple(k % devices for k in range(devices * virtual)),)


def looped_bfs(devices: int, microbatches: int, virtual: int = 2) -> Schedule:
    S, M, lists = devices, microbatches, []
    for d in range(S):
        chunks = range(d, S * virtual, S)
        order = [Action(FORWARD, m, k) for k in chunks for m in range(M)]
        order += [Action(BACKWARD, m, k) for k in reversed(chunks) for m in reversed(range(M))]
        lists.append(tuple(order))
    return Schedule("looped-bfs", M, round_robin(S, virtual), tuple(lists))


def rounds_of(devices: int, microbatches: int) -> int:
    """Interleaved schedules take micro-batches in rounds of M / rounds (PyTorch's rule)."""
    rounds = max(1, microbatches // devices)
    if microbatches % rounds:
        raise ScheduleError(f"--microbatches {microbatches} must be a multiple of {rounds} (the rounds of "
                            f"{microbatches // rounds} micro-batches an interleaved schedule takes on "
                            f"{devices} devices): use a multiple of {devices} or fewer than {2 * devices}")
    return rounds


def interleaved_1f1b(devices: int, microbatches: int, virtual: int = 2) -> Schedule:
    return _one_f_one_b("interleaved-1f1b", devices, microbatches, virtual, zero_bubble=False)


def zb_h1(devices: int, microbatches: int, virtual: int = 1) -> Schedule:
    return _one_f_one_b("zb-h1", devices, microbatches, virtual, zero_bubble=True)


def _one_f_one_b(name, S, M, V, zero_bubble: bool) -> Schedule:
    per_round = M // rounds_of(S, M)
    return Schedule(name, M, round_robin(S, V),
                    tuple(tuple(_device_ops(d, S, M, V, per_round, zero_bubble)) for d in range(S)))


def _device_ops(d, S, M, V, per_round, zero_bubble) -> list[Action]:
    """Device d's list: warm-up forwards, then forward + backward (or input gradient, and a
    held-back weight gradient) in turn, then the remaining backwards (PyTorch's
    `_get_1f1b_rank_ops` without its alignment no-ops)."""
    total = V * M
    warmup = min((V - 1) * per_round + (1 if zero_bubble else 2) * (S - 1 - d), total)
    fwd_stage = lambda step: ((step // per_round) % V) * S + d  # noqa: E731
    bwd_stage = lambda step: (V - 1 - ((step - warmup) // per_round) % V) * S + d  # noqa: E731
    counts: dict[tuple[str, int], int] = defaultdict(int)
    backward = INPUT if zero_bubble else BACKWARD
    done_backward: list[int] = []
    out: list[Action] = []

    def take(kind, stage):
        m = counts[kind, stage]
        counts[kind, stage] += 1
        out.append(Action(kind, m, stage))

    def weight_due(step):
        if zero_bubble and step - warmup >= d:  # device d holds its weight gradients back d steps
            take(WEIGHT, bwd_stage(done_backward[counts["w_done", 0]]))
            counts["w_done", 0] += 1

    for step in range(total + warmup):
        if step < warmup:
            take(FORWARD, fwd_stage(step))
            continue
        if step < total:
            take(FORWARD, fwd_stage(step))
        take(backward, bwd_stage(step))
        done_backward.append(step)
        weight_due(step)
    while zero_bubble and counts["w_done", 0] < len(done_backward):
        take(WEIGHT, bwd_stage(done_backward[counts["w_done", 0]]))
        counts["w_done", 0] += 1
    return out
