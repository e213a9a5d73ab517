"""A pipeline schedule as data: per device, the ordered list of what it computes.

    Action("F", microbatch=3, stage=1)          # forward of micro-batch 3 through stage 1
    Action("B", microbatch=3, stage=1)          # its backward (input and weight gradients)
    Action("I", 3, 1), Action("W", 3, 1)        # or its backward in two: input, then weights
    schedule.lists[d]                            # device d's actions, in the order it runs them
    schedule.device_of(stage, replica)           # where a stage (of a replica copy) lives

A stage is a consecutive run of the model's layers (`partition`); `placement[r][s]` is the
device holding stage s of replica copy r (GEMS keeps two copies of the model on the same
devices, the second in reverse order; interleaved schedules put several stages, "virtual
stages", on each device). Micro-batch m belongs to replica `m // (M / R)`.
Nothing here runs anything: a runtime executes the lists (`runtime/`), `timing` replays them
slot by slot (the table view, the bubble, the peak of micro-batches in flight) and refuses a
list that waits forever, `messages` lowers them to sends and receives.

The backward of a (micro-batch, stage) is one action "B", or two (zero-bubble schedules): "I"
the input gradient, on the critical path (what the previous stage waits for), and "W" the
weight gradient, which needs only its "I" and can fill a bubble later.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from jaxpar.errors import ConfigError

FORWARD, BACKWARD, INPUT, WEIGHT = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, INPUT, WEIGHT)


class ScheduleError(ConfigError):
    """A schedule that cannot run: an action missing or repeated, on the wrong device, or
    waiting for one that never comes."""


class Action(NamedTuple):
    kind: str          # "F" | "B" | "I" | "W"
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

    @functools.cached_property
    def _split(self) -> frozenset:
        """(micro-batch, stage, replica) whose backward is split into I and W."""
        return frozenset((a.microbatch, a.stage, a.replica) for lst in self.lists for a in lst if a.kind == INPUT)

    def backward_kind(self, microbatch: int, stage: int, replica: int = 0) -> str:
        """"I" where this (micro-batch, stage)'s backward is split, else "B"."""
        return INPUT if (microbatch, stage, replica) in self._split else BACKWARD

    @property
    def splits_backward(self) -> bool:
        return bool(self._split)

    @property
    def stages_per_device(self) -> int:
        return self.stages * self.replicas // self.devices

    def is_fill_drain(self) -> bool:
        """Every device runs all its forwards, then all its backwards, in micro-batch order
        (GPipe): the order `jax.grad` of a forward loop runs them in."""
        M = self.microbatches
        return self.replicas == 1 and all(
            [(a.kind, a.microbatch) for a in lst] == [(FORWARD, m) for m in range(M)] + [(BACKWARD, m) for m in range(M)]
            for lst in self.lists)


def consumer(action: Action, schedule: Schedule) -> Action | None:
    """The action that takes what `action` hands on: a forward's output goes to the next
    stage's forward; a backward's (or input gradient's) to the previous stage's backward (or
    input gradient); a weight gradient hands on nothing."""
    a, last = action, schedule.stages - 1
    if a.kind == FORWARD:
        return a._replace(stage=a.stage + 1) if a.stage < last else None
    if a.kind == WEIGHT or a.stage == 0:
        return None
    return Action(schedule.backward_kind(a.microbatch, a.stage - 1, a.replica), a.microbatch, a.stage - 1, a.replica)


def needs(action: Action, schedule: Schedule) -> list[Action]:
    """The actions whose results `action` takes: the previous stage's forward; a backward (or
    input gradient) also its own forward and the next stage's backward (or input gradient);
    a weight gradient its own input gradient (whose work it reuses)."""
    a, last = action, schedule.stages - 1
    if a.kind == FORWARD:
        return [a._replace(stage=a.stage - 1)] if a.stage > 0 else []
    if a.kind == WEIGHT:
        return [a._replace(kind=INPUT)]
    out = [a._replace(kind=FORWARD)]
    if a.stage < last:
        out.append(Action(schedule.backward_kind(a.microbatch, a.stage + 1, a.replica), a.microbatch,
                          a.stage + 1, a.replica))
    return out
