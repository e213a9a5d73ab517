"""`gems`: two replicas of the model on the same S devices in opposite directions (GEMS / Chimera).

Memory-aware bidirectional replicas (GEMS-MAST, and Chimera's bidirectional pipelines): the
model's layers are cut into S stages as in `pipeline`; replica 0 runs stage s on device s,
replica 1 runs stage s on device S-1-s, so every device holds two stages (s and S-1-s),
one of each replica. Micro-batches [0, M/2) of the global batch go down replica 0 and
[M/2, M) up replica 1, slot by slot as `schedules.gems` says: while one replica fills or
drains its pipeline, the other's forwards and backwards run on the devices it leaves idle,
so the bubble is smaller than GPipe's or 1F1B's at the same M (even S; tested), and each
replica's stage s keeps at most S - s stage inputs, so a device holds at most S, as
1F1B's busiest stage. The price is memory for parameters: every device stores two stages'
parameters and optimizer state.

What equals `single`: after the slot loop, each device adds to its copy of a stage's
gradient the other replica's copy of that stage's gradient (one `ppermute` between devices
d and S-1-d), so both copies receive the gradient of the whole global batch (both
replicas' micro-batches: one global batch, one denominator) and take the same optimizer
update: the two replicas stay one model. Step-1 gradients, parameters after SGD steps and
the losses equal `single` on the same global batch (tested), batch norm aside: as in
`pipeline`, it normalises each micro-batch by its own statistics.

    python -m experiments train --strategy gems --mesh stage=2 --devices 2 --model cnn \\
        --microbatches 4 --dataset synthetic --steps 50
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.pipeline import F32, Pipeline
from jaxpar.parallel.pipeline.common import GemsFace
from jaxpar.parallel.pipeline.mpmd import GemsMPMD
from jaxpar.parallel.pipeline.padded import Stages


class Gems(GemsFace, Pipeline):
    copies = 2
    host_formulation = GemsMPMD

    @property
    def schedule_name(self) -> str:
        return self.name  # its table in schedules.TABLES

    def _stages(self, model) -> Stages:
        return Stages(model, self.starts, self.rows, image_shape=self.image_shape,
                      replicas=lambda d: [d, schedules.stage_of(d, 1, self.S)])

    def _combine(self, grads, z_sum):
        """Each stage's two copies (on devices d and S-1-d) get the sum of both replicas'
        gradients (and batch-norm statistics): one exchange with the mirror device."""
        pairs = [(d, schedules.stage_of(d, 1, self.S)) for d in range(self.S)]
        theirs = lax.ppermute((grads, z_sum), STAGE, pairs)
        # the mirror holds the same two stages in the other order of copies
        add = lambda mine, other: mine + jnp.flip(other, axis=-2)  # noqa: E731
        return jax.tree.map(add, grads, theirs[0]), jax.tree.map(add, z_sum, theirs[1])

    def bubble_theory(self) -> float:
        return schedules.gems_bubble_theory(self.S, self.M)

    def theory(self) -> dict[str, int]:
        """The slot loop's sends (as `pipeline`), plus the exchange of every device's gradient
        and batch-norm statistics vectors (both copies) with its mirror."""
        out = super().theory()
        vectors = sum(layout.width[k] for layout in (self.stages.params, self.stages.state)
                      for k in layout.kinds)
        mirror = self.copies * vectors * F32
        out["collective-permute"] += mirror
        out["total"] += mirror
        return out

    def describe(self) -> dict:
        return {**super().describe(), "replicas": self.copies,
                "stages_per_device": [[s, schedules.stage_of(s, 1, self.S)] for s in range(self.S)]}
