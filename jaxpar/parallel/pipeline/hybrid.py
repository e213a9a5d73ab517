"""`hybrid`: data x tensor x stage on one mesh, e.g. `--mesh data=2,tensor=2,stage=2`.

The `pipeline` strategy (GPipe or 1F1B over STAGE, stages cut by FLOPs) with each stage's
blocks split Megatron-style over TENSOR by `jaxpar.parallel.tensor.megatron` (the split `tensor`
uses), and the batch sharded over DATA (global loss denominator; gradients of weights that
are replicated over DATA summed explicitly). Two formulations, as `pipeline` has
(`--pipeline-impl`; auto: mpmd on a CPU backend within one process, spmd elsewhere):

- spmd (this module): one program over the whole mesh. A stage's parameters are two flat
  vectors (`jaxpar.parallel.pipeline.padded`): the split leaves' local slices, sharded over STAGE and
  TENSOR, and the replicated rest, sharded over STAGE only, so the replicated weights stay
  invariant over TENSOR and the split's one backward all-reduce per sub-block happens as in
  `tensor`.
- mpmd (`hybrid_mpmd`): one program per stage on its data x tensor sub-mesh, the schedule
  walked from the host (`host_pipeline`).

    python -m experiments train --strategy hybrid --mesh data=2,tensor=2,stage=2 --devices 8 \\
        --model stack-mlp --dataset synthetic --steps 20 --microbatches 2
"""

from __future__ import annotations

import jax

from jaxpar.errors import ConfigError
from jaxpar.mesh import TENSOR
from jaxpar.parallel.tensor import megatron
from jaxpar.parallel.pipeline.hybrid_mpmd import HybridMPMD
from jaxpar.parallel.pipeline.pipeline import Pipeline
from jaxpar.parallel.pipeline.common import HybridFace
from jaxpar.parallel.pipeline.padded import Stages


def split_dim(path) -> int | None:
    """The dimension of the leaf at `path` that the Megatron split cuts over TENSOR."""
    spec = megatron.param_spec(path)
    return next((i for i, axis in enumerate(spec) if axis == TENSOR), None)


class Hybrid(HybridFace, Pipeline):
    """The SPMD formulation, and the strategy's entry in the registry (`formulation` picks)."""

    host_formulation = HybridMPMD

    @classmethod
    def formulation(cls, config):
        """As `pipeline`'s, but within one process only: a stage's sub-mesh over several
        processes runs in the SPMD program."""
        chosen = super().formulation(config)
        if chosen is cls or jax.process_count() == 1:
            return chosen
        if config.parallel.pipeline_impl == "mpmd":
            raise ConfigError("--strategy hybrid --pipeline-impl mpmd runs within one process; "
                              "across processes use --pipeline-impl spmd (or auto)")
        return cls

    def _stages(self, model) -> Stages:
        return Stages(model, self.starts, self.rows, image_shape=self.image_shape, split=split_dim,
                      degree=self.mesh.shape[TENSOR], split_layer=lambda m, i: megatron.split_layers(m)[i])

    def theory(self) -> dict[str, int]:
        return {}  # measured only: the pipeline's formula does not cover the tensor split

    def describe(self) -> dict:
        return {**super().describe(), **self.mesh_facts()}
