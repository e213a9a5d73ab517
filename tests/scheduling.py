"""How `make test`'s two workers share the files (`pytest -n 2 --dist loadfile`): each file
is one unit of work, as loadfile makes it, and

  - the longest files go first, so that the run does not end with one worker idle while the
    other runs a long file it took last (xdist's own order is by number of tests, and the
    longest files here hold few tests: they launch MPI ranks, emulated hosts, fresh
    processes);
  - the files that use machine-wide state (one emulated cluster, one SLURM: they hold
    `conftest.machine_wide` and take turns) are one unit, so that one worker never waits
    for the other to let go of it.

Only the order changes: every test runs, as it would alone. The seconds are worker time per
file in a full run on 2 cores (2026-11-28, e5d463a); a stale one only costs speed.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

MACHINE_WIDE = ("tests/experiments/infra/test_cluster.py", "tests/experiments/infra/test_slurm.py",
                "tests/experiments/studies/test_network_study.py")

SECONDS = {  # per unit of work
    "machine-wide": 354, "tests/test_mpi_launch.py": 308, "tests/test_mpi_worlds.py": 264,
    "tests/parallel/pipeline/test_pipeline.py": 263, "tests/test_checkpoint.py": 147,
    "tests/experiments/studies/test_pipeline_study.py": 131,
    "tests/parallel/pipeline/test_every_schedule.py": 105,
    "tests/experiments/test_cli_properties.py": 50, "tests/experiments/studies/test_strategies_study.py": 86,
    "tests/parallel/tensor/test_tensor.py": 83, "tests/experiments/studies/test_time_to_accuracy.py": 78,
    "tests/parallel/pipeline/test_layer_split.py": 66, "tests/test_install_light.py": 57,
    "tests/experiments/publish/test_figures.py": 55, "tests/experiments/studies/test_rank_scaling.py": 53,
    "tests/parallel/pipeline/test_gems.py": 50, "tests/parallel/data_parallel/test_dp_common.py": 49,
    "tests/experiments/demo/test_demo_browser.py": 49, "tests/parallel/pipeline/test_hybrid.py": 42,
}


def unit(path: str) -> str:
    """The unit of work a test file belongs to."""
    return "machine-wide" if path in MACHINE_WIDE else path


class LongestFirst(LoadFileScheduling):
    """loadfile with the units above, handed out in the collection's order (sorted longest
    first by `pytest_collection_modifyitems`)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # keep the order sorted below

    def _split_scope(self, nodeid: str) -> str:
        return unit(super()._split_scope(nodeid))


def sort_longest_first(items) -> None:
    """Items of the longest units first; within a unit, and among units alike, as collected.
    A file that holds `machine_wide` but is not in MACHINE_WIDE is a usage error: the other
    worker would wait on it."""
    unlisted = sorted({_file(item) for item in items
                       if "machine_wide" in getattr(item, "fixturenames", ()) and _file(item) not in MACHINE_WIDE})
    if unlisted:
        raise pytest.UsageError(f"add {', '.join(unlisted)} to MACHINE_WIDE in tests/scheduling.py "
                                f"(it uses the machine_wide fixture)")
    items.sort(key=lambda item: -SECONDS.get(unit(_file(item)), 5))


def _file(item) -> str:
    return item.nodeid.split("::", 1)[0]
