"""The model-parallel equivalence tests (tests/mpi/test_model_parallel.py) on worlds other than
the suite's 2 ranks of one device: 4 ranks, and 2 ranks of 2 devices each. A file of their own,
so that pytest-xdist runs them beside the other MPI launches (tests/test_mpi_launch.py).

    python -m pytest -q tests/test_mpi_worlds.py
"""

import subprocess

import pytest

from test_mpi_launch import MPIEXEC, RANK_PYTEST, ROOT, mpi_env, needs_mpiexec


@needs_mpiexec
@pytest.mark.parametrize("ranks,devices", [(4, 1), (2, 2)])
def test_model_parallel_equals_single_on_more_ranks_and_devices(ranks, devices):
    """tests/mpi/test_model_parallel.py on 4 ranks (stages and shards that follow the world:
    every pipeline under its schedules, mpi-pipeline's bytes and bubble, tensor) and on 2
    ranks of 2 devices each (what a process's second device changes: tensor and hybrid within
    a process, stages across; mpi-pipeline, a stage per rank whatever its devices, is left to
    the other worlds); the world size asserted."""
    env = mpi_env(JAXPAR_EXPECT_RANKS=str(ranks), JAXPAR_MPI_DEVICES=str(devices))
    only = ["-k", "not mpi-pipeline and not mpi_pipeline"] if devices > 1 else []
    proc = subprocess.run(
        ["timeout", "-s", "KILL", "500", str(MPIEXEC), "-n", str(ranks), *RANK_PYTEST, *only,
         "tests/mpi/test_model_parallel.py",
         "tests/mpi/test_jax_distributed.py::test_world_size_is_what_was_launched"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " failed" not in proc.stdout and " passed" in proc.stdout
