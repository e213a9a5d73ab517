"""What every pipeline strategy reports of its plan and schedule (`describe`, results), the
same whichever runtime runs it: one home, so `pipeline`, `gems`, `layer-split`, `hybrid` and
`mpi-pipeline` describe themselves alike."""

from __future__ import annotations

from jaxpar.parallel.pipeline.schedules import Schedule, bubble_fraction, peak_in_flight, table


def plan_facts(plan, names: list[list[str]]) -> dict:
    """The cut: where each stage starts, its layers and their training FLOPs per example."""
    return {"stages": len(plan.starts), "stage_starts": list(plan.starts), "stage_layers": names,
            "stage_flops_per_example": plan.stage_costs(), **plan.describe()}


def schedule_facts(schedule: Schedule, plan, bubble_theory: float) -> dict:
    """The table: its slots, bubble (beside its theory), micro-batches in flight per device,
    and the most the stages can speed a step up on dedicated workers."""
    rows = table(schedule)
    bubble = bubble_fraction(rows)
    return {"microbatches": schedule.microbatches, "schedule": schedule.name, "slots": len(rows),
            "virtual_stages": schedule.stages // schedule.devices, "stage_devices": list(schedule.placement[0]),
            "backward": "split into input and weight gradients" if schedule.splits_backward else "whole",
            "bubble_fraction": bubble, "bubble_theory": bubble_theory,
            "peak_in_flight_per_stage": peak_in_flight(rows),
            # on S dedicated workers (ranks, GPUs); simulated devices share the cores
            "speedup_bound": plan.speedup_bound(bubble)}
