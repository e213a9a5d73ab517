"""`local-sgd`: each replica steps on its own shard; parameters averaged every k steps.

Each replica takes `--sync-every k` optimizer steps on its own shard of every global batch,
then the replicas' parameters are averaged ("average the weights", local SGD / FedAvg).
Communication falls k-fold; with k = 1 and SGD it is exactly data parallelism.

Optimizer state (momentum, Adam moments) stays with each replica and is never averaged:
only parameters travel, once every k steps. With k = 1 this still equals data parallelism
for SGD and momentum SGD (both linear in the gradient); for Adam it does not.

The state carries a leading replica axis sharded over DATA, except the step count, which all
replicas share: it is the averaging phase. The step program averages (one all-reduce of the
parameters, under `lax.cond`) after every step whose count is a multiple of k, so a run
resumed from a checkpoint averages on the same steps as one that never stopped. Metric sums
stay per replica on device and are added on the host when read (`host_sums`).

    python -m experiments train --strategy local-sgd --sync-every 4 --devices 8 --dataset synthetic
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.data_parallel import cost
from jaxpar.profiling import measure
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA
from jaxpar.parallel.data_parallel.common import DataParallel, accumulated_grads
from jaxpar.parallel.layout import host_copy


def _unstacked(state):
    """A replica's own state inside shard_map: [1, ...] -> [...]; the shared step as it is."""
    return jax.tree.map(lambda x: x[0], state.replace(step=None)).replace(step=state.step)


def _stacked(tree):
    """Back to the stacked layout: [...] -> [1, ...] (the shared step left alone)."""
    if isinstance(tree, steplib.TrainState):
        return jax.tree.map(lambda x: x[None], tree.replace(step=None)).replace(step=tree.step)
    return jax.tree.map(lambda x: x[None], tree)


class LocalSGD(DataParallel):
    name = "local-sgd"
    cost_model = staticmethod(cost.local_sgd)
    summary = ("each replica takes `--sync-every k` steps on its own shard, then parameters "
               "are averaged")
    multiprocess = True  # per-replica state over one global mesh under jax.distributed
    batch_norm_per_shard = True  # each replica steps on its own shard
    options = ("accumulate", "sync_every", "steps_per_dispatch")

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
        ref = steplib.init_state(params, model_state, tx)
        specs = jax.tree.map(lambda _: P(DATA), ref.replace(step=None)).replace(step=P())
        self.state_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(DATA)))
        self._register("step", shard(self._local_step, out_specs=(specs, P(DATA))), donate_argnums=0)
        self._register("gradients", shard(self._mean_grads, out_specs=P()))
        self._register("eval_step", shard(self._eval, out_specs=P(DATA)))
        return self.state_from_reference(ref)

    def _local_grads(self, state, batch):
        # Each replica minimises its own shard's mean loss: denominator = its own weight total.
        return accumulated_grads(state.params, self.graphdef, state.model_state, batch,
                                 batch["weight"].sum(), self.k)

    def _local_step(self, stacked_state, batch):
        state = _unstacked(stacked_state)
        grads, (model_state, sums) = self._local_grads(state, batch)
        state = steplib.apply_update(state, grads, self.tx, model_state)
        params = lax.cond(state.step % self.sync_every == 0, self._average, lambda p: p, state.params)
        return _stacked(state.replace(params=params)), _stacked(sums)

    @staticmethod
    def _average(params):
        # pmean makes them equal across replicas; the cast keeps the per-replica type that
        # the other branch (no average) has.
        return lax.pcast(lax.pmean(params, DATA), DATA, to="varying")

    def _mean_grads(self, stacked_state, batch):
        grads, _ = self._local_grads(_unstacked(stacked_state), batch)
        return lax.pmean(grads, DATA)

    def _eval(self, stacked_state, batch):
        # Evaluate the averaged model (what to_reference returns), shard by shard.
        state = _unstacked(stacked_state)
        state = state.replace(params=lax.pmean(state.params, DATA))
        return _stacked(steplib.eval_step(self.graphdef, state, batch))

    def host_sums(self, sums):
        """Each replica's sums, added up on the host (adding them on device would be one
        more collective per step)."""
        return {k: float(np.sum(v)) for k, v in host_copy(sums).items()}

    def state_to_reference(self, state):
        host = host_copy(state)
        mean = lambda x: np.mean(x, axis=0, dtype=np.float64).astype(x.dtype)  # noqa: E731
        return jax.tree.map(mean, host.replace(step=None)).replace(step=host.step)

    def state_from_reference(self, ref):
        stacked = jax.tree.map(lambda x: np.broadcast_to(x, (self.n, *np.shape(x))),
                               ref.replace(step=None)).replace(step=ref.step)
        return jax.device_put(stacked, self.state_shardings)

    def _program(self, name, executable):
        # The average sits in the step's conditional branch, taken once every k steps.
        every = self.sync_every if name == "step" else 1
        return measure.Program(name, executable, devices=self.mesh.devices.size, branch_every=every)

    def theory(self) -> dict[str, int]:
        """One all-reduce of the parameters every k steps; local steps communicate nothing."""
        per_sync = measure.tree_bytes(self.template)
        return {"all-reduce": per_sync // self.sync_every, "total": per_sync // self.sync_every}

    def describe(self) -> dict:
        return {**super().describe(), "sync_every": self.sync_every,
                "axes": {DATA: "replicas (own batch shard and optimizer state)"}}
