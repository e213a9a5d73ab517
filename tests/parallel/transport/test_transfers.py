"""The transfer servers `processes.move` uses across processes on CPU (`jaxpar.parallel.transport.transfers`):
bound where the other processes reach them, and serving an array offered to a pull. Moves between
real processes are tested under mpiexec (tests/mpi/test_jax_distributed.py) and across emulated
hosts (tests/experiments/infra/test_cluster.py).

    python -m pytest -q tests/parallel/transport/test_transfers.py
"""

import jax
import numpy as np
import pytest
from jax._src import distributed

from jaxpar.parallel.transport import addresses, transfers


@pytest.mark.parametrize("coordinator", ["127.0.0.1:4321", "localhost:4321", None])
def test_the_server_listens_on_the_route_to_the_coordinator(monkeypatch, coordinator):
    monkeypatch.setattr(distributed.global_state, "coordinator_address", coordinator)
    assert addresses.local_address() == "127.0.0.1"


def test_an_offered_array_is_pulled_whole():
    """Through this process's own server: the address it gives is one a peer can connect to
    (the library's default, '[::]:0', gives one that is not)."""
    server = transfers._server()
    value = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    device = jax.devices()[0]
    server.await_pull(10**9, [jax.device_put(value, device)])
    spec = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    (got,) = server.connect(server.address()).pull(10**9, [spec])
    np.testing.assert_array_equal(np.asarray(got), value)
