"""`mpi-allreduce`: one process per MPI rank, gradients summed with `mpi4jax.allreduce`.

One device per rank; gradients fused into one flat buffer (Horovod's tensor fusion) and
summed across ranks with `mpi4jax.allreduce` inside the jitted step. Each rank reads only
its own rows of every global batch.

    mpiexec -n 2 python -m mpi4py -m experiments train --strategy mpi-allreduce --model mlp
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from jaxpar.parallel.mpi import cost
from jaxpar.profiling import measure
from jaxpar import step as steplib
from jaxpar.parallel import layout
from jaxpar.parallel.mpi import common as mpi_common

COMM_REPEATS = 10  # timed calls of the communication alone (accounting)


class MpiAllreduce(mpi_common.OnePerRank):
    name = "mpi-allreduce"
    cost_model = staticmethod(cost.mpi_allreduce)
    summary = ("one process per MPI rank; fused gradient buffer summed with "
               "`mpi4jax.allreduce` inside `jit` (Horovod-style)")
    batch_norm_per_shard = True  # each rank steps on its own rows; the ranks are the data axis

    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.device = mesh.devices.flat[0]
        self.graphdef, params, model_state = steplib.split_model(model)
        state = jax.device_put(steplib.init_state(params, model_state, tx), self.device)
        self.template = layout.abstract(state)  # buffer sizes for theory()
        self._register("step", self._step, donate_argnums=0)
        self._register("eval_step", self._eval_step)
        self._register("gradients", self._gradients)
        return state

    # --- collectives ---------------------------------------------------------------------
    def _sum(self, tree):
        """Sum a pytree over ranks as ONE fused buffer (one MPI call, not one per leaf)."""
        flat, unravel = ravel_pytree(tree)
        return unravel(self.mpi4jax.allreduce(flat, op=self.MPI.SUM, comm=self.comm))

    def _local_grads(self, state, batch):
        return steplib.grad_fn(state.params, self.graphdef, state.model_state,
                               batch["local"], denom=batch["denom"])

    def _gradients(self, state, batch):
        grads, _ = self._local_grads(state, batch)
        return self._sum(grads)

    def _step(self, state, batch):
        grads, (model_state, sums) = self._local_grads(state, batch)
        grads, sums = self._sum((grads, sums))
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _eval_step(self, state, batch):
        return self._sum(steplib.eval_step(self.graphdef, state, batch["local"]))

    # --- accounting ----------------------------------------------------------------------
    def _communicate(self, state, sums):
        """The step's MPI calls alone, on buffers shaped like the step's (no compute)."""
        return self._sum((state.params, sums))

    def theory(self) -> dict[str, int]:
        sums = mpi_common.metric_sums_shape()
        return cost.mpi_allreduce_bytes(mpi_common.fused_bytes((self.template.params, sums)), self.size)

    def accounting(self, programs, state) -> dict:
        """The base metrics (mpi4jax calls are counted from the compiled step's custom calls)
        plus the communication's own time: `_communicate` timed on this step's buffer sizes."""
        out = super().accounting(programs, state)
        sums = jax.device_put(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                           mpi_common.metric_sums_shape()), self.device)
        communicate = jax.jit(self._communicate)
        times = measure.time_calls(lambda: communicate(state, sums), COMM_REPEATS)
        return {**out, "comm_time_ms_median": measure.median_ms(times)}

    # --- placement -----------------------------------------------------------------------
    def rows_multiple(self) -> int:
        return self.size  # ranks

    def place_batch(self, batch):
        """The global host batch -> this rank's rows on its device, plus the global weight total."""
        batch = self.pad(batch)
        rows = mpi_common.rank_rows(len(batch["label"]), self.rank, self.size)
        local = {key: value[rows] for key, value in batch.items()}
        return jax.device_put({"local": local, "denom": mpi_common.global_weight(batch)}, self.device)

    def state_from_reference(self, ref):
        return jax.device_put(ref, self.device)

    def describe(self):
        return {**super().describe(), "processes": self.size, "devices": self.size,
                "collective": "mpi4jax.allreduce (fused)"}
