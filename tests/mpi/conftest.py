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


def _single_on_rank_zero(comm, cfg, steps: int) -> eq.Trace:
    """`single`'s trace of `cfg` over `steps` steps, run on rank 0 alone, on its own device, and
    sent to every rank: one process's program on the global batches every rank draws alike,
    which the other ranks would only repeat (each rank compiled and ran each reference of the
    world). A failure there fails the test on every rank, rank 0 with its traceback (none
    waits for what never comes)."""
    payload, failed = None, None
    if comm.Get_rank() == 0:
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(jax, "devices", jax.local_devices)
                trace = eq.run(cfg, steps=steps)
            payload = (trace.grads, trace.params, trace.losses)
        except Exception as error:  # noqa: BLE001  (raised below, once every rank knows)
            failed, payload = error, f"`single` failed on rank 0: {error!r}"
    payload = comm.bcast(payload, root=0)
    if failed is not None:
        raise failed
    if isinstance(payload, str):
        pytest.fail(payload)
    return eq.Trace(*payload, strategy=None, state=None)


@pytest.fixture(scope="session")
def single(comm):
    """single(cfg, steps): `single`'s trace on `cfg`'s global batches (`_single_on_rank_zero`),
    once per session for each configuration: what every rank compares its strategy with."""
    done = {}

    def trace(cfg, steps: int) -> eq.Trace:
        if (cfg, steps) not in done:
            done[cfg, steps] = _single_on_rank_zero(comm, cfg, steps)
        return done[cfg, steps]
    return trace


@pytest.fixture(scope="session")
def reference(comm, single):
    """`single` on the full global batch (16 rows per rank)."""
    return single(eq.config(batch_size=16 * comm.Get_size(), strategy="single"), 5)


# The model-parallel runs: a stack-mlp whose 4 blocks and width 32 split over 2 or 4 stages or
# tensor shards; lr 0.01 (the stack diverges at the protocol's 0.1).
STACK = dict(model="stack-mlp", width=32, depth=6, lr=0.01)  # 8 layers: 2 stages on each of 4 ranks


@pytest.fixture(scope="session")
def stack_config(comm):
    """eq.config for the stack-mlp on 16 rows per rank, plus `options`."""
    return lambda **options: eq.config(batch_size=16 * comm.Get_size(), **STACK, **options)


@pytest.fixture(scope="session")
def stack_reference(stack_config, single):
    """`single` on the stack-mlp's global batches."""
    return single(stack_config(strategy="single"), 5)


# One global JAX runtime over the ranks (short timeouts), so dp-auto runs on a 2-process mesh;
# the mpi4jax strategies keep to their own process's device.
distributed.setup("mpi", single_threaded=False)
