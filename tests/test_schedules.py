"""Pipeline schedules (`jaxpar/parallel/schedules.py`): bubble and micro-batches in flight.

Both GPipe and 1F1B idle (S-1)/(M+S-1) of the slots; 1F1B keeps at most S - s micro-batches
in flight on stage s, GPipe all M.

    python -m pytest -q tests/test_schedules.py
"""

import pytest

from jaxpar.parallel import schedules


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (3, 7), (4, 4)])
def test_bubble_of_both_schedules_equals_theory(stages, micro):
    for name in ("gpipe", "1f1b"):
        table = schedules.schedule(name, stages, micro)
        assert schedules.bubble_fraction(table) == pytest.approx((stages - 1) / (micro + stages - 1))
    assert schedules.peak_in_flight(schedules.schedule("1f1b", stages, micro)) == \
        [min(stages - s, micro) for s in range(stages)]
    assert schedules.peak_in_flight(schedules.schedule("gpipe", stages, micro)) == [micro] * stages
