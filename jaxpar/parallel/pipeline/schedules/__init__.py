"""Pipeline schedules as data: per device, an ordered list of actions (`actions`), one
generator per schedule (`generators`), replayed and validated once (`timing`: the table, the
bubble, micro-batches in flight, deadlock), and lowered to sends and receives in an order
that cannot deadlock (`messages`). Every pipeline runtime executes any schedule built here.

    schedule = build("1f1b", devices=4, microbatches=8)   # validated
    table(schedule)          # rows of ("F" | "B", micro-batch) per device: the figures' view
    lower(schedule)          # per device: actions, Send, Recv
"""

import functools

from jaxpar.parallel.pipeline.schedules.actions import (BACKWARD, FORWARD, Action, Schedule,
                                                         ScheduleError, consumer, needs)
from jaxpar.parallel.pipeline.schedules.generators import FIXED_VIRTUAL, GENERATORS, SCHEDULES, VIRTUAL
from jaxpar.parallel.pipeline.schedules.messages import Message, Recv, Send, lower, message, sent_early
from jaxpar.parallel.pipeline.schedules.timing import (bubble_fraction, bubble_theory, check,
                                                        gems_bubble_theory, op, peak_in_flight,
                                                        rows, simulate, table, timed_bubble,
                                                        timed_idle)


def virtual_stages(name: str, given: int = 0) -> int:
    """Stages per device of schedule `name`: `given` (--virtual-stages), or 0 for its own."""
    own = VIRTUAL.get(name, 1)
    if given and given != own and name in FIXED_VIRTUAL:
        raise ScheduleError(f"--schedule {name} holds {own} stage(s) per device; drop --virtual-stages "
                            f"{given} (interleaved-1f1b, looped-bfs and zb-h1 take any)")
    return given or own


@functools.lru_cache(maxsize=512)
def build(name: str, devices: int, microbatches: int, virtual: int = 0) -> Schedule:
    """Schedule `name` for `devices` devices and `microbatches` micro-batches (and `virtual`
    stages per device; 0: the schedule's own), validated. Built once per arguments (a
    Schedule is immutable): `plan` prices thousands of pipelines."""
    return check(GENERATORS[name](devices, microbatches, virtual_stages(name, virtual)))


__all__ = ["BACKWARD", "FIXED_VIRTUAL", "FORWARD", "GENERATORS", "SCHEDULES", "VIRTUAL", "virtual_stages", "Action", "Message", "Recv", "Schedule",
           "ScheduleError", "Send", "build", "bubble_fraction", "bubble_theory", "check", "consumer",
           "gems_bubble_theory", "lower", "message", "needs", "op", "peak_in_flight", "rows", "sent_early",
           "simulate", "table", "timed_bubble", "timed_idle"]
