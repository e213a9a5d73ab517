"""MPI test set-up: ONE CPU device per rank (overrides tests/conftest.py's 8, which loads
first; the backend has not started yet, so the later setting wins).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi
"""


import jax

jax.config.update("jax_num_cpu_devices", 1)

import pytest  # noqa: E402

from jaxpar import distributed  # noqa: E402

MPI = pytest.importorskip("mpi4py.MPI", reason="needs the `mpi` extra (make test installs it)")


@pytest.fixture(scope="session")
def comm():
    return MPI.COMM_WORLD
# One global JAX runtime over the ranks (short timeouts), so dp-auto runs on a 2-process mesh;
# the mpi4jax strategies keep to their own process's device.
distributed.setup("mpi", single_threaded=False)
