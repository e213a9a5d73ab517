"""MPI test set-up: one CPU device per rank (JAXPAR_MPI_DEVICES for more), one jax.distributed
runtime, the `single` references.

Overrides tests/conftest.py's 8 devices, which loads first (the backend has not started yet,
so the later setting wins).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi
"""


import os

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXPAR_MPI_DEVICES", "1")))

import pytest  # noqa: E402

import equivalence as eq  # noqa: E402
from jaxpar.runtime import distributed  # noqa: E402

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


# The model-parallel runs: a stack-mlp whose 4 blocks and width 32 split over 2 or 4 stages or
# tensor shards; lr 0.01 (the stack diverges at the protocol's 0.1).
STACK = dict(model="stack-mlp", width=32, depth=6, lr=0.01)  # 8 layers: 2 stages on each of 4 ranks


@pytest.fixture(scope="session")
def stack_config(comm):
    """eq.config for the stack-mlp on 16 rows per rank, plus `options`."""
    return lambda **options: eq.config(batch_size=16 * comm.Get_size(), **STACK, **options)


@pytest.fixture(scope="session")
def stack_reference(stack_config):
    """`single` on the stack-mlp's global batches, in this process on its own first device."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "devices", jax.local_devices)
        return eq.run(stack_config(strategy="single"), steps=5)


# One global JAX runtime over the ranks (short timeouts), so dp-auto runs on a 2-process mesh;
# the mpi4jax strategies keep to their own process's device.
distributed.setup("mpi", single_threaded=False)
