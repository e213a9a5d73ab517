"""`mpi-param-server`: gradients gathered to rank 0, updated there, state broadcast back.

The early MPI papers' scheme. Every rank computes gradients on its rows of the global
batch; they are gathered to rank 0 (`mpi4jax.gather`), rank 0 sums them and makes the
update, and the new parameters are broadcast back (`mpi4jax.bcast`). Same results as
`mpi-allreduce`, different communication (N buffers into one rank, one buffer out).

    mpiexec -n 2 python -m mpi4py -m experiments train --strategy mpi-param-server --model mlp
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from jaxpar.parallel.mpi import cost
from jaxpar import step as steplib
from jaxpar.parallel.mpi import common as mpi_common
from jaxpar.parallel.mpi.mpi_allreduce import MpiAllreduce

ROOT = 0


class MpiParamServer(MpiAllreduce):
    name = "mpi-param-server"
    cost_model = staticmethod(cost.mpi_param_server)
    summary = ("gradients gathered to rank 0 (`mpi4jax.gather`), update there, state "
               "broadcast back")

    def _gather_sum(self, tree):
        """Sum over ranks by gathering every rank's fused buffer to ROOT (valid on ROOT only)."""
        flat, unravel = ravel_pytree(tree)
        gathered = self.mpi4jax.gather(flat, ROOT, comm=self.comm)
        # Off ROOT gather returns the input unchanged; the sum is only used on ROOT.
        total = jnp.sum(gathered, axis=0) if self.rank == ROOT else flat
        return unravel(total)

    def _bcast(self, tree):
        flat, unravel = ravel_pytree(tree)
        return unravel(self.mpi4jax.bcast(flat, ROOT, comm=self.comm))

    def _gradients(self, state, batch):
        grads, _ = self._local_grads(state, batch)
        return self._bcast(self._gather_sum(grads))

    def _step(self, state, batch):
        grads, (model_state, sums) = self._local_grads(state, batch)
        grads, sums = self._gather_sum((grads, sums))
        # ROOT updates; the others compute a throw-away update of the same shape and then take
        # ROOT's whole state (parameters, optimizer state, step) from the broadcast.
        new_state = steplib.apply_update(state, grads, self.tx, model_state)
        new_state, sums = self._bcast((new_state, sums))
        return new_state, sums

    def _communicate(self, state, sums):
        return self._gather_sum((state.params, sums)), self._bcast((state, sums))

    def theory(self) -> dict[str, int]:
        sums = mpi_common.metric_sums_shape()
        return cost.mpi_param_server_bytes(mpi_common.fused_bytes((self.template.params, sums)),
                                             mpi_common.fused_bytes((self.template, sums)), self.size)

    def describe(self):
        return {**super().describe(), "collective": "mpi4jax.gather to rank 0 + bcast"}
