"""`gems`: two replicas of the model on the same S devices in opposite directions (GEMS / Chimera).

Memory-aware bidirectional replicas (GEMS-MAST, and Chimera's bidirectional pipelines): the
model's layers are cut into S stages as in `pipeline`; replica 0 runs stage s on device s,
replica 1 runs stage s on device S-1-s, so every device holds two stages (s and S-1-s),
one of each replica. Micro-batches [0, M/2) of the global batch go down replica 0 and
[M/2, M) up replica 1, as the `gems` schedule lists them: while one replica fills or drains
its pipeline, the other's forwards and backwards run on the devices it leaves idle, so the
bubble is smaller than GPipe's or 1F1B's at the same M (even S; tested), and each replica's
stage s keeps at most S - s stage inputs, so a device holds at most S, as 1F1B's busiest
stage. The price is memory for parameters: every device stores two stages' parameters and
optimizer state.

What equals `single`: after the schedule, each device adds to its copy of a stage's gradient
the other replica's copy of that stage's gradient (an exchange between devices d and S-1-d),
so both copies receive the gradient of the whole global batch and take the same optimizer
update: the two replicas stay one model. Batch norm runs per micro-batch, as in `pipeline`.

    python -m experiments train --strategy gems --mesh stage=2 --devices 2 --model cnn \\
        --microbatches 4 --dataset synthetic --steps 50
"""

from __future__ import annotations

from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline import cost
from jaxpar.parallel.pipeline.schedules import gems_bubble_theory
from jaxpar.parallel.pipeline.strategy import PipelineStrategy


class Gems(PipelineStrategy):
    name = "gems"
    summary = ("two model replicas on the same `stage` devices in opposite directions, each "
               "filling the other's bubble (GEMS / Chimera); `--microbatches M` split between them")
    options = ("microbatches", "stage_boundaries", "pipeline_impl")
    multiprocess = False  # not yet tested on a mesh over processes (pipeline is)
    cost_model = staticmethod(cost.gems)
    replicas = 2

    @classmethod
    def check(cls, config, axes):
        problems = super().check(config, axes)
        stages, m = axes.get(STAGE, 1), config.parallel.microbatches
        if stages % 2:
            problems.append(f"--strategy gems pairs device d with device S-1-d; --mesh {STAGE}={stages} "
                            f"is odd (the middle device would hold one stage twice and no bubble is "
                            f"saved): use an even number of stages.")
        if m % 2:
            problems.append(f"--microbatches {m} must be even for --strategy gems: half of them go down "
                            f"each replica.")
        return problems

    @classmethod
    def schedule_of(cls, config) -> str:
        return "gems"

    @property
    def remat(self) -> bool:
        return False

    def bubble_theory(self) -> float:
        return gems_bubble_theory(self.S, self.M)
