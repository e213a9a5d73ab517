"""What the MPI strategies cost: their collectives in closed form (`theory()` reports these
bytes beside what the compiled step measures) and their step as a `jaxpar.cost.Work`."""

from __future__ import annotations

from jaxpar.cost import SUMS_BYTES, Collective, Problem, Work
from jaxpar.parallel.data_parallel.cost import replicas


def mpi_allreduce(p: Problem) -> Work:
    """Ranks as data-parallel replicas; gradient and sums fused into one buffer, one allreduce."""
    c, r = p.compute, p.size("data")
    return replicas(p, c.step_s(p.batch / r), [Collective("mpi_allreduce", c.param_bytes + SUMS_BYTES, r)],
                 c.state_bytes)


def mpi_param_server(p: Problem) -> Work:
    """Ranks compute gradients of B/R rows; rank 0 gathers them, updates, broadcasts the state.
    Every rank runs the update (the others a throw-away one of the same shape, replaced by the
    broadcast: `MpiParamServer._step`), so each rank's compute is a whole step at B/R."""
    c, r = p.compute, p.size("data")
    ops = [Collective("mpi_gather", c.param_bytes + SUMS_BYTES, r), Collective("mpi_bcast", c.state_bytes + SUMS_BYTES, r)]
    return Work((c.step_s(p.batch / r),) * r, tuple(ops), c.state_bytes, c.temp_bytes(p.batch / r))


def mpi_allreduce_bytes(fused: int, ranks: int) -> dict[str, int]:
    """mpi-allreduce: one all-reduce of the fused gradient + metric sums buffer per step.

    Args:
      fused: bytes of that buffer (each rank's operand).
      ranks: communicator size R.

    Returns:
      {'mpi_allreduce', 'total'}: operand bytes per rank; 'busiest_rank_sent' and
      'busiest_rank_received': a ring all-reduce moves 2(R-1)/R * fused each way on every rank.
    """
    wire = int(2 * (ranks - 1) / ranks * fused)
    return {"mpi_allreduce": fused, "total": fused,
            "busiest_rank_sent": wire, "busiest_rank_received": wire}


def mpi_param_server_bytes(fused_grads: int, fused_state: int, ranks: int) -> dict[str, int]:
    """mpi-param-server: every rank's fused gradient gathered to the root, then the root's
    new state (parameters, optimizer state, step) + metric sums broadcast back.

    Args:
      fused_grads: bytes of one rank's gathered buffer (gradient + metric sums).
      fused_state: bytes of the broadcast buffer (whole training state + metric sums).
      ranks: communicator size R.

    Returns:
      {'mpi_gather', 'mpi_bcast', 'total'}: operand bytes per rank; with a flat gather and
      broadcast the root is the busiest rank: it receives (R-1) * fused_grads
      ('busiest_rank_received') and sends (R-1) * fused_state ('busiest_rank_sent').
    """
    return {"mpi_gather": fused_grads, "mpi_bcast": fused_state, "total": fused_grads + fused_state,
            "busiest_rank_sent": (ranks - 1) * fused_state,
            "busiest_rank_received": (ranks - 1) * fused_grads}
