"""What each action of a schedule costs on its own: one step walked from the host with every
program waited for before the next is dispatched, its inputs ready before its clock starts.

The stamped timeline (`timeline`) shows the order, but its callbacks and the pass that ties
each tensor to a stamp lengthen every program and leave gaps between them (a 2-stage CNN's
stamped step idled two thirds of its span), so its durations overstate the work. Here no
program is changed: each runs as the step runs it, alone on its device's thread, and its time
is its work plus its own dispatch; a pipelined step spends the rest waiting (the bubble) or
moving activations.

    took = serial_step(schedule, programs, placement, states, state, batch)
    took.actions   # {Action: seconds}: every program an action ran (a last stage's backward, run in its forward's slot: 0)
    took.outside   # {device index: seconds} of the step's programs outside any action (splits, zeros, sums)
    seconds, outside_s = medians([took, ...])   # by (kind, stage), as `schedules.timed_bubble` takes them
"""

from __future__ import annotations

import collections
import functools
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.parallel.pipeline.host.walk import Walk, drive

REPEATS = 4  # calls of each program per timing


@dataclass(frozen=True)
class SerialStep:
    actions: dict  # Action -> seconds
    outside: dict  # device index -> seconds


class SerialWalk(Walk):
    """A walk whose programs run one at a time, each timed from its ready inputs to its ready
    outputs and charged to the action being run (None: outside every action)."""

    def __init__(self, *args):
        self.action = None
        self.took: list[tuple] = []  # (action or None, device index, seconds)
        super().__init__(*args, "step")

    def run(self, action):
        self.action = action  # what the programs it runs are charged to
        super().run(action)
        self.action = None

    def prog(self, name, s, r):
        device = self.placement.device(s, r)
        program = self.programs.get(name, "step", device)
        return functools.partial(self._timed, program, self.placement.devices.index(device))

    def _timed(self, program, device: int, *args):
        # Timed over REPEATS calls dispatched back to back on copies of its arguments (a
        # program may consume them), as the step dispatches ahead of its devices: one call
        # waited for alone would also count the dispatch the step hides behind device work.
        jax.block_until_ready(args)  # arrived: waiting for another stage is not this program's time
        copies = jax.block_until_ready([jax.tree.map(_copy, args) for _ in range(REPEATS)])
        start = time.perf_counter()
        jax.block_until_ready([program(*c) for c in copies])
        self.took.append((self.action, device, (time.perf_counter() - start) / REPEATS))
        return program(*args)


def _copy(x):
    return jnp.copy(x) if isinstance(x, jax.Array) else x


def serial_step(schedule, programs, placement, states, state, batch) -> SerialStep:
    """One step's programs run and timed one at a time, the updates left out: the
    walk's gradients and statistics, as `walked_seconds` times them together."""
    w = SerialWalk(schedule, programs, placement, states, state, batch)
    drive(w)
    actions = {a: 0.0 for lst in schedule.lists for a in lst}  # some run inside another's program
    outside = collections.Counter()
    for action, device, seconds in w.took:
        if action is None:
            outside[device] += seconds
        else:
            actions[action] += seconds
    return SerialStep(actions, dict(outside))


def medians(steps: list[SerialStep]) -> tuple[dict, float]:
    """({(kind, stage): the median seconds of its actions over every step}, the median over
    steps of the most any device ran outside the actions): the times `timed_bubble` takes."""
    took: dict[tuple, list[float]] = {}
    for step in steps:
        for a, seconds in step.actions.items():
            took.setdefault((a.kind, a.stage), []).append(seconds)
    outside = [max(step.outside.values(), default=0.0) for step in steps]
    return {key: statistics.median(v) for key, v in took.items()}, statistics.median(outside)
