"""Pipeline schedules as data: per device, an ordered list of actions (`actions`), one
generator per schedule (`generators`), replayed and validated once (`timing`: the table, the
bubble, micro-batches in flight, deadlock), and lowered to sends and receives in an order
that cannot deadlock (`messages`). Every pipeline runtime executes any schedule built here.

    schedule = build("1f1b", devices=4, microbatches=8)   # validated
    table(schedule)          # rows of ("F" | "B", micro-batch) per device: the figures' view
    lower(schedule)          # per device: actions, Send, Recv
"""

from jaxpar.parallel.pipeline.schedules.actions import (BACKWARD, FORWARD, Action, Schedule,
                                                         ScheduleError, consumer, needs)
from jaxpar.parallel.pipeline.schedules.generators import GENERATORS, SCHEDULES
from jaxpar.parallel.pipeline.schedules.messages import Message, Recv, Send, lower, message
from jaxpar.parallel.pipeline.schedules.timing import (bubble_fraction, bubble_theory, check,
                                                        gems_bubble_theory, op, peak_in_flight,
                                                        rows, simulate, table)


def build(name: str, devices: int, microbatches: int) -> Schedule:
    """Schedule `name` for `devices` devices and `microbatches` micro-batches, validated."""
    return check(GENERATORS[name](devices, microbatches))


__all__ = ["BACKWARD", "FORWARD", "GENERATORS", "SCHEDULES", "Action", "Message", "Recv", "Schedule",
           "ScheduleError", "Send", "build", "bubble_fraction", "bubble_theory", "check", "consumer",
           "gems_bubble_theory", "lower", "message", "needs", "op", "peak_in_flight", "rows",
           "simulate", "table"]
