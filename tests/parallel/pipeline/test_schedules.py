"""Pipeline schedules (`jaxpar/parallel/pipeline/schedules.py`): bubble and micro-batches in flight.

Both GPipe and 1F1B idle (S-1)/(M+S-1) of the slots; 1F1B keeps at most S - s micro-batches
in flight on stage s, GPipe all M.

    python -m pytest -q tests/parallel/pipeline/test_schedules.py
"""

import pytest

from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.spmd.loops import slot_program


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (3, 7), (4, 4)])
def test_bubble_of_both_schedules_equals_theory(stages, micro):
    for name in ("gpipe", "1f1b"):
        table = schedules.table(schedules.build(name, stages, micro))
        assert schedules.bubble_fraction(table) == pytest.approx((stages - 1) / (micro + stages - 1))
    assert schedules.peak_in_flight(schedules.table(schedules.build("1f1b", stages, micro))) == \
        [min(stages - s, micro) for s in range(stages)]
    assert schedules.peak_in_flight(schedules.table(schedules.build("gpipe", stages, micro))) == [micro] * stages


@pytest.mark.parametrize("stages", [2, 4, 6, 8])
def test_gems_bubble_is_below_gpipes_at_the_same_m(stages):
    for micro in range(2, 4 * stages + 1, 2):
        table = schedules.table(schedules.build("gems", stages, micro))
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
    schedule = schedules.build(name, stages, micro)
    table = schedules.table(schedule)
    ops, recv, size = slot_program(schedule)
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


@pytest.mark.parametrize("name", sorted(schedules.GENERATORS))
def test_every_schedule_lowers_to_messages_that_cannot_deadlock(name):
    """Each device's actions, sends and receives: replayed with sends that wait for their
    receive (MPI's answered messages) and with sends that never wait (channels, TCP), every
    device finishes and each pair of devices sees its messages in the order sent."""
    from jaxpar.parallel.pipeline.schedules import messages

    for stages in (2, 3, 4, 6):
        for micro in (1, 2, 4, 7, 8):
            if name == "gems" and (stages % 2 or micro % 2):
                continue
            schedule = schedules.build(name, stages, micro)
            messages.check_program(schedule, schedules.lower(schedule), buffered=False)
            for early in (False, True):
                program = schedules.lower(schedule, buffered=True, sends_first=True, early_last_gradients=early)
                messages.check_program(schedule, program, buffered=True)
                sends = sum(isinstance(op, schedules.Send) for ops in program for op in ops)
                assert sends == sum(isinstance(op, schedules.Recv) for ops in program for op in ops)
                # every micro-batch crosses every boundary up and back once (per replica copy)
                assert sends == 2 * micro * (stages - 1)


def test_a_pair_receiving_out_of_order_is_refused():
    from jaxpar.parallel.pipeline.schedules import messages

    schedule = schedules.build("gpipe", 2, 2)
    program = [list(ops) for ops in schedules.lower(schedule)]
    recvs = [i for i, op in enumerate(program[1]) if isinstance(op, schedules.Recv)]
    program[1][recvs[0]], program[1][recvs[1]] = program[1][recvs[1]], program[1][recvs[0]]
    with pytest.raises(schedules.ScheduleError, match="order"):
        messages.check_program(schedule, tuple(map(tuple, program)), buffered=True)
