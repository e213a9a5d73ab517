"""`single`: the whole step on one device with plain `jit`, the reference for every strategy.

Every strategy is tested against it (tests/equivalence.py).

    python -m experiments train --strategy single --model mlp --dataset synthetic --steps 20
"""

from __future__ import annotations

import functools

import jax
import optax
from flax import nnx

from jaxpar.cost import Problem, Work
from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.parallel.base import Strategy


def single_cost(p: Problem) -> Work:
    """The whole step on one device: `single`'s measured step at the batch."""
    c = p.compute
    return Work((c.step_s(p.batch),), (), c.state_bytes, c.temp_bytes(p.batch))


class Single(Strategy):
    name = "single"
    cost_model = staticmethod(single_cost)
    family = "reference"
    summary = "the whole step on one device, plain `jit`"
    default_axes = {meshlib.DATA: 1}
    axes = ()
    options = ("steps_per_dispatch",)

    @classmethod
    def mesh_axes(cls, spec, devices):
        if any(size not in (1, -1) for size in meshlib.parse_mesh(spec).values()):
            raise meshlib.MeshError(f"--strategy single runs on one device; drop --mesh {spec!r} "
                                    "or pick a parallel --strategy")
        return {meshlib.DATA: 1}  # the first device, however many are present

    def init(self, model: nnx.Module, tx: optax.GradientTransformation, mesh):
        self.mesh, self.tx = mesh, tx
        self.device = mesh.devices.flat[0]
        self.graphdef, params, model_state = steplib.split_model(model)
        state = jax.device_put(steplib.init_state(params, model_state, tx), self.device)
        self._register("step", functools.partial(steplib.train_step, self.graphdef, tx),
                       donate_argnums=0)
        self._register("eval_step", functools.partial(steplib.eval_step, self.graphdef))
        self._register("gradients", self._gradients)
        return state

    def _gradients(self, state, batch):
        grads, _ = steplib.grad_fn(state.params, self.graphdef, state.model_state, batch)
        return grads

    def state_from_reference(self, ref):
        return jax.device_put(ref, self.device)

    def place_batch(self, batch):
        return jax.device_put(batch, self.device)

    def theory(self) -> dict[str, int]:
        return {"total": 0}  # one device: nothing to communicate
