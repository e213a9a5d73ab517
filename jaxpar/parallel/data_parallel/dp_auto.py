"""`dp-auto`: data parallelism left to the compiler.

The reference step, unchanged, under `jit` with the batch sharded over DATA and the state
replicated (`NamedSharding`). XLA's SPMD partitioner inserts the gradient all-reduce itself;
`bench` reports the collective bytes it chose beside the theoretical figure.

    python -m experiments bench --strategy dp-auto --devices 8 --model cnn
"""

from __future__ import annotations

import functools

import jax

from jaxpar import step as steplib
from jaxpar.parallel.data_parallel.common import DataParallel, accumulated_grads


class DPAuto(DataParallel):
    name = "dp-auto"
    summary = "`jit` with the batch sharded by `NamedSharding`; XLA inserts the all-reduce"
    multiprocess = True  # one global mesh under jax.distributed

    def init(self, model, tx, mesh):
        params, model_state = self._setup(model, tx, mesh)
        state = jax.device_put(steplib.init_state(params, model_state, tx), self.replicated)
        shardings = dict(in_shardings=(self.replicated, self.batch_sharding))
        self._register("step", self._step, out_shardings=(self.replicated, self.replicated),
                       donate_argnums=0, **shardings)
        self._register("gradients", self._grads, out_shardings=self.replicated, **shardings)
        self._register("eval_step", functools.partial(steplib.eval_step, self.graphdef),
                       out_shardings=self.replicated, **shardings)
        return state

    def _grads(self, state, batch):
        return self._grads_and_aux(state, batch)[0]

    def _grads_and_aux(self, state, batch):
        denom = batch["weight"].sum()
        return accumulated_grads(state.params, self.graphdef, state.model_state, batch, denom, self.k)

    def _step(self, state, batch):
        grads, (model_state, sums) = self._grads_and_aux(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums
