"""`hybrid`: data x tensor x stage on one mesh, e.g. `--mesh data=2,tensor=2,stage=2`.

The `pipeline` strategy (GPipe or 1F1B over STAGE) with each stage's blocks split
Megatron-style over TENSOR by `jaxpar.parallel.megatron` (the split `tensor` uses), and the
batch sharded over DATA (global loss denominator; gradients of weights that are replicated
over DATA summed explicitly).

    python -m experiments train --strategy hybrid --mesh data=2,tensor=2,stage=2 --devices 8 \\
        --model stack-mlp --dataset synthetic --steps 20 --microbatches 2
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as meshlib
from jaxpar.mesh import DATA, STAGE, TENSOR
from jaxpar.parallel import megatron
from jaxpar.parallel.pipeline import Pipeline


class Hybrid(Pipeline):
    name = "hybrid"
    family = "hybrid"
    summary = ("data x tensor x stage on one mesh: pipeline stages, Megatron-split blocks, "
               "data-sharded batch")
    models = ("stack-mlp", "vit")  # identical blocks that stack into stages and split column -> row
    data_axis = DATA
    axes = (DATA, TENSOR, STAGE)

    @classmethod
    def check(cls, config, axes):
        return super().check(config, axes) + megatron.split_problems(config, axes.get(TENSOR, 1), cls.name)

    @classmethod
    def default_mesh(cls, devices):
        """2 stages; tensor=2 when 4 devices divide; data = the rest (4: tensor=2 x stage=2,
        8: data=2 x tensor=2 x stage=2)."""
        tensor = 2 if devices % 4 == 0 else 1
        return meshlib.resolve_axes({DATA: -1, TENSOR: tensor, STAGE: 2}, devices)

    @classmethod
    def mesh_axes(cls, spec, devices):
        axes = super().mesh_axes(spec, devices)
        # All three present (specs name them), in the order given (outermost first).
        return {**{a: 1 for a in meshlib.AXES if a not in axes}, **axes}

    def init(self, model, tx, mesh):
        megatron.check_divisible(model, mesh.shape[TENSOR], self.name)
        return super().init(model, tx, mesh)

    def _block_spec(self, path, leaf) -> P:
        # Blocks are stacked [L, ...] over STAGE; each one's layers split as in `tensor`.
        layer, kind = (getattr(k, "key", k) for k in path[-2:])
        return megatron.leaf_spec(layer, kind, lead=(STAGE,))

    def _block(self, block_params, h):
        return megatron.block(nnx.merge(self.block_graphdef, block_params, self.block_rest), h)

    def theory(self) -> dict[str, int]:
        return {}  # measured only: the pipeline's formula does not cover the tensor split

    def describe(self) -> dict:
        shape = meshlib.mesh_shape(self.mesh)
        return {**super().describe(), "data": shape[DATA], "tensor": shape[TENSOR]}
