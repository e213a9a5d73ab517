"""`pipeline`: any model's layers cut into S stages over the STAGE axis, GPipe or 1F1B.

The model's layers (`model.layers()`) are cut into S consecutive stages balanced by FLOPs
(`partition`, or `--stage-boundaries`); stage s lives on device s. The global batch is cut
into M micro-batches that the schedule (`schedules`: GPipe fill-drain, or 1F1B, which keeps
at most S - s micro-batches in flight on stage s) moves through the stages, on one SPMD
program or one program per stage (`strategy`: `--pipeline-impl`).

Batch norm inside a stage normalises with each micro-batch's own statistics (M > 1 differs
from `single`, which normalises over the whole batch); the running statistics move once a
step, by the mean of the micro-batches' updates.

    python -m experiments train --strategy pipeline --mesh stage=2 --devices 2 \\
        --model cnn --microbatches 4 --schedule 1f1b --dataset synthetic --steps 50
"""

from __future__ import annotations

from jaxpar.parallel.pipeline import cost
from jaxpar.parallel.pipeline.strategy import PipelineStrategy


class Pipeline(PipelineStrategy):
    name = "pipeline"
    summary = ("any model's layers cut into stages balanced by FLOPs, one per device over "
               "`stage`; `--microbatches M`, `--schedule gpipe|1f1b|interleaved-1f1b|looped-bfs|zb-h1|zbv|dualpipev`, `--virtual-stages V`, `--remat`, "
               "`--stage-boundaries`; stages as one SPMD program or one program each "
               "(`--pipeline-impl`)")
    options = ("microbatches", "schedule", "virtual_stages", "remat", "stage_boundaries", "pipeline_impl")
    cost_model = staticmethod(cost.pipeline)  # at its bound, either runtime
