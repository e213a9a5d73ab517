"""`hybrid`: data x tensor x stage on one mesh, e.g. `--mesh data=2,tensor=2,stage=2`.

The `pipeline` strategy (GPipe or 1F1B over STAGE, stages cut by FLOPs) with each stage's
blocks split Megatron-style over TENSOR by `jaxpar.parallel.tensor.megatron` (the split
`tensor` uses), and the batch sharded over DATA (global loss denominator; gradients of
weights that are replicated over DATA summed explicitly). Either runtime (`--pipeline-impl`;
auto: mpmd on a CPU backend within one process, spmd elsewhere):

- spmd: one program over the whole mesh. A stage's parameters are two flat vectors
  (`spmd.layout`): the split leaves' local slices, sharded over STAGE and TENSOR, and the
  replicated rest, sharded over STAGE only, so the replicated weights stay invariant over
  TENSOR and the split's one backward all-reduce per sub-block happens as in `tensor`.
- mpmd: one program per stage on its data x tensor sub-mesh (`host.placement.SubMeshPlacement`):
  plain `jit` over arrays laid out on that sub-mesh, XLA placing the split's collectives (as
  in `tensor-auto`) and the sum of the gradients over DATA. Micro-batch m takes the m-th 1/M
  of every data shard's rows, so cutting micro-batches moves nothing between devices. Why:
  the SPMD program's collectives (a permute per slot, the split's all-reduces) each wait for
  every device of the mesh; with more simulated devices than cores each wait costs a
  scheduling round (stack-mlp on 4 devices: ~0.9 s a step against `single`'s 17 ms).

    python -m experiments train --strategy hybrid --mesh data=2,tensor=2,stage=2 --devices 8 \\
        --model stack-mlp --dataset synthetic --steps 20 --microbatches 2
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA, STAGE, TENSOR
from jaxpar.parallel import layout
from jaxpar.parallel.pipeline import cost
from jaxpar.parallel.pipeline.host.placement import SubMeshPlacement
from jaxpar.parallel.pipeline.spmd.layout import PaddedStages
from jaxpar.parallel.pipeline.stage_fns import StageFunctions
from jaxpar.parallel.pipeline.strategy import PipelineStrategy
from jaxpar.parallel.tensor import megatron


def split_dim(path) -> int | None:
    """The dimension of the leaf at `path` that the Megatron split cuts over TENSOR."""
    spec = megatron.param_spec(path)
    return next((i for i, axis in enumerate(spec) if axis == TENSOR), None)


class Hybrid(PipelineStrategy):
    name = "hybrid"
    family = "hybrid"
    summary = ("data x tensor x stage on one mesh: pipeline stages, Megatron-split blocks, "
               "data-sharded batch")
    models = ("stack-mlp", "vit")  # blocks that split column -> row, no batch norm
    options = ("microbatches", "schedule", "virtual_stages", "remat", "stage_boundaries", "pipeline_impl")
    data_axis = DATA
    axes = (DATA, TENSOR, STAGE)
    cost_model = staticmethod(cost.pipeline)

    @classmethod
    def runtime_kind(cls, config) -> str:
        """As `pipeline`'s, but within one process only: a stage's sub-mesh over several
        processes runs in the SPMD program."""
        chosen = super().runtime_kind(config)
        if chosen == "spmd" or jax.process_count() == 1:
            return chosen
        if config.parallel.pipeline_impl == "mpmd":
            raise ConfigError("--strategy hybrid --pipeline-impl mpmd runs within one process; "
                              "across processes use --pipeline-impl spmd (or auto)")
        return "spmd"

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

    def cuts_inside_layers(self) -> bool:
        return False  # its stages' tensor split is per layer of the model's own

    def padded_stages(self, model, rows: int) -> PaddedStages:
        return PaddedStages(model, self.plan.starts, rows, image_shape=self.image_shape, split=split_dim,
                            degree=self.mesh.shape[TENSOR],
                            split_layer=lambda m, i: megatron.split_layers(m)[i])

    def placement(self, cut):
        params = layout.abstract(steplib.split_model(cut.model)[1])
        return SubMeshPlacement(self.mesh, self.schedule, self.tx, lambda s: layout.owned(params, cut.keys[s]))

    def stage_functions(self, cut, placement) -> StageFunctions:
        fns = ShardedStageFunctions.of(cut.model, cut.ranges, cut.keys, self.tx, self.M, self.replicas, self.remat)
        return dataclasses.replace(fns, placement=placement)  # its micro-batches follow the sub-meshes

    def theory(self) -> dict[str, int]:
        return {}  # measured only: the pipeline's formula does not cover the tensor split

    def describe(self) -> dict:
        shape = meshlib.mesh_shape(self.mesh)
        out = {**super().describe(), "data": shape[DATA], "tensor": shape[TENSOR]}
        if self.implementation == "mpmd":
            out["within_stage"] = "jit over the stage's data x tensor sub-mesh (XLA's collectives)"
        return out


@dataclasses.dataclass
class ShardedStageFunctions(StageFunctions):
    """Micro-batches on a stage's sub-mesh: micro-batch m is the m-th 1/M of every data shard's
    rows (so nothing moves), and the gradient accumulators laid out as the parameters."""

    placement: SubMeshPlacement | None = None

    def _micro(self, a, s: int) -> tuple:
        d, M = self.placement.data, self.microbatches
        b = a.shape[0] // (d * M)
        parts = a.reshape(d, M, b, *a.shape[1:])
        rows = NamedSharding(self.placement.submeshes[s], P(DATA))
        return tuple(jax.lax.with_sharding_constraint(parts[:, m].reshape(d * b, *a.shape[1:]), rows)
                     for m in range(M))

    def split_images(self, r, x):
        return self._micro(x, 0)

    def split_labels(self, r, label, weight):
        last = self.stages - 1
        return self._micro(label, last), self._micro(weight, last), weight.sum()

    def zeros(self, s, params, stats):
        acc, z, sums = super().zeros(s, params, stats)
        return jax.lax.with_sharding_constraint(acc, self.placement.shardings(acc, s, "params")), z, sums
