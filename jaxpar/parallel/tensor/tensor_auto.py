"""`tensor-auto`: the `tensor` split as PartitionSpecs under plain `jit`; XLA places collectives.

The Megatron sharding written only as PartitionSpecs on the parameters (and their optimizer
moments), with plain `jit` over the unchanged shared step: the compiler (GSPMD) places the
collectives. Its measured collective bytes are reported beside the explicit version's
theory; where they differ, that is XLA's choice, and a finding.

    python -m experiments bench --strategy tensor-auto --mesh tensor=2 --devices 2 \
        --model stack-mlp --width 64 --depth 4
"""

from __future__ import annotations

import functools

from jaxpar import step as steplib
from jaxpar.parallel.tensor.tensor import _TensorBase


class TensorAuto(_TensorBase):
    name = "tensor-auto"
    summary = ("the same split as `NamedSharding`s on the parameters, plain `jit`; XLA places "
               "the collectives")

    def _build_programs(self):
        batch = {k: self.batch_sharding for k in ("image", "label", "weight")}
        self._register("step", functools.partial(steplib.train_step, self.graphdef, self.tx),
                       in_shardings=(self.shardings, batch),
                       out_shardings=(self.shardings, self.replicated), donate_argnums=0)
        self._register("gradients", self._gradients, in_shardings=(self.shardings, batch),
                       out_shardings=self.shardings.params)
        self._register("eval_step", functools.partial(steplib.eval_step, self.graphdef),
                       in_shardings=(self.shardings, batch), out_shardings=self.replicated)

    def _gradients(self, state, batch):
        grads, _ = steplib.grad_fn(state.params, self.graphdef, state.model_state, batch)
        return grads
