"""docs/strategies.md's worked example of adding a schedule, run as written: the schedule it
defines validates, has GPipe's bubble, lowers to sends and receives; registered, it runs
through both pipeline runtimes and equals `single`; a list that cannot run is refused.

    python -m pytest -q tests/parallel/pipeline/test_schedule_doc.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import equivalence as eq
from jaxpar import validate
from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.schedules import BACKWARD, FORWARD, Action, Schedule, ScheduleError, generators

ROOT = Path(__file__).resolve().parents[3]
MARKER = "<!-- example: run by tests/parallel/pipeline/test_schedule_doc.py -->"
STACK = dict(model="stack-mlp", width=32, depth=4, batch_size=32, lr=0.01)


def example() -> dict:
    """The names the python block after MARKER in docs/strategies.md defines, once run."""
    text = (ROOT / "docs" / "strategies.md").read_text()
    found = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/strategies.md has no ```python block after {MARKER}"
    names: dict = {}
    exec(compile(found.group(1), "docs/strategies.md", "exec"), names)  # noqa: S102 (our own docs)
    return names


@pytest.mark.parametrize("impl", ["spmd", "mpmd"])
def test_the_documented_schedule_runs_in_both_runtimes_and_equals_single(impl, monkeypatch):
    gpipe_lifo = example()["gpipe_lifo"]
    monkeypatch.setitem(generators.GENERATORS, "gpipe-lifo", gpipe_lifo)
    monkeypatch.setitem(validate.CHOICES, "schedule", (*validate.CHOICES["schedule"], "gpipe-lifo"))
    cfg = eq.config(strategy="pipeline", mesh="stage=2", microbatches=4, schedule="gpipe-lifo",
                    pipeline_impl=impl, **STACK)
    got = eq.run(cfg, steps=3, devices=2)
    eq.assert_equivalent(eq.run(eq.config(**STACK), steps=3), got)
    assert got.strategy.describe()["schedule"] == "gpipe-lifo"


def test_a_list_that_waits_forever_is_refused():
    M = 2
    backward_first = tuple(tuple([Action(BACKWARD, m, s) for m in range(M)] + [Action(FORWARD, m, s) for m in range(M)])
                           for s in range(2))
    with pytest.raises(ScheduleError, match="deadlocks"):
        schedules.check(Schedule("broken", M, generators.straight(2), backward_first))
    missing = tuple(tuple(a for a in lst if a.microbatch == 0) for lst in generators.fill_drain(2, M).lists)
    with pytest.raises(ScheduleError, match="missing"):
        schedules.check(Schedule("short", M, generators.straight(2), missing))
