"""tests/scheduling.py, the order in which `make test`'s two workers take the files: a unit
that mostly waits is kept from a worker while the other holds one, and every unit it names
is one the suite has (a renamed file would silently drop out of the rule)."""

from conftest import ROOT

import scheduling


def test_a_waiting_unit_is_kept_from_a_worker_while_the_other_holds_one():
    queue = ["machine-wide", "tests/test_mpi_launch.py", "tests/test_mpi_worlds.py", "tests/test_step.py"]
    assert scheduling.next_unit(queue, others_wait=False) == "machine-wide"
    assert scheduling.next_unit(queue, others_wait=True) == "tests/test_mpi_worlds.py"
    # only waiting units left: the worker takes one rather than idle
    assert scheduling.next_unit(queue[:2], others_wait=True) == "machine-wide"


def test_the_units_named_are_the_suites():
    assert scheduling.WAITING <= set(scheduling.SECONDS)
    for unit in scheduling.SECONDS:
        assert unit == "machine-wide" or (ROOT / unit).is_file(), unit
    for path in scheduling.MACHINE_WIDE:
        assert (ROOT / path).is_file(), path
