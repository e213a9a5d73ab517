"""mpi4jax strategies against `single` on the same global batch (DESIGN.md's protocol), at any
communicator size: every rank computes the `single` reference in-process on the full batch.

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi
"""

import os

import jax
import pytest

import equivalence as eq


def test_world_size_is_what_was_launched(comm):
    """A world of size 1 would pass every equivalence test trivially."""
    expected = int(os.environ.get("JAXPAR_EXPECT_RANKS") or os.environ.get("PMI_SIZE")
                   or os.environ.get("OMPI_COMM_WORLD_SIZE") or 0)
    assert expected >= 2, "launch with mpiexec -n N (N >= 2), or set JAXPAR_EXPECT_RANKS"
    assert comm.Get_size() == expected


def reference(size, monkeypatch):
    """`single` on the full global batch, in this process, on this process's own device."""
    monkeypatch.setattr(jax, "devices", jax.local_devices)
    trace = eq.run(eq.config(batch_size=16 * size, strategy="single"), steps=5)
    monkeypatch.undo()
    return trace


@pytest.mark.parametrize("strategy", ["mpi-allreduce", "mpi-param-server", "dp-auto", "dp-shard-map",
                                      "fsdp", "local-sgd"])
def test_equivalent_to_single(comm, strategy, monkeypatch):
    size = comm.Get_size()
    ref = reference(size, monkeypatch)
    got = eq.run(eq.config(batch_size=16 * size, strategy=strategy), steps=5)
    eq.assert_equivalent(ref, got)
    if not strategy.startswith("mpi-"):
        assert jax.process_count() == size and got.strategy.describe()["devices"] == size
    else:
        assert got.strategy.describe()["processes"] == size
    assert got.strategy.trace_counts["step"] == 1
