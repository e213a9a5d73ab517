"""A pipeline schedule as data: per device, the ordered list of what it computes.

    Action("F", microbatch=3, stage=1)          # forward of micro-batch 3 through stage 1
    Action("B", microbatch=3, stage=1)          # its backward (input and weight gradients)
    schedule.lists[d]                            # device d's actions, in the order it runs them
    schedule.device_of(stage, replica)           # where a stage (of a replica copy) lives

A stage is a consecutive run of the model's layers (`partition`); `placement[r][s]` is the
device holding stage s of replica copy r (GEMS keeps two copies of the model on the same
devices, the second in reverse order). Micro-batch m belongs to replica `m // (M / R)`.
Nothing here runs anything: a runtime executes the lists (`runtime/`), `timing` replays them
slot by slot (the table view, the bubble, the peak of micro-batches in flight) and refuses a
list that waits forever, `messages` lowers them to sends and receives.

The kinds leave room for the backward split in two (zero-bubble schedules): "I" the input
gradient, on the critical path, and "W" the weight gradient, deferrable.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxpar.errors import ConfigError

FORWARD, BACKWARD = "F", "B"
KINDS = (FORWARD, BACKWARD)


class ScheduleError(ConfigError):
    """A schedule that cannot run: an action missing or repeated, on the wrong device, or
    waiting for one that never comes."""


class Action(NamedTuple):
    kind: str          # "F" | "B"
    microbatch: int
    stage: int
    replica: int = 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per device, the ordered actions of one training step.

    Attributes:
      name: the generator's name ("gpipe", "1f1b", "gems").
      microbatches: M, all replicas together.
      placement: placement[r][s] = the device of stage s of replica r.
      lists: lists[d] = device d's actions in order.
    """
    name: str
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    lists: tuple[tuple[Action, ...], ...]

    @property
    def devices(self) -> int:
        return len(self.lists)

    @property
    def stages(self) -> int:
        return len(self.placement[0])

    @property
    def replicas(self) -> int:
        return len(self.placement)

    def device_of(self, stage: int, replica: int = 0) -> int:
        return self.placement[replica][stage]

    def per_replica(self) -> int:
        """Micro-batches each replica copy takes."""
        return self.microbatches // self.replicas

    def replica_of(self, microbatch: int) -> int:
        return microbatch // self.per_replica()

    def is_fill_drain(self) -> bool:
        """Every device runs all its forwards, then all its backwards, in micro-batch order
        (GPipe): the order `jax.grad` of a forward loop runs them in."""
        M = self.microbatches
        return self.replicas == 1 and all(
            [(a.kind, a.microbatch) for a in lst] == [(FORWARD, m) for m in range(M)] + [(BACKWARD, m) for m in range(M)]
            for lst in self.lists)


def consumer(action: Action, stages: int) -> Action | None:
    """The action that takes what `action` produces: a forward's output goes to the next
    stage's forward; a backward's input gradient to the previous stage's backward."""
    if action.kind == FORWARD:
        return action._replace(stage=action.stage + 1) if action.stage < stages - 1 else None
    return action._replace(stage=action.stage - 1) if action.stage > 0 else None


def needs(action: Action, stages: int) -> list[Action]:
    """The actions whose results `action` takes: the previous stage's forward; a backward
    also its own forward (what it differentiates) and the next stage's backward."""
    a = action
    if a.kind == FORWARD:
        return [a._replace(stage=a.stage - 1)] if a.stage > 0 else []
    out = [a._replace(kind=FORWARD)]
    return out + ([a._replace(stage=a.stage + 1)] if a.stage < stages - 1 else [])
