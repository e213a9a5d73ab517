"""Which of tests/mpi cross the emulated hosts (tests/experiments/infra/test_cluster.py), and
whether they can here; the marks the tests on emulated hosts share (`needs_root`, `needs_mpi`).

Where they can (root, network namespaces), the one-host launch of tests/mpi
(tests/test_mpi_launch.py) leaves these to the two-host one, so that CI runs each once."""

import subprocess

import pytest

from experiments.infra import cluster
from experiments.points.mpi import mpiexec

CROSS_HOST = ["tests/mpi/test_jax_distributed.py::test_world_size_is_what_was_launched",
              "tests/mpi/test_jax_distributed.py::test_ranks_are_on_the_hosts_launched",
              "tests/mpi/test_mpi_common.py::test_equivalent_to_single",  # every MPI strategy
              # the data-parallel ones on one jax.distributed mesh (dp-auto, dp-shard-map,
              # fsdp, local-sgd), then tensor, tensor-auto, both pipeline schedules, hybrid,
              # layer-split, dp-pmap and mpi-pipeline's two schedules
              "tests/mpi/test_jax_distributed.py::test_equivalent_to_single",
              "tests/mpi/test_model_parallel.py::test_equivalent_to_single",
              "tests/mpi/test_wire_bytes.py"]  # bytes on the wire per step = theory


def why_no_hosts() -> str | None:
    """Why emulated hosts cannot be made here, or None."""
    if (why := cluster.missing()) is not None:
        return why
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot make namespaces: {probe.stderr.strip()}"


WHY_NO_HOSTS = why_no_hosts()
needs_root = pytest.mark.skipif(WHY_NO_HOSTS is not None, reason=str(WHY_NO_HOSTS))
needs_mpi = pytest.mark.skipif(not mpiexec().exists(), reason="needs the `mpi` extra (make test installs it)")
