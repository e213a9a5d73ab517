"""`dp-pmap`: data parallelism with `jax.pmap` and `lax.psum` of gradients (the legacy API).

The API much of the literature used (pmap is in maintenance mode but works).

State is replicated with a leading device axis; the global batch is reshaped to
[devices, rows per device, ...]. Under pmap, the gradient with respect to the per-device
parameter copy is that device's own, so one psum gives the global gradient.

    python -m experiments train --strategy dp-pmap --devices 8 --dataset synthetic
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from jaxpar import step as steplib
from jaxpar.mesh import DATA
from jaxpar.parallel.data_parallel.common import DataParallel, accumulated_grads, global_sums


def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


class DPPmap(DataParallel):
    name = "dp-pmap"
    summary = "`jax.pmap` + `lax.psum` of gradients (the legacy API)"
    batch_norm_per_shard = True  # one pmapped step per device
    multiprocess = True  # pmap over every process's devices under jax.distributed
    options = ("accumulate",)  # no --steps-per-dispatch: a pmapped step does not nest in jit

    def init(self, model, tx, mesh):
        params, model_state = self._setup(model, tx, mesh)
        self.devices = list(mesh.devices.flat)
        pmap = lambda f, **kw: jax.pmap(f, axis_name=DATA, devices=self.devices, **kw)  # noqa: E731
        self._register("step", self._step, transform=pmap, donate_argnums=0)
        self._register("gradients", lambda s, b: self._grads(s, b)[0], transform=pmap)
        self._register("eval_step", self._eval, transform=pmap)
        return self.state_from_reference(steplib.init_state(params, model_state, tx))

    def _grads(self, state, batch):
        denom = lax.psum(batch["weight"].sum(), DATA)
        grads, (model_state, sums) = accumulated_grads(
            state.params, self.graphdef, state.model_state, batch, denom, self.k)
        return lax.psum(grads, DATA), lax.pmean(model_state, DATA), global_sums(sums, denom)

    def _step(self, state, batch):
        grads, model_state, sums = self._grads(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _eval(self, state, batch):
        return lax.psum(steplib.eval_step(self.graphdef, state, batch), DATA)

    def place_batch(self, batch):
        batch = self.pad(batch)
        split = {k: v.reshape(self.n, -1, *v.shape[1:]) for k, v in batch.items()}
        return jax.device_put(split, self.batch_sharding)  # leading axis: one row per device

    def step(self, state, batch):
        state, sums = self._call("step", state, batch)
        return state, _first(sums)

    def eval_step(self, state, batch):
        return _first(self._call("eval_step", state, batch))

    def gradients(self, state, batch):
        return jax.device_get(_first(self._call("gradients", state, batch)))

    def state_to_reference(self, state):
        return jax.device_get(_first(state))

    def state_from_reference(self, ref):
        stacked = jax.tree.map(lambda x: np.broadcast_to(x, (self.n, *np.shape(x))), ref)
        return jax.device_put(stacked, self.batch_sharding)
