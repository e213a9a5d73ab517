"""`local-sgd`: each replica takes `--sync-every k` optimizer steps on its own shard of every
global batch, then the replicas' parameters are averaged ("average the weights", local SGD /
FedAvg). Communication falls k-fold; with k = 1 and SGD it is exactly data parallelism.

Optimizer state (momentum, Adam moments) stays with each replica and is never averaged:
only parameters travel, once every k steps. With k = 1 this still equals data parallelism
for SGD and momentum SGD (both linear in the gradient); for Adam it does not.

The state carries a leading replica axis sharded over DATA. Local steps run with no
collective at all; the averaging is a separate program (one all-reduce of the parameters).

    python -m experiments train --strategy local-sgd --sync-every 4 --devices 8 --dataset synthetic
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar import measure
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA
from jaxpar.parallel.dp_common import DataParallel, accumulated_grads
from jaxpar.parallel.layout import fetch

_local = functools.partial(jax.tree.map, lambda x: x[0])        # [1, ...] -> [...] inside shard_map
_stacked = functools.partial(jax.tree.map, lambda x: x[None])   # and back


class LocalSGD(DataParallel):
    name = "local-sgd"
    summary = ("each replica takes `--sync-every k` steps on its own shard, then parameters "
               "are averaged")
    multiprocess = True  # per-replica state over one global mesh under jax.distributed
    batch_norm_per_shard = True  # each replica steps on its own shard
    options = ("accumulate", "sync_every")

    @classmethod
    def check(cls, config, axes):
        n, batch = axes.get(DATA, 1), config.data.batch_size
        if batch % n:
            return [f"--strategy local-sgd needs a --batch-size divisible by the {n} replicas "
                    f"(each averages over its own shard); got --batch-size {batch}."]
        return []

    def init(self, model, tx, mesh):
        params, model_state = self._setup(model, tx, mesh)
        self.sync_every = self.config.parallel.sync_every
        if self.sync_every < 1:
            raise ConfigError(f"--sync-every must be >= 1, got {self.sync_every}")
        shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(DATA), P(DATA)))
        self._register("step", shard(self._local_step, out_specs=(P(DATA), P(DATA))), donate_argnums=0)
        self._register("gradients", shard(self._mean_grads, out_specs=P()))
        self._register("eval_step", shard(self._eval, out_specs=P(DATA)))
        self._register("average", jax.shard_map(self._average, mesh=mesh, in_specs=P(DATA),
                                                out_specs=P(DATA)), donate_argnums=0)
        return self.state_from_reference(steplib.init_state(params, model_state, tx))

    def _local_grads(self, state, batch):
        # Each replica minimises its own shard's mean loss: denominator = its own weight total.
        return accumulated_grads(state.params, self.graphdef, state.model_state, batch,
                                 batch["weight"].sum(), self.k)

    def _local_step(self, stacked_state, batch):
        state = _local(stacked_state)
        grads, (model_state, sums) = self._local_grads(state, batch)
        state = steplib.apply_update(state, grads, self.tx, model_state)
        return _stacked(state), _stacked(sums)

    def _average(self, stacked_state):
        state = _local(stacked_state)
        return _stacked(state.replace(params=lax.pmean(state.params, DATA)))

    def _mean_grads(self, stacked_state, batch):
        grads, _ = self._local_grads(_local(stacked_state), batch)
        return lax.pmean(grads, DATA)

    def _eval(self, stacked_state, batch):
        # Evaluate the averaged model (what to_reference returns), shard by shard.
        state = _local(stacked_state)
        state = state.replace(params=lax.pmean(state.params, DATA))
        return _stacked(steplib.eval_step(self.graphdef, state, batch))

    def step(self, state, batch):
        state, sums = self._call("step", state, batch)
        sums = jax.tree.map(lambda x: np.asarray(x).sum(0), fetch(sums))  # waits: one step in flight
        self._steps_since_sync = getattr(self, "_steps_since_sync", 0) + 1
        if self._steps_since_sync == self.sync_every:
            state = self._call("average", state)
            jax.block_until_ready(state)
            self._steps_since_sync = 0
        return state, sums

    def eval_step(self, state, batch):
        return jax.tree.map(lambda x: np.asarray(x).sum(0), fetch(self._call("eval_step", state, batch)))

    def state_to_reference(self, state):
        host = fetch(state)
        ref = jax.tree.map(lambda x: np.mean(x, axis=0, dtype=np.float64).astype(x.dtype), host)
        return ref.replace(step=host.step[0])

    def state_from_reference(self, ref):
        stacked = jax.tree.map(lambda x: np.broadcast_to(x, (self.n, *np.shape(x))), ref)
        return jax.device_put(stacked, self.batch_sharding)

    def accounting(self, step_stats, state):
        # Local steps communicate nothing; the averaging program runs once every k steps.
        average, _ = self.compile("average", state)
        sync = measure.program_stats(average)["collective_bytes"]
        out = super().accounting(step_stats, state)
        per_step = {op: b // self.sync_every for op, b in sync.items()}
        return {**out, "collective_bytes_per_step": per_step.get("total", 0),
                "collective_bytes_by_op": per_step}

    def theory(self) -> dict[str, int]:
        """One all-reduce of the parameters every k steps; local steps communicate nothing."""
        per_sync = measure.tree_bytes(self.template)
        return {"all-reduce": per_sync // self.sync_every, "total": per_sync // self.sync_every}

    def describe(self) -> dict:
        return {**super().describe(), "sync_every": self.sync_every,
                "axes": {DATA: "replicas (own batch shard and optimizer state)"}}
