"""`hybrid`: data x tensor x stage on one mesh, e.g. `--mesh data=2,tensor=2,stage=2`.

The `pipeline` strategy (GPipe or 1F1B over STAGE) with each stage's residual blocks split
Megatron-style over TENSOR (`up` by output column, `down` by input row, one psum per block
forward; the backward's psum is the transpose of the block input's implicit cast to
varying), and the batch sharded over DATA (global loss denominator; gradients of weights
that are replicated over DATA summed explicitly). Supports stack-mlp.

    python -m experiments train --strategy hybrid --mesh data=2,tensor=2,stage=2 --devices 8 \\
        --model stack-mlp --dataset synthetic --steps 20 --microbatches 2
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as meshlib
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA, STAGE, TENSOR
from jaxpar.models.mlp import ACTIVATIONS
from jaxpar.parallel.base import model_option
from jaxpar.parallel.pipeline import Pipeline

_SPLIT = {("up", "kernel"): P(STAGE, None, TENSOR), ("up", "bias"): P(STAGE, TENSOR),
          ("down", "kernel"): P(STAGE, TENSOR, None)}


class Hybrid(Pipeline):
    name = "hybrid"
    family = "hybrid"
    summary = ("data x tensor x stage on one mesh: pipeline stages, Megatron-split blocks, "
               "data-sharded batch")
    models = ("stack-mlp",)  # its Megatron split knows the stack-mlp block
    data_axis = DATA
    axes = (DATA, TENSOR, STAGE)

    @classmethod
    def check(cls, config, axes):
        degree, width = axes.get(TENSOR, 1), model_option(config, "width")
        split = [] if width % degree == 0 else [
            f"--width {width} is not divisible by the tensor degree {degree}; change --width or "
            "tensor= in --mesh."]
        return super().check(config, axes) + split

    @classmethod
    def default_mesh(cls, devices):
        """2 stages; tensor=2 when 4 devices divide; data = the rest (4: tensor=2 x stage=2,
        8: data=2 x tensor=2 x stage=2)."""
        tensor = 2 if devices % 4 == 0 else 1
        return meshlib.resolve_axes({DATA: -1, TENSOR: tensor, STAGE: 2}, devices)

    @classmethod
    def mesh_axes(cls, spec, devices):
        axes = super().mesh_axes(spec, devices)
        return {a: axes.get(a, 1) for a in meshlib.AXES}  # all three present: specs name them

    def init(self, model, tx, mesh):
        T = mesh.shape[TENSOR]
        width = model.blocks[0].up.in_features
        if width % T:
            raise ConfigError(f"--width {width} is not divisible by the tensor degree {T}; change "
                              "--width or tensor= in --mesh")
        self.activation = ACTIVATIONS[model.blocks[0].activation]
        return super().init(model, tx, mesh)

    def _block_spec(self, path, leaf) -> P:
        keys = tuple(getattr(k, "key", k) for k in path)
        return _SPLIT.get(keys[-2:], P(STAGE))

    def _block(self, p, h):
        partial = self.activation(h @ p["up"]["kernel"] + p["up"]["bias"]) @ p["down"]["kernel"]
        return h + lax.psum(partial, TENSOR) + p["down"]["bias"]  # bias once, after the sum

    def theory(self) -> dict[str, int]:
        return {}  # measured only: the pipeline's formula does not cover the tensor split

    def describe(self) -> dict:
        shape = meshlib.mesh_shape(self.mesh)
        return {**super().describe(), "data": shape[DATA], "tensor": shape[TENSOR]}
