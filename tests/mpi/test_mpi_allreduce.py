"""`mpi-allreduce` at any communicator size: its bytes equal the formula.

The bytes counted from the compiled step's MPI custom calls equal the ring formula for this
many ranks (its equivalence with `single`: test_mpi_common.py).

    mpiexec -n 2 python -m mpi4py -m pytest -q tests/mpi/test_mpi_allreduce.py
"""

import equivalence as eq
from jaxpar.profiling import measure

NAME = "mpi-allreduce"
SUMS = 3 * 4  # loss_sum, correct, count (f32) travel in the fused buffer with the gradient


def test_accounted_bytes_match_the_formula_for_this_communicator(comm):
    ranks = comm.Get_size()
    t = eq.run(eq.config(batch_size=16 * ranks, strategy=NAME, optimizer="momentum"), steps=1)
    acc = eq.accounting(NAME, devices=None, batch_size=16 * ranks, optimizer="momentum")
    grad = measure.tree_bytes(t.state.params) + SUMS
    theory = acc["collective_bytes_theory"]
    assert acc["collective_bytes_per_step"] == theory["total"]
    assert acc["collective_bytes_by_op"] == {"mpi_allreduce": grad, "total": grad}
    ring = int(2 * (ranks - 1) / ranks * grad)
    assert theory["busiest_rank_sent"] == theory["busiest_rank_received"] == ring
    assert acc["comm_time_ms_median"] > 0
