"""Every MPI strategy (read from the registry: `uses_mpi`) equals `single` at any
communicator size.

Every rank compares with `single` (run by rank 0 on its own device, sent to all) on the full
global batch (the equivalence protocol) and checks the world it ran in; the per-strategy files
check the bytes.

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_mpi_common.py
"""

import pytest

import equivalence as eq
from jaxpar.parallel import STRATEGIES


@pytest.mark.parametrize("name", [n for n, cls in STRATEGIES.items() if cls.uses_mpi])
def test_equivalent_to_single(comm, reference, name):
    got = eq.run(eq.config(batch_size=16 * comm.Get_size(), strategy=name), steps=5)
    eq.assert_equivalent(reference, got)
    assert got.strategy.describe()["processes"] == comm.Get_size()
    assert got.strategy.trace_counts["step"] == 1
