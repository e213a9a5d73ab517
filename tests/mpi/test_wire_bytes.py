"""Bytes on the wire per step, read from the network interface's counters, equal each MPI
strategy's theory within 10% (headers aside) when the ranks sit on different emulated hosts.

Run by tests/experiments/infra/test_cluster.py over `experiments/infra/cluster.py`'s hosts (JAXPAR_EXPECT_HOSTS=2);
skipped on one host, where the ranks talk through shared memory. Counted on each rank's eth0:
transmitted bytes minus 66 bytes per transmitted packet (Ethernet 14 + IPv4 20 + TCP with
timestamps 32), over WIRE_STEPS warm steps between two barriers; the busiest rank's payload
per step is compared with the strategy's `theory()['busiest_rank_sent']`.

    python -m experiments cluster mpiexec -n 2 -- python -m mpi4py -m pytest -q tests/mpi/test_wire_bytes.py
"""

import os
from pathlib import Path

import pytest

import equivalence as eq

HEADER = 14 + 20 + 32
WIRE_STEPS = 10
COUNTERS = Path("/sys/class/net/eth0/statistics")
pytestmark = pytest.mark.skipif(
    int(os.environ.get("JAXPAR_EXPECT_HOSTS", "1")) < 2 or not COUNTERS.exists(),
    reason="needs ranks on different hosts: python -m experiments cluster up (as root), then "
           "JAXPAR_EXPECT_HOSTS=2 python -m experiments cluster mpiexec -n 2 -- ... pytest")


def payload_sent() -> int:
    return (int((COUNTERS / "tx_bytes").read_text())
            - HEADER * int((COUNTERS / "tx_packets").read_text()))


@pytest.mark.parametrize("name,options", [("mpi-allreduce", {}), ("mpi-param-server", {}),
                                          ("mpi-pipeline", {"model": "stack-mlp", "depth": 4})])
def test_bytes_on_the_wire_per_step_match_theory(comm, name, options):
    size = comm.Get_size()
    cfg = eq.config(batch_size=64 * size, strategy=name, **options)
    warm = eq.run(cfg, steps=1)  # compiled, every connection made
    strategy, state = warm.strategy, warm.state
    comm.Barrier()
    before = payload_sent()
    for batch in eq.batches(cfg.data.batch_size, WIRE_STEPS, seed=1):
        state, sums = strategy.step(state, strategy.place_batch(batch))
        strategy.host_sums(sums)
    comm.Barrier()
    sent = comm.allgather((payload_sent() - before) / WIRE_STEPS)
    theory = strategy.theory()["busiest_rank_sent"]
    assert abs(max(sent) - theory) <= 0.1 * theory, (sent, theory)
