"""Pipeline schedules (`jaxpar/parallel/pipeline/schedules.py`): bubble and micro-batches in flight.

Both GPipe and 1F1B idle (S-1)/(M+S-1) of the slots; 1F1B keeps at most S - s micro-batches
in flight on stage s, GPipe all M.

    python -m pytest -q tests/parallel/pipeline/test_schedules.py
"""

import pytest

from jaxpar.parallel.pipeline import schedules


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (3, 7), (4, 4)])
def test_bubble_of_both_schedules_equals_theory(stages, micro):
    for name in ("gpipe", "1f1b"):
        table = schedules.schedule(name, stages, micro)
        assert schedules.bubble_fraction(table) == pytest.approx((stages - 1) / (micro + stages - 1))
    assert schedules.peak_in_flight(schedules.schedule("1f1b", stages, micro)) == \
        [min(stages - s, micro) for s in range(stages)]
    assert schedules.peak_in_flight(schedules.schedule("gpipe", stages, micro)) == [micro] * stages


@pytest.mark.parametrize("stages", [2, 4, 6, 8])
def test_gems_bubble_is_below_gpipes_at_the_same_m(stages):
    for micro in range(2, 4 * stages + 1, 2):
        table = schedules.gems(stages, micro)
        bubble = schedules.bubble_fraction(table)
        assert bubble < schedules.bubble_theory(stages, micro), (stages, micro)
        if micro % stages == 0:  # Chimera's (S-2)/(2M+S-2) exactly
            assert bubble == pytest.approx(schedules.gems_bubble_theory(stages, micro))
        # at 1F1B's activation memory: no device holds more than S stage inputs
        assert max(schedules.peak_in_flight(table)) <= stages


@pytest.mark.parametrize("name,stages,micro", [("1f1b", 4, 8), ("gems", 4, 8), ("gems", 2, 2)])
def test_slot_program_keeps_every_message_until_its_backward(name, stages, micro):
    """Replaying the compiled table: every op finds its input (and gradient) in the inbox
    slot it names, put there by the neighbour's earlier op and not overwritten since."""
    table = schedules.schedule(name, stages, micro)
    ops, recv, size = schedules.slot_program(table)
    inbox = [[None] * size for _ in range(stages)]
    for t in range(len(table)):
        sent = {}
        for d in range(stages):
            kind, s, r, m, act, grad = ops[t, d]
            if kind == 0:
                continue
            if s > 0:
                assert inbox[d][act] == ("act", r, m), (t, d)
            if kind == 2 and s < stages - 1:
                assert inbox[d][grad] == ("grad", r, m), (t, d)
            sent[d] = ("act" if kind == 1 else "grad", r, m)
        for d in range(stages):
            for side, src in ((0, d - 1), (1, d + 1)):
                if recv[t, d, side] >= 0:
                    inbox[d][recv[t, d, side]] = sent[src]
    busy = (ops[..., 0] > 0).sum()
    assert busy == 2 * micro * stages  # every micro-batch forward and back through every stage
