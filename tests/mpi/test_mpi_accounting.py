"""Communication accounting of the mpi4jax strategies at any communicator size: bytes counted
from the compiled step's MPI custom calls equal the formula for this many ranks.

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_mpi_accounting.py
"""

import pytest

import equivalence as eq
from jaxpar import measure

SUMS = 3 * 4  # loss_sum, correct, count (f32) travel in the fused buffer with the gradient


@pytest.mark.parametrize("strategy", ["mpi-allreduce", "mpi-param-server"])
def test_accounted_bytes_match_the_formula_for_this_communicator(comm, strategy):
    ranks = comm.Get_size()
    # Momentum SGD: the optimizer state (which the parameter server broadcasts) is not empty.
    t = eq.run(eq.config(batch_size=16 * ranks, strategy=strategy, optimizer="momentum"), steps=1)
    batch = t.strategy.place_batch(eq.batches(16 * ranks, 1)[0])
    compiled, _ = t.strategy.compile("step", t.state, batch)
    acc = t.strategy.accounting(measure.program_stats(compiled), t.state)
    grad = measure.tree_bytes(t.state.params) + SUMS
    state = measure.tree_bytes(t.state) + SUMS  # parameters, optimizer state, step
    theory = acc["collective_bytes_theory"]
    assert acc["collective_bytes_per_step"] == theory["total"]
    if strategy == "mpi-allreduce":
        assert acc["collective_bytes_by_op"] == {"mpi_allreduce": grad, "total": grad}
        ring = int(2 * (ranks - 1) / ranks * grad)
        assert theory["busiest_rank_sent"] == theory["busiest_rank_received"] == ring
    else:
        assert state > 2 * grad - 2 * SUMS  # momentum trace included
        assert acc["collective_bytes_by_op"] == {"mpi_gather": grad, "mpi_bcast": state,
                                                 "total": grad + state}
        assert theory["busiest_rank_received"] == (ranks - 1) * grad
        assert theory["busiest_rank_sent"] == (ranks - 1) * state
    assert acc["comm_time_ms_median"] > 0
