"""Communication and memory predicted from first principles, beside what programs measure.

See docs/design.md. Bytes are collective *operand* bytes,
as `jaxpar.measure.collective_bytes` counts them.

    tensor_collective_bytes(batch_local=64, width=32, depth=4, degree=2, vit=False)
"""

from __future__ import annotations

from jaxpar.models.vit import TOKENS

F32 = 4


def tensor_collective_bytes(*, batch_local: int, width: int, depth: int, degree: int,
                            vit: bool, data: int = 1, param_bytes_local: int = 0) -> int:
    """Megatron TP all-reduce operand bytes per training step (one device).

    Each block sub-layer pair (the MLP; in the ViT also attention) all-reduces its output
    activation [B_local, (tokens,) width] once forward and once backward.

    Args:
      batch_local: examples per device along the data axis (global batch / data degree).
      width: the residual stream width d.
      depth: number of blocks.
      degree: tensor-parallel degree T (no collectives when T == 1).
      vit: True for the ViT (2 sub-blocks per block, TOKENS tokens per example).
      data: data-parallel degree; when > 1 each device also all-reduces its gradient shard
        (`param_bytes_local`) and the three metric sums once.

    Returns:
      bytes: 2 * sub_blocks * depth * B_local * tokens * width * 4 (+ the data part).
    """
    tokens, sub_blocks = (TOKENS, 2) if vit else (1, 1)
    tp = 2 * sub_blocks * depth * batch_local * tokens * width * F32 if degree > 1 else 0
    dp = param_bytes_local + 3 * F32 if data > 1 else 0
    return tp + dp



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
