"""MPI test set-up: one CPU device per rank, one jax.distributed runtime, the `single` reference.

Overrides tests/conftest.py's 8 devices, which loads first (the backend has not started yet,
so the later setting wins).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi
"""


import jax

jax.config.update("jax_num_cpu_devices", 1)

import pytest  # noqa: E402

import equivalence as eq  # noqa: E402
from jaxpar import distributed  # noqa: E402

MPI = pytest.importorskip("mpi4py.MPI", reason="needs the `mpi` extra (make test installs it)")


@pytest.fixture(scope="session")
def comm():
    return MPI.COMM_WORLD


@pytest.fixture
def reference(comm, monkeypatch):
    """`single` on the full global batch (16 rows per rank), in this process, on this
    process's own device: what every rank compares its strategy with."""
    monkeypatch.setattr(jax, "devices", jax.local_devices)
    trace = eq.run(eq.config(batch_size=16 * comm.Get_size(), strategy="single"), steps=5)
    monkeypatch.undo()
    return trace


# One global JAX runtime over the ranks (short timeouts), so dp-auto runs on a 2-process mesh;
# the mpi4jax strategies keep to their own process's device.
distributed.setup("mpi", single_threaded=False)
