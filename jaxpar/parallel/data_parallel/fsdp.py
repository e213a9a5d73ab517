"""`fsdp`: fully sharded data parallelism (ZeRO-3), written with explicit collectives.

Every parameter and its optimizer state live as a flat vector, padded to a multiple of N and
sharded over DATA: each device keeps 1/N of the state. A step all-gathers the parameters
for use, computes the shard's gradient, and reduce-scatters the gradients (`psum_scatter`)
so each device receives the summed gradient of exactly the slice it owns, and updates only
that slice. Optax's transformations are element-wise, so updating slices equals updating
the whole.

    python -m experiments bench --strategy fsdp --devices 8 --model mlp
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.data_parallel import cost
from jaxpar import step as steplib
from jaxpar.mesh import DATA
from jaxpar.parallel.data_parallel.common import DataParallel, accumulated_grads, global_sums
from jaxpar.parallel.layout import host_copy, map_param_trees


class FSDP(DataParallel):
    name = "fsdp"
    cost_model = staticmethod(cost.fsdp)
    summary = ("ZeRO-3: parameters and optimizer state sharded 1/N per device; all-gather on "
               "use, reduce-scatter of gradients, explicit in `shard_map`")
    multiprocess = True  # state sharded over one global mesh under jax.distributed
    batch_norm_per_shard = True  # the step runs per shard inside shard_map

    def init(self, model, tx, mesh):
        params, model_state = self._setup(model, tx, mesh)
        self.shapes = jax.tree.map(lambda t: t.shape, self.template)
        self.sharded = NamedSharding(mesh, P(DATA))
        ref = steplib.init_state(params, model_state, tx)
        self.state_specs = map_param_trees(ref, self.template, lambda t: jax.tree.map(lambda _: P(DATA), t),
                                           other=lambda _: P())
        shard = functools.partial(jax.shard_map, mesh=mesh)
        self._register("step", shard(self._step, in_specs=(self.state_specs, P(DATA)),
                                     out_specs=(self.state_specs, P())), donate_argnums=0)
        self._register("gradients", shard(self._full_grads, in_specs=(self.state_specs, P(DATA)),
                                          out_specs=P()))
        self._register("eval_step", shard(self._eval, in_specs=(self.state_specs, P(DATA)),
                                          out_specs=P()))
        return self.state_from_reference(ref)

    # --- layout: full parameter <-> padded flat vector, 1/N per device ----------------------
    def _flat_size(self, shape) -> int:
        return -(-math.prod(shape) // self.n) * self.n

    def _to_flat(self, tree):
        return jax.tree.map(lambda x, s: jnp.pad(jnp.ravel(x), (0, self._flat_size(s) - math.prod(s))),
                            tree, self.shapes, is_leaf=lambda x: hasattr(x, "shape"))

    def _from_flat(self, tree):
        return jax.tree.map(lambda x, s: x[:math.prod(s)].reshape(s), tree, self.shapes)

    def _gather(self, flat_shards):
        """All-gather on use: every device rebuilds the full parameters."""
        return self._from_flat(jax.tree.map(lambda x: lax.all_gather(x, DATA, tiled=True), flat_shards))

    def _scatter(self, full_grads):
        """Reduce-scatter: sum over devices, each keeps the slice it owns."""
        return jax.tree.map(lambda g: lax.psum_scatter(g, DATA, tiled=True), self._to_flat(full_grads))

    # --- programs ---------------------------------------------------------------------------
    def _local_grads(self, state, batch):
        denom = lax.psum(batch["weight"].sum(), DATA)
        # all_gather's result is typed varying over DATA, so the gradient below is this
        # shard's own (not implicitly summed): the reduce-scatter is the only reduction.
        params = self._gather(state.params)
        grads, (model_state, sums) = accumulated_grads(
            params, self.graphdef, state.model_state, batch, denom, self.k)
        return grads, lax.pmean(model_state, DATA), global_sums(sums, denom)

    def _step(self, state, batch):
        grads, model_state, sums = self._local_grads(state, batch)
        return steplib.apply_update(state, self._scatter(grads), self.tx, model_state), sums

    def _full_grads(self, state, batch):
        return lax.psum(self._local_grads(state, batch)[0], DATA)

    def _eval(self, state, batch):
        full = state.replace(params=self._gather(state.params))
        return lax.psum(steplib.eval_step(self.graphdef, full, batch), DATA)

    # --- reference layout -------------------------------------------------------------------
    def state_to_reference(self, state):
        host = host_copy(state)
        return map_param_trees(host, self.template, lambda t: jax.device_get(self._from_flat(t)))

    def state_from_reference(self, ref):
        flat = map_param_trees(ref, self.template, self._to_flat)
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.state_specs)
        return jax.device_put(flat, shardings)

    def describe(self) -> dict:
        return {**super().describe(), "axes": {DATA: "batch, parameters and optimizer state"}}

    def theory(self) -> dict[str, int]:
        """All-gather every parameter (operand: this device's 1/N slice), reduce-scatter every
        gradient (operand: the whole padded gradient), plus 3 f32 scalars all-reduced."""
        padded = sum(self._flat_size(s) * 4 for s in jax.tree.leaves(
            self.shapes, is_leaf=lambda x: isinstance(x, tuple)))
        ops = {"all-gather": padded // self.n, "reduce-scatter": padded, "all-reduce": 12}
        return {**ops, "total": sum(ops.values())}
