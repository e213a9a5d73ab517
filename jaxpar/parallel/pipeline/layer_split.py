"""`layer-split`: naive model parallelism, consecutive layers on consecutive devices.

The model parallelism of the early papers: the model's layers (`model.layers()`, any model)
are cut into S consecutive stages balanced by FLOPs (`partition`, or `--stage-boundaries`);
stage s lives on device s, and one whole batch goes through them in turn, so one device works
at a time: the baseline a pipeline beats.

It is the pipeline with one micro-batch, always as programs of each stage's own (the host
runtime): stages of any shapes need no padding, a forward returns its output and its
`jax.vjp` (the residuals stay on the stage's device), a backward applies that vjp to the
incoming gradient (no recomputed forward: each FLOP once), and an optimizer update with the
shared `apply_update` runs over that stage's parameters and optimizer state. Activations and
their gradients move between devices; there are no collectives. Batch norm sees the whole
batch, as in `single`.

    python -m experiments train --strategy layer-split --mesh stage=2 --devices 2 \\
        --model cnn --dataset synthetic --steps 20
"""

from __future__ import annotations

from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline import cost, partition
from jaxpar.parallel.pipeline.strategy import PipelineStrategy


class LayerSplit(PipelineStrategy):
    name = "layer-split"
    summary = ("the naive baseline: consecutive layers on consecutive devices, one batch at a "
               "time, separate programs per stage")
    options = ("stage_boundaries",)
    batch_norm_per_shard = False  # one micro-batch: the whole batch, as `single`
    cost_model = staticmethod(cost.layer_split)

    @classmethod
    def runtime_kind(cls, config) -> str:
        return "mpmd"

    @classmethod
    def check(cls, config, axes):
        return partition.boundary_problems(config.parallel.stage_boundaries,
                                           partition.layer_names(config.model), axes.get(STAGE, 1))

    @classmethod
    def microbatches_of(cls, config) -> int:
        return 1

    @classmethod
    def schedule_of(cls, config) -> str:
        return "gpipe"

    @property
    def remat(self) -> bool:
        return False

    def cuts_inside_layers(self) -> bool:
        return False

    def describe(self):
        return {**super().describe(),
                "note": "one batch at a time, one device busy at a time; activations move "
                        "with device_put (no collectives); each stage's backward applies the "
                        "vjp its forward kept (no recomputed forward)"}
