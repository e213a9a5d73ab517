"""Shared MPI plumbing for the mpi4jax strategies.

Their base class (one device per rank, the communicator), rank slicing of a global batch,
world-size checks. (Importing MPI, with the install message when it is missing, lives in
`jaxpar.runtime.distributed`, which joins ranks before any strategy exists.)

    mpiexec -n 2 python -m mpi4py -m experiments train --strategy mpi-allreduce
"""

from __future__ import annotations

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.runtime.distributed import import_mpi
from jaxpar.profiling.measure import tree_bytes
from jaxpar.errors import ConfigError
from jaxpar.parallel.base import Strategy

class OnePerRank(Strategy):
    """Base of the mpi4jax strategies: one process per MPI rank, one device each; the ranks
    are the parallel axis, joined by MPI itself (not jax.distributed)."""

    family = "multi-process"
    uses_mpi = True
    axes = ()  # one device per rank
    default_axes = {meshlib.DATA: 1}
    # Compiled for the program statistics, but called through `jit`: mpi4jax's collectives
    # are ordered effects whose token argument only jit's call path supplies (the bare
    # executable fails with 'supplied N arguments but expected N+1').
    runs_executables = False

    @classmethod
    def mesh_axes(cls, spec, devices):
        if any(size not in (1, -1) for size in meshlib.parse_mesh(spec).values()):
            raise meshlib.MeshError(f"--strategy {cls.name} runs one device per MPI rank; drop "
                                    f"--mesh {spec!r} (launch more ranks with mpiexec -n)")
        return dict(cls.default_axes)

    def __init__(self, config):
        super().__init__(config)
        self.MPI, self.mpi4jax = import_mpi()
        self.comm = self.MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def make_mesh(self, devices):
        # One local device per rank. (Under jax.distributed `devices` is global: take this
        # process's own.)
        local = [d for d in devices if d.process_index == jax.process_index()]
        return meshlib.make_mesh(self.mesh_axes(self.config.parallel.mesh, 1), local[:1])


def rank_rows(n_rows: int, rank: int, size: int) -> slice:
    """This rank's rows of a global batch of `n_rows` (needs n_rows % size == 0)."""
    if n_rows % size:
        raise ConfigError(f"--batch-size {n_rows} must be a multiple of the {size} MPI ranks")
    per = n_rows // size
    return slice(rank * per, (rank + 1) * per)


def global_weight(batch: dict[str, np.ndarray]) -> np.float32:
    """The global batch's weight total: every rank divides its loss by it (step.loss_fn denom)."""
    return np.float32(np.sum(batch["weight"]))


def metric_sums_shape() -> dict:
    """Shapes of `step.metric_sums`' output: the sums travel in the fused buffer too."""
    spec = jax.ShapeDtypeStruct
    batch = {"weight": spec((1,), np.float32), "label": spec((1,), np.int32)}
    return jax.eval_shape(steplib.metric_sums, spec((1, 2), np.float32), spec((1,), np.float32), batch)


def fused_bytes(tree) -> int:
    """Bytes of `tree` raveled into one buffer, as the strategies send it (`ravel_pytree`
    casts every leaf to one common dtype)."""
    return tree_bytes(jax.eval_shape(lambda t: ravel_pytree(t)[0], tree))
