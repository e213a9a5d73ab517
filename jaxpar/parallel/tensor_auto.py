"""`tensor-auto`: the Megatron layout of `tensor`, left to the compiler.

The parameters carry the same PartitionSpecs as in `tensor` (block column layers split by
columns, row layers by rows, the rest replicated) as `NamedSharding`s; the reference step
runs unchanged under plain `jit`, and XLA's SPMD partitioner decides where the collectives
go. `bench` reports the bytes it chose beside Megatron's theory (they need not agree: XLA
may all-gather weights or reduce elsewhere, and that is a finding).

    python -m experiments bench --strategy tensor-auto --model stack-mlp --devices 4 --mesh tensor=4
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import step as steplib
from jaxpar.parallel.tensor import TensorLayout


class TensorAuto(TensorLayout):
    name = "tensor-auto"

    def init(self, model, tx, mesh):
        ref = self._setup(model, tx, mesh)
        replicated = NamedSharding(mesh, P())
        params = jax.tree.map(lambda s: NamedSharding(mesh, s), self.param_specs)
        ins = dict(in_shardings=(self.state_shardings, self.batch_sharding))
        self._register("step", functools.partial(steplib.train_step, self.graphdef, tx),
                       out_shardings=(self.state_shardings, replicated), donate_argnums=0, **ins)
        self._register("gradients", self._grads, out_shardings=params, **ins)
        self._register("eval_step", functools.partial(steplib.eval_step, self.graphdef),
                       out_shardings=replicated, **ins)
        return self.state_from_reference(ref)

    def _grads(self, state, batch):
        return steplib.grad_fn(state.params, self.graphdef, state.model_state, batch)[0]
