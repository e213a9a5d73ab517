"""Strategies on one `jax.distributed` mesh over MPI ranks (`jaxpar/runtime/distributed.py`) equal `single`.

The world is the size that was launched (a world of 1 would pass everything trivially), and
every multi-process strategy, one device per rank, matches `single` (run by rank 0 on its own
device, sent to all) on the full global batch (the equivalence protocol).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_jax_distributed.py
"""

import os
import socket

import jax
import pytest

import equivalence as eq
from jaxpar.runtime import gloo_poller


def test_world_size_is_what_was_launched(comm):
    """A world of size 1 would pass every equivalence test trivially."""
    expected = int(os.environ.get("JAXPAR_EXPECT_RANKS") or os.environ.get("PMI_SIZE")
                   or os.environ.get("OMPI_COMM_WORLD_SIZE") or 0)
    assert expected >= 2, "launch with mpiexec -n N (N >= 2), or set JAXPAR_EXPECT_RANKS"
    assert comm.Get_size() == expected


def test_ranks_are_on_the_hosts_launched(comm):
    """One host unless JAXPAR_EXPECT_HOSTS says more (tests/experiments/infra/test_cluster.py launches over
    emulated hosts): a launch that stayed on one host would never cross the network."""
    hosts = comm.allgather(socket.gethostname())
    assert len(set(hosts)) == int(os.environ.get("JAXPAR_EXPECT_HOSTS", "1")), hosts


def test_gloos_polling_thread_gives_way(comm):
    """jax.distributed's start-up put gloo's one polling thread under SCHED_IDLE (the
    collectives after it, in the tests below, still equal single's)."""
    assert gloo_poller.state() == "SCHED_IDLE (1 thread)"
    # The thread found in gloo's loop at start-up, not looked for again: under SCHED_IDLE on
    # busy cores (CI) it can wait runnable, out of its system call, for long (once it was).
    (tid,) = gloo_poller.given_way()
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE


@pytest.mark.parametrize("strategy", ["dp-auto", "dp-shard-map", "fsdp", "local-sgd"])
def test_equivalent_to_single(comm, strategy, reference):
    size = comm.Get_size()
    got = eq.run(eq.config(batch_size=16 * size, strategy=strategy), steps=5)
    eq.assert_equivalent(reference, got)
    # every device of every process (one per rank, or JAXPAR_MPI_DEVICES each)
    assert jax.process_count() == size and got.strategy.describe()["devices"] == len(jax.devices())
    assert got.strategy.trace_counts["step"] == 1


def test_arrays_move_between_processes_point_to_point(comm):
    """On CPU `processes.move` across processes is a transfer the two processes make alone
    (`transfers`): the value arrives exactly, there and back, and every process, holding the
    devices or not, counts the same transfers (their ids), a move within one process none."""
    import numpy as np

    from jaxpar.parallel.transport import processes, transfers

    first, last = (min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                   for p in (0, jax.process_count() - 1))
    value = np.arange(6 * 7, dtype=np.float32).reshape(6, 7)
    x = jax.device_put(value, first) if processes.owns(first) else processes.handle(value.shape, value.dtype, first)
    before = transfers.count()
    there = processes.move(x, last)
    back = processes.move(there, first)
    if processes.owns(last):
        np.testing.assert_array_equal(np.asarray(there), value)
    if processes.owns(first):
        np.testing.assert_array_equal(np.asarray(back), value)
    assert transfers.count() == before + 2
    beside = [d for d in jax.devices() if d.process_index == last.process_index and d != last]
    if beside:  # two devices per process: a move inside the last process is its device_put
        processes.move(there, beside[0])
    assert comm.allgather(transfers.count()) == [before + 2] * comm.Get_size()
