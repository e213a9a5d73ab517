"""`dp-shard-map`: data parallelism written out by hand with `jax.shard_map`.

Each device computes the gradient of its shard and the gradients are summed with one
explicit `lax.psum` over DATA: the all-reduce of data parallelism, visible in the code.

Parameters enter the shard_map replicated (invariant over DATA). Under shard_map's
varying-manual-axes check, the gradient with respect to an invariant input is *already*
summed over the axis, so a further pmean/psum would make it N times too large. We cast
the parameters to varying first (`lax.pcast(..., to='varying')`): the gradient is then the
shard's own, and the psum below is the one and only reduction.

    python -m experiments train --strategy dp-shard-map --devices 8 --dataset synthetic
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar import step as steplib
from jaxpar.mesh import DATA
from jaxpar.parallel.data_parallel.common import DataParallel, accumulated_grads, global_sums


class DPShardMap(DataParallel):
    name = "dp-shard-map"
    summary = "`jax.shard_map` over `data` with one explicit `psum` of gradients"
    multiprocess = True  # shard_map over one global mesh under jax.distributed
    batch_norm_per_shard = True  # the step runs per shard inside shard_map

    def init(self, model, tx, mesh):
        params, model_state = self._setup(model, tx, mesh)
        state = jax.device_put(steplib.init_state(params, model_state, tx), self.replicated)
        shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P())
        self._register("step", shard(self._step), donate_argnums=0)
        self._register("gradients", shard(lambda s, b: self._grads(s, b)[0]))
        self._register("eval_step", shard(self._eval))
        return state

    def _grads(self, state, batch):
        denom = lax.psum(batch["weight"].sum(), DATA)
        params = lax.pcast(state.params, DATA, to="varying")
        grads, (model_state, sums) = accumulated_grads(
            params, self.graphdef, state.model_state, batch, denom, self.k)
        grads = lax.psum(grads, DATA)  # THE all-reduce of data parallelism
        # batch-norm statistics (if any) differ per shard: average them so replicas agree
        model_state = lax.pmean(model_state, DATA)
        return grads, model_state, global_sums(sums, denom)

    def _step(self, state, batch):
        grads, model_state, sums = self._grads(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _eval(self, state, batch):
        return lax.psum(steplib.eval_step(self.graphdef, state, batch), DATA)
