"""How `make test`'s two workers share the files (`pytest -n 2 --dist loadfile`): each file
is one unit of work, as loadfile makes it, and

  - the longest files go first, so that the run does not end with one worker idle while the
    other runs a long file it took last (xdist's own order is by number of tests, and the
    longest files here hold few tests: they launch MPI ranks, emulated hosts, fresh
    processes);
  - the files that use machine-wide state (one emulated cluster, one SLURM: they hold
    `conftest.machine_wide` and take turns) are one unit, so that one worker never waits
    for the other to let go of it;
  - a unit that mostly waits (fault bounds, SLURM's jobs, MPI ranks that wait on each other:
    under 0.75 CPU seconds per second) is not handed to one worker while the other runs or
    holds one, unless nothing else is left: beside a busy unit its waits cost little. Run
    side by side, the cluster's faults and the 2-rank MPI suite kept the 2 cores 56% busy
    for the first three minutes of a run (35-80% per half minute), the next nine minutes 90%.

Only the order changes: every test runs, as it would alone. The seconds are worker time per
file in a full run on 2 cores (2026-11-29, 3566bf4); a stale one only costs speed.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling

MACHINE_WIDE = ("tests/experiments/infra/test_cluster.py", "tests/experiments/infra/test_slurm.py",
                "tests/experiments/studies/test_network_study.py")

SECONDS = {  # per unit of work
    "machine-wide": 304, "tests/test_mpi_launch.py": 201, "tests/test_mpi_worlds.py": 115,
    "tests/parallel/pipeline/test_pipeline.py": 96, "tests/experiments/studies/test_pipeline_study.py": 70,
    "tests/test_checkpoint.py": 65, "tests/parallel/pipeline/test_every_schedule.py": 58,
    "tests/parallel/tensor/test_tensor.py": 48, "tests/experiments/studies/test_strategies_study.py": 43,
    "tests/test_install_light.py": 40, "tests/experiments/demo/test_demo_browser.py": 39,
    "tests/experiments/studies/test_rank_scaling.py": 34, "tests/experiments/studies/test_time_to_accuracy.py": 33,
    "tests/experiments/publish/test_figures.py": 29, "tests/parallel/pipeline/test_gems.py": 27,
    "tests/parallel/pipeline/test_layer_split.py": 26, "tests/runtime/test_watchdog_across_ranks.py": 24,
    "tests/parallel/pipeline/test_hybrid.py": 23, "tests/parallel/data_parallel/test_dp_common.py": 18,
    "tests/runtime/test_watchdog.py": 15,
}
# The units that mostly wait (CPU seconds per second in that run: 0.37, 0.70, ~0, 0.38).
WAITING = {"machine-wide", "tests/test_mpi_launch.py", "tests/runtime/test_watchdog_across_ranks.py",
           "tests/runtime/test_watchdog.py"}


def unit(path: str) -> str:
    """The unit of work a test file belongs to."""
    return "machine-wide" if path in MACHINE_WIDE else path


class LongestFirst(LoadFileScheduling):
    """loadfile with the units above, handed out in the collection's order (sorted longest
    first by `pytest_collection_modifyitems`), a waiting unit kept from a worker while
    another holds one."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # keep the order sorted below

    def _split_scope(self, nodeid: str) -> str:
        return unit(super()._split_scope(nodeid))

    def _assign_work_unit(self, node) -> None:
        self.workqueue.move_to_end(next_unit(list(self.workqueue), self._others_wait(node)), last=False)
        super()._assign_work_unit(node)

    def _others_wait(self, node) -> bool:
        """Whether another worker runs, or holds next, a unit that mostly waits."""
        return any(scope in WAITING and not all(done.values())
                   for other, held in self.assigned_work.items() if other is not node
                   for scope, done in held.items())


def next_unit(queue: list[str], others_wait: bool) -> str:
    """The unit to hand a worker from `queue` (longest first): the first, or while another
    worker waits the first that does not, if any."""
    if others_wait:
        return next((u for u in queue if u not in WAITING), queue[0])
    return queue[0]


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
