"""`hybrid`: data x tensor x stage on one mesh, e.g. `--mesh data=2,tensor=2,stage=2`.

The `pipeline` strategy (GPipe or 1F1B over STAGE, stages cut by FLOPs) with each stage's
blocks split Megatron-style over TENSOR by `jaxpar.parallel.megatron` (the split `tensor`
uses), and the batch sharded over DATA (global loss denominator; gradients of weights that
are replicated over DATA summed explicitly). A stage's parameters are two flat vectors
(`jaxpar.parallel.stages`): the split leaves' local slices, sharded over STAGE and TENSOR,
and the replicated rest, sharded over STAGE only, so the replicated weights stay invariant
over TENSOR and the split's one backward all-reduce per sub-block happens as in `tensor`.

    python -m experiments train --strategy hybrid --mesh data=2,tensor=2,stage=2 --devices 8 \\
        --model stack-mlp --dataset synthetic --steps 20 --microbatches 2
"""

from __future__ import annotations


from jaxpar import mesh as meshlib
from jaxpar.mesh import DATA, STAGE, TENSOR
from jaxpar.parallel import megatron
from jaxpar.parallel.pipeline import Pipeline
from jaxpar.parallel.stages import Stages


def split_dim(path) -> int | None:
    """The dimension of the leaf at `path` that the Megatron split cuts over TENSOR."""
    spec = megatron.param_spec(path)
    return next((i for i, axis in enumerate(spec) if axis == TENSOR), None)


class Hybrid(Pipeline):
    name = "hybrid"
    family = "hybrid"
    summary = ("data x tensor x stage on one mesh: pipeline stages, Megatron-split blocks, "
               "data-sharded batch")
    models = ("stack-mlp", "vit")  # blocks that split column -> row, no batch norm
    data_axis = DATA
    axes = (DATA, TENSOR, STAGE)
    # one SPMD program only: each stage's tensor split is a collective over its TENSOR devices
    options = tuple(o for o in Pipeline.options if o != "pipeline_impl")
    host_formulation = None

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

    def _stages(self, model) -> Stages:
        return Stages(model, self.starts, self.rows, image_shape=self.image_shape, split=split_dim, degree=self.mesh.shape[TENSOR],
                      split_layer=lambda m, i: megatron.split_layers(m)[i])

    def theory(self) -> dict[str, int]:
        return {}  # measured only: the pipeline's formula does not cover the tensor split

    def describe(self) -> dict:
        shape = meshlib.mesh_shape(self.mesh)
        return {**super().describe(), "data": shape[DATA], "tensor": shape[TENSOR]}
