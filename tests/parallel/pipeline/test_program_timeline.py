"""A step run as one program per device, stamped inside its programs (`host.timeline`): what
the stamps say, from stamps made by running a lowered schedule with known times."""

import numpy as np
import pytest

from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.device_program import stamp_marks
from jaxpar.parallel.pipeline.host import timeline
from jaxpar.parallel.pipeline.schedules import Action, Recv, Send

LATENCY_MS = 0.05


def _run(lowered, took, latency=LATENCY_MS, steps=3, between=1.0):
    """Stamps (ms[step, device, j]) of `lowered` run with each action taking `took(action)` ms,
    each op after the one before on its device, a receive until its message's send plus
    `latency`; the steps apart by `between` ms."""
    ms = np.full((steps, len(lowered), max(len(stamp_marks(o)) for o in lowered)), np.nan, np.float32)
    origin = 0.0
    for k in range(steps):
        clock, position, sent = [origin] * len(lowered), [0] * len(lowered), {}
        column = [0] * len(lowered)
        while any(p < len(o) for p, o in zip(position, lowered)):
            moved = False
            for d, ops in enumerate(lowered):
                while position[d] < len(ops):
                    op = ops[position[d]]
                    if isinstance(op, Send):
                        sent[op.message] = clock[d]
                    elif isinstance(op, Recv):
                        if op.message not in sent:
                            break
                        start, clock[d] = clock[d], max(clock[d], sent[op.message] + latency)
                        ms[k, d, column[d]:column[d] + 2] = start, clock[d]
                        column[d] += 2
                    else:
                        start, clock[d] = clock[d], clock[d] + took(op)
                        ms[k, d, column[d]:column[d] + 2] = start, clock[d]
                        column[d] += 2
                    position[d] += 1
                    moved = True
            assert moved
        origin = max(clock) + between
    return ms


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_the_stamped_bubble_is_the_tables_with_the_same_times_and_latency(name):
    """A step whose actions took the times the table is replayed with, and whose messages
    each came `latency` after they were sent, idles as the table says; the summary finds the
    latency, each kind's time, every action once in the middle step's events, and each
    device's wait in its receives."""
    schedule = schedules.build(name, 2, 4)
    lowered = schedules.lower(schedule, buffered=True, sends_first=True, early_last_gradients=True,
                              late_receives=True)
    last = schedule.stages - 1
    times = {"F": 1.0, "B": 2.0, "I": 1.2, "W": 0.8}

    def took(a: Action) -> float:  # the last stage's forward, loss and (input) gradient at once
        return {"F": 3.0, "W": 0.8}.get(a.kind, 0.0) if a.stage == last else times[a.kind]

    replayed = schedules.sent_early(schedule)
    summary = timeline.stamped_summary(schedule, lowered, _run(lowered, took), True, replayed)
    assert summary["latency_ms"] == pytest.approx(LATENCY_MS, abs=1e-3)
    expected = schedules.timed_idle(replayed, {a: took(a) for lst in schedule.lists for a in lst}, LATENCY_MS)
    assert summary["idle_ms"] == pytest.approx(expected, rel=1e-3)
    assert summary["idle_ms_timed"] == pytest.approx(expected, rel=1e-3)
    assert summary["action_ms"]["F0"] == pytest.approx(1.0, rel=1e-4)
    done = [(e["kind"], e["microbatch"], e["stage"]) for e in summary["events"] if e["kind"] != "recv"]
    assert sorted(done) == sorted((a.kind, a.microbatch, a.stage) for lst in schedule.lists for a in lst)
    assert all(w >= 0 for w in summary["receive_ms"]) and max(summary["receive_ms"]) > 0


def test_stamps_out_of_program_order_are_refused():
    """Stamps that are not whole steps of the program's marks in order are an error, not a
    timeline."""
    schedule = schedules.build("1f1b", 2, 2)
    lowered = schedules.lower(schedule, buffered=True, sends_first=True, early_last_gradients=True,
                              late_receives=True)
    marks = stamp_marks(lowered[0])
    stamps = np.array([[timeline.device_mark(0, m), i] for i, m in enumerate(reversed(marks))], np.int64)
    with pytest.raises(RuntimeError, match="program order"):
        timeline.program_steps(lowered, [0], stamps)
    ordered = np.array([[timeline.device_mark(0, m), i] for i, m in enumerate(marks * 2)], np.int64)
    assert timeline.program_steps(lowered, [0], ordered)[0].shape == (2, len(marks))
