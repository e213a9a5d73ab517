"""`layer-split`: naive model parallelism, consecutive layers on consecutive devices.

The model parallelism of the early papers: the model's layers (`model.layers()`, any model)
are cut into S consecutive stages balanced by FLOPs (`jaxpar.parallel.pipeline.partition`, or
`--stage-boundaries`); stage s lives on device s, and one whole batch goes through them in
turn, so one device works at a time: the baseline a pipeline beats.

It is the host-driven pipeline (`jaxpar.parallel.pipeline.host`) with one micro-batch: each
stage has its own jitted programs on its own device, so stages of any shapes need no padding:
a forward that returns its output and its `jax.vjp` (the residuals stay on the stage's
device), a backward that applies that vjp to the incoming gradient (no recomputed forward:
each FLOP once), and an optimizer update with the shared `apply_update` over that stage's
parameters and optimizer state. Activations and their gradients move between devices with
`device_put`; there are no collectives. Batch norm sees the whole batch, as in `single`.

    python -m experiments train --strategy layer-split --mesh stage=2 --devices 2 \\
        --model cnn --dataset synthetic --steps 20
"""

from __future__ import annotations

from jaxpar.parallel.pipeline import cost
from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline import partition
from jaxpar.parallel.pipeline.host import HostPipeline


class LayerSplit(HostPipeline):
    name = "layer-split"
    summary = ("the naive baseline: consecutive layers on consecutive devices, one batch at a "
               "time, separate programs per stage")
    options = ("stage_boundaries",)
    # Stages on the devices of one global mesh under jax.distributed; between processes an
    # activation moves point to point (`processes.move`).
    multiprocess = True
    cost_model = staticmethod(cost.layer_split)

    @classmethod
    def check(cls, config, axes):
        return partition.boundary_problems(config.parallel.stage_boundaries,
                                           partition.layer_names(config.model), axes.get(STAGE, 1))

    def describe(self):
        return {**super().describe(),
                "note": "one batch at a time, one device busy at a time; activations move "
                        "with device_put (no collectives); each stage's backward applies the "
                        "vjp its forward kept (no recomputed forward)"}
