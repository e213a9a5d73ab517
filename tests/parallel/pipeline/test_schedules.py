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
        for micro in (1, 2, 4, 7, 8, 12):
            try:
                schedule = schedules.build(name, stages, micro)
            except schedules.ScheduleError as e:  # its rules (even M, rounds, M >= stages) named
                assert "--microbatches" in str(e) or "--mesh" in str(e) or name == "gems", e
                continue
            messages.check_program(schedule, schedules.lower(schedule), buffered=False)
            for early, late in ((False, False), (True, False), (True, True)):
                program = schedules.lower(schedule, buffered=True, sends_first=True, early_last_gradients=early,
                                          late_receives=late)
                messages.check_program(schedule, program, buffered=True)
                if late:
                    _each_receive_just_before_its_taker_or_a_later_receive(schedule, program)
                sends = sum(isinstance(op, schedules.Send) for ops in program for op in ops)
                assert sends == sum(isinstance(op, schedules.Recv) for ops in program for op in ops)
                # every micro-batch crosses every boundary between devices up and back once
                crossing = sum(schedule.device_of(k) != schedule.device_of(k + 1) for k in range(schedule.stages - 1))
                assert sends == 2 * micro * crossing


def _each_receive_just_before_its_taker_or_a_later_receive(schedule, program):
    """`late_receives`: a device blocks on a message only when the next thing it runs needs
    it (or needs one the same link delivers after it)."""
    from jaxpar.parallel.pipeline.schedules import messages

    for ops in program:
        for i, op in enumerate(ops):
            if isinstance(op, schedules.Recv):
                rest = ops[i + 1:]
                nxt = next(o for o in rest if not isinstance(o, schedules.Recv))
                takers = [messages.taker(r.message, schedule) for r in rest[:rest.index(nxt)]]
                assert messages.taker(op.message, schedule) == nxt or nxt in takers, (op, nxt)


def test_a_pair_receiving_out_of_order_is_refused():
    from jaxpar.parallel.pipeline.schedules import messages

    schedule = schedules.build("gpipe", 2, 2)
    program = [list(ops) for ops in schedules.lower(schedule)]
    recvs = [i for i, op in enumerate(program[1]) if isinstance(op, schedules.Recv)]
    program[1][recvs[0]], program[1][recvs[1]] = program[1][recvs[1]], program[1][recvs[0]]
    with pytest.raises(schedules.ScheduleError, match="order"):
        messages.check_program(schedule, tuple(map(tuple, program)), buffered=True)


@pytest.mark.parametrize("name,stages,micro,bubble", [
    ("1f1b", 2, 4, 1 / 5), ("interleaved-1f1b", 2, 4, 1 / 9), ("zb-h1", 2, 4, 1 / 13), ("zbv", 2, 4, 1 / 25)])
def test_each_schedule_bubble_from_its_own_lists(name, stages, micro, bubble):
    """Replayed with a backward twice a forward (input and weight gradients one each):
    interleaving two stages per device halves 1F1B's bubble, zero bubble (ZB-H1) leaves about
    a third of it at 1F1B's activation memory, ZBV's V placement nearly none."""
    schedule = schedules.build(name, stages, micro)
    assert schedules.timed_bubble(schedule) == pytest.approx(bubble)
    if name == "zb-h1":
        assert max(schedules.peak_in_flight(schedules.table(schedule))) <= stages  # 1F1B's memory


def test_measured_times_move_the_bubble():
    """The bubble from measured times: with weight gradients free, ZB-H1's is 1F1B's
    (nothing to fill the bubble with); with them as long as a forward, a third of it."""
    zb, one = schedules.build("zb-h1", 2, 4), schedules.build("1f1b", 2, 4)
    free = {"F": 1.0, "I": 2.0, "W": 0.0, "B": 2.0}
    assert schedules.timed_bubble(zb, free) == pytest.approx(schedules.timed_bubble(one, free))
    assert schedules.timed_bubble(zb) < 0.5 * schedules.timed_bubble(one)


def test_the_bubble_as_a_time_is_the_fraction_of_the_replayed_span():
    """`timed_idle`: what a device idles on average, in the measured times' unit; GPipe on 2
    devices, forwards 1 and backwards 2 (s): each device works 12 of a span of 15."""
    gpipe = schedules.build("gpipe", 2, 4)
    times = {"F": 1.0, "B": 2.0}
    assert schedules.timed_idle(gpipe, times) == pytest.approx(3.0)
    assert schedules.timed_bubble(gpipe, times) == pytest.approx(3.0 / 15)


def test_a_message_latency_and_each_actions_own_time_lengthen_the_replay():
    """`latency`: what one device hands another arrives that much later (1F1B, 2 devices, unit
    times: each of the 2M messages on the path that waits for it); a time given for an action
    itself counts before its kind's."""
    one = schedules.build("1f1b", 2, 4)
    unit = schedules.timing.replay(one)[0]
    assert schedules.timing.replay(one, latency=0.5)[0] > unit
    assert schedules.timing.replay(one, latency=0.5)[1] == schedules.timing.replay(one)[1]  # work unchanged
    first = one.lists[0][0]
    assert schedules.timing.replay(one, {first: 3.0, "F": 1.0, "B": 2.0})[0] == unit + 2.0


def test_sent_early_lists_the_last_stages_gradients_where_the_runtime_sends_them():
    """GPipe whose last stage computes each gradient with its forward and sends it at once
    (`lower(early_last_gradients=True)`): replayed so, the first stage's backwards start
    while the last stage still computes; where gradients cannot leave early (two stages a
    device: ZBV), the schedule is its own."""
    gpipe = schedules.build("gpipe", 2, 4)
    early = schedules.sent_early(gpipe)
    assert [a.kind for a in early.lists[1]] == ["F", "B"] * 4
    times = {"F": 1.0, ("B", 1): 0.0, "B": 2.0}
    assert schedules.timing.replay(early, times)[0] < schedules.timing.replay(gpipe, times)[0]
    zbv = schedules.build("zbv", 2, 4)
    assert schedules.sent_early(zbv) is zbv


@pytest.mark.parametrize("name,virtual", [("zbv", 3), ("dualpipev", 1), ("gpipe", 2)])
def test_a_fixed_placement_refuses_other_virtual_stages(name, virtual):
    with pytest.raises(schedules.ScheduleError, match="--virtual-stages"):
        schedules.build(name, 2, 8, virtual)
