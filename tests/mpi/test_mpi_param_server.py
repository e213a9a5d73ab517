"""`mpi-param-server` at any communicator size: its bytes equal the formula.

The gather and broadcast bytes counted from the compiled step's MPI custom calls equal the
formula for this many ranks (its equivalence with `single`: test_mpi_common.py).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_mpi_param_server.py
"""

import equivalence as eq
from jaxpar.profiling import measure

NAME = "mpi-param-server"
SUMS = 3 * 4  # loss_sum, correct, count (f32) travel in the fused buffer with the gradient


def test_accounted_bytes_match_the_formula_for_this_communicator(comm):
    ranks = comm.Get_size()
    # Momentum SGD: the optimizer state (which the parameter server broadcasts) is not empty.
    t = eq.run(eq.config(batch_size=16 * ranks, strategy=NAME, optimizer="momentum"), steps=1)
    acc = eq.accounting(NAME, devices=None, batch_size=16 * ranks, optimizer="momentum")
    grad = measure.tree_bytes(t.state.params) + SUMS
    state = measure.tree_bytes(t.state) + SUMS  # parameters, optimizer state, step
    theory = acc["collective_bytes_theory"]
    assert acc["collective_bytes_per_step"] == theory["total"]
    assert state > 2 * grad - 2 * SUMS  # momentum trace included
    assert acc["collective_bytes_by_op"] == {"mpi_gather": grad, "mpi_bcast": state,
                                             "total": grad + state}
    assert theory["busiest_rank_received"] == (ranks - 1) * grad
    assert theory["busiest_rank_sent"] == (ranks - 1) * state
    assert acc["comm_time_ms_median"] > 0
