"""`pipeline` and `gems` as programs of each stage's own, on its own device.

The formulation `--pipeline-impl auto` takes on a CPU backend (`pipeline_common`): the
machinery is `host_pipeline.HostPipeline` (which `layer-split` uses with one micro-batch);
this module says which table it walks, how many micro-batches and replicas, and what
`describe` reports (bubble, micro-batches in flight).

    python -m experiments bench --model cnn --strategy pipeline --devices 2 --microbatches 8 \\
        --schedule 1f1b --pipeline-impl mpmd
"""

from __future__ import annotations

import jax

from jaxpar import mesh as meshlib
from jaxpar.parallel.transport import processes
from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.host import HostPipeline
from jaxpar.parallel.pipeline.common import GemsFace, PipelineFace


class PipelineMPMD(PipelineFace, HostPipeline):
    @property
    def cuts_inside_layers(self) -> bool:
        """Balance (`finer`) pays where each stage has a worker of its own: accelerators, and
        processes (ranks), whose stages hand on point to point (`rank_step`'s in-program
        messages, or the host walk's `transfers`; CNN 1F1B on 2 single-threaded ranks walked
        from the host: 40-44 ms cut inside conv2; with the collective hops before transfers,
        53 ms cut inside and 58 ms after it), and simulated devices each on one thread of
        its own (`--single-thread`, as ranks are: CNN, 2 devices, 1F1B 22.9-23.0 ms cut
        inside conv2 against 30.6-40.7 after it; GPipe 32.4-33.8 against 32.3-32.7). Not on
        CPU devices sharing XLA's threads in one process: they share the cores `single`
        already fills (the bounds study, 2 devices, CNN cut inside conv2: GPipe 1.08x
        `single`, 1F1B 1.37x, against 1.22x and 1.16x cut after it in its previous run)."""
        return jax.default_backend() != "cpu" or processes.many() or meshlib.single_threaded()

    @property
    def microbatches(self) -> int:
        return self.config.parallel.microbatches

    @property
    def schedule_name(self) -> str:
        return self.config.parallel.schedule

    @property
    def remat(self) -> bool:
        return self.config.parallel.remat

    def bubble_theory(self) -> float:
        return schedules.bubble_theory(self.S, self.M)

    def _schedule_facts(self) -> dict:
        return {"microbatches": self.M, "schedule": self.schedule_name,
                "slots": len(self.table), "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": self.bubble_theory(),
                "peak_in_flight_per_stage": schedules.peak_in_flight(self.table),
                # on S dedicated workers (ranks, GPUs); simulated devices share the cores
                "speedup_bound": self.plan.speedup_bound(schedules.bubble_fraction(self.table))}

    def describe(self) -> dict:
        return {**super().describe(), **self._schedule_facts(), "remat": self.remat}

    def accounting(self, programs, state) -> dict:
        facts = self._schedule_facts()
        return {**super().accounting(programs, state),
                **{k: facts[k] for k in ("bubble_fraction", "bubble_theory")}}


class GemsMPMD(GemsFace, PipelineMPMD):
    replicas = 2

    @property
    def schedule_name(self) -> str:
        return self.name  # its table in schedules.TABLES

    @property
    def remat(self) -> bool:
        return False

    def bubble_theory(self) -> float:
        return schedules.gems_bubble_theory(self.S, self.M)

    def transfer_bytes_per_step(self) -> int:
        """The micro-batches' activations and gradients, plus each stage's gradient (and
        batch-norm statistics) sent to its other copy once a step."""
        return super().transfer_bytes_per_step() + 2 * sum(self.stage_param_bytes())

    def describe(self) -> dict:
        return {**super().describe(), "replicas": self.replicas,
                "stages_per_device": [[s, schedules.stage_of(s, 1, self.S)] for s in range(self.S)]}
