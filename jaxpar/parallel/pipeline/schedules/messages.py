"""A schedule lowered to what each device does in order: its actions, and the sends and
receives of what crosses to another device, in an order that cannot deadlock.

    program = lower(schedule, buffered=True)
    program[d]   # [Action("F", 0, 1), Recv(Message("F", 1, 0, 0, 1), source=0), Send(...), ...]

Every action's result that another device's action takes (a forward's output, a backward's
input gradient) is a `Message`, sent by the producing device and received by the consuming
one; a result taken on the same device (two stages on one device) is no message. Both ends
read the same table (`timing.rows`): in each slot every device first runs its action, then
the slot's messages go in one global order (activations by sending stage upwards, then
gradients by sending stage downwards: each stage first meets the neighbour it receives
from, then the one it sends to). A receive or a send that waits for its other end (MPI's
answered messages) then never deadlocks: the first message not yet done in that order has
both its ends done with everything before it, so both are at it. Each pair of devices sees
its messages in the order sent, as the transports deliver them.

Transports whose sends never wait (`buffered`: in-memory channels, TCP outboxes) may send
before they receive within a slot (`sends_first`), and a runtime that computes the last
stage's backward together with its forward (`early_last_gradients`) sends that gradient from
the forward's slot; its receiver still takes it in the backward's slot. They may also receive
each message just before the action that takes it (`late_receives`; a link's messages still
in the order sent), so a device that holds several stages runs whatever it can before it
waits: received at the end of the slot that sent it, interleaved 1F1B's rank blocked on a
message its next action did not need (2 ranks, stack-mlp, M = 4, four alternated rounds: its
step 0.95 of 1F1B's in the median round, 0.87 with late receives). `check` replays a lowered
program and refuses one that waits forever or mixes a pair's order.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Union

from jaxpar.parallel.pipeline.schedules.actions import (BACKWARD, FORWARD, Action, Schedule,
                                                         ScheduleError, consumer)
from jaxpar.parallel.pipeline.schedules.timing import rows


class Message(NamedTuple):
    kind: str        # "F": an activation going up the stages; "B": a gradient going down
    microbatch: int
    replica: int
    sender: int      # the stage that produced it
    receiver: int    # the stage that takes it

    @property
    def key(self) -> tuple:
        """Its place in a slot's global order."""
        up = self.kind == FORWARD
        return (0 if up else 1, self.replica, self.sender if up else -self.sender, self.microbatch)


class Send(NamedTuple):
    message: Message
    to: int          # device


class Recv(NamedTuple):
    message: Message
    source: int      # device


Op = Union[Action, Send, Recv]


def message(action: Action, schedule: Schedule) -> Message | None:
    """What `action` hands to another device's action, or None (nothing, or a stage on the
    same device)."""
    taker = consumer(action, schedule)
    if taker is None:
        return None
    if schedule.device_of(taker.stage, taker.replica) == schedule.device_of(action.stage, action.replica):
        return None
    kind = FORWARD if action.kind == FORWARD else BACKWARD  # an activation, or a gradient
    return Message(kind, action.microbatch, action.replica, action.stage, taker.stage)


def taker(msg: Message, schedule: Schedule) -> Action:
    """The action that takes `msg` on its receiving device."""
    kind = FORWARD if msg.kind == FORWARD else schedule.backward_kind(msg.microbatch, msg.receiver, msg.replica)
    return Action(kind, msg.microbatch, msg.receiver, msg.replica)


def lower(schedule: Schedule, buffered: bool = False, sends_first: bool = False,
          early_last_gradients: bool = False, late_receives: bool = False) -> tuple[tuple[Op, ...], ...]:
    """Each device's ordered actions, sends and receives (module docstring)."""
    if (sends_first or early_last_gradients or late_receives) and not buffered:
        raise ValueError("sends_first, early_last_gradients and late_receives need sends that never "
                         "wait (buffered)")
    program = _lowered(schedule, sends_first, early_last_gradients)
    return tuple(_late(ops, schedule) for ops in program) if late_receives else program


def _late(ops: tuple[Op, ...], schedule: Schedule) -> tuple[Op, ...]:
    """`ops` with each receive moved to just before the action that takes it, with every
    receive from the same device before it (a link delivers in the order sent): a device
    blocks on a message only when it has nothing else to run."""
    waiting = [op for op in ops if isinstance(op, Recv)]  # in the order each link delivers
    out: list[Op] = []
    for op in (op for op in ops if not isinstance(op, Recv)):
        upto = {r.source: i for i, r in enumerate(waiting)  # per link, the last receive `op` takes
                if isinstance(op, Action) and taker(r.message, schedule) == op}
        now = [r for i, r in enumerate(waiting) if i <= upto.get(r.source, -1)]
        out += [*now, op]
        waiting = [r for r in waiting if r not in now]
    return tuple(out + waiting)


def _lowered(schedule: Schedule, sends_first: bool, early_last_gradients: bool) -> tuple[tuple[Op, ...], ...]:
    """Every message sent and received in the slot that produces it (module docstring)."""
    last = schedule.stages - 1
    early_last_gradients = early_last_gradients and _early_gradients_keep_order(schedule)
    table = rows(schedule)
    sent_at: dict[Message, int] = {}
    taken_at: dict[Message, int] = {}
    for t, row in enumerate(table):
        for a in row:
            msg = a and message(a, schedule)
            if msg:
                taken_at[msg] = t
                sent_at.setdefault(msg, t)
            if a and early_last_gradients and a.kind == FORWARD and a.stage == last:
                early = message(a._replace(kind=schedule.backward_kind(a.microbatch, last, a.replica)), schedule)
                if early:
                    sent_at[early] = t
    out: list[list[Op]] = [[] for _ in range(schedule.devices)]
    for t, row in enumerate(table):
        for d, a in enumerate(row):
            if a is not None:
                out[d].append(a)
        ops = sorted([(m.key, 1, Send(m, _device(m, "receiver", schedule)), _device(m, "sender", schedule))
                      for m, at in sent_at.items() if at == t]
                     + [(m.key, 0, Recv(m, _device(m, "sender", schedule)), _device(m, "receiver", schedule))
                        for m, at in taken_at.items() if at == t])
        for d in range(schedule.devices):
            mine = [(key, is_send, op) for key, is_send, op, owner in ops if owner == d]
            if sends_first:
                mine.sort(key=lambda x: -x[1])  # stable: sends, then receives, each in order
            out[d] += [op for *_, op in mine]
    return tuple(tuple(ops) for ops in out)


def sent_early(schedule: Schedule) -> Schedule:
    """`schedule` as `lower(early_last_gradients=True)` runs it: where the last stage's
    gradients leave from its forward slots, its backward (input gradient) listed right after
    its forward; the schedule to replay (`timing.replay`) for such a runtime. Itself where
    they cannot leave early."""
    if not _early_gradients_keep_order(schedule):
        return schedule
    last = schedule.stages - 1
    handed = lambda a: a.stage == last and a.kind in (BACKWARD, "I")  # noqa: E731
    lists = []
    for lst in schedule.lists:
        moved = {(a.microbatch, a.replica): a for a in lst if handed(a)}
        lists.append(tuple(x for a in lst if not handed(a) for x in
                           ((a, moved[a.microbatch, a.replica]) if a.stage == last and a.kind == FORWARD else (a,))))
    return dataclasses.replace(schedule, lists=tuple(lists))


def _early_gradients_keep_order(schedule: Schedule) -> bool:
    """Whether the last stage's gradients can leave from its forward slots and still reach
    the previous stage in the order it takes them: one stage per device (no other messages
    share that pair of devices in between) and backwards in the forwards' order (not looped
    BFS's, the last micro-batch first)."""
    last = schedule.stages - 1
    if schedule.replicas > 1 or schedule.stages_per_device > 1:
        return False
    order = lambda kinds: [(a.microbatch, a.replica) for lst in schedule.lists for a in lst  # noqa: E731
                           if a.stage == last and a.kind in kinds]
    return order((FORWARD,)) == order((BACKWARD, "I"))


def _device(msg: Message, end: str, schedule: Schedule) -> int:
    return schedule.device_of(getattr(msg, end), msg.replica)


def check_program(schedule: Schedule, program: tuple[tuple[Op, ...], ...], buffered: bool) -> None:
    """Replay `program` (sends that wait for their receive unless `buffered`); ScheduleError
    if some device waits forever, or a pair of devices sees its messages out of order."""
    _same_pair_order(program)
    position = [0] * len(program)
    sent: dict[Message, bool] = {}
    while any(p < len(ops) for p, ops in zip(position, program)):
        progressed = False
        for d, ops in enumerate(program):
            while position[d] < len(ops):
                op = ops[position[d]]
                if isinstance(op, Recv) and op.message not in sent:
                    break
                if isinstance(op, Send):
                    if not buffered and not _receiver_waiting(program, position, op):
                        break
                    sent[op.message] = True
                position[d] += 1
                progressed = True
        if not progressed:
            stuck = {d: ops[position[d]] for d, ops in enumerate(program) if position[d] < len(ops)}
            raise ScheduleError(f"schedule {schedule.name}: its messages deadlock ({stuck})")


def _receiver_waiting(program, position, send: Send) -> bool:
    ops, p = program[send.to], position[send.to]
    return p < len(ops) and isinstance(ops[p], Recv) and ops[p].message == send.message


def _same_pair_order(program) -> None:
    sends: dict[tuple[int, int], list[Message]] = {}
    recvs: dict[tuple[int, int], list[Message]] = {}
    for d, ops in enumerate(program):
        for op in ops:
            if isinstance(op, Send):
                sends.setdefault((d, op.to), []).append(op.message)
            elif isinstance(op, Recv):
                recvs.setdefault((op.source, d), []).append(op.message)
    for pair in set(sends) | set(recvs):
        if sends.get(pair, []) != recvs.get(pair, []):
            raise ScheduleError(f"devices {pair}: messages sent in the order {sends.get(pair)} but "
                                f"received in the order {recvs.get(pair)}")
