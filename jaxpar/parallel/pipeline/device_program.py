"""One device's part of a pipeline step written out inside one traced program: its lowered
schedule (`schedules.lower`: its actions, sends and receives in an order that cannot
deadlock) executed in order, the messages sent and received by the program itself. The
runtimes with a program per device run it: `host.column` (in-process channels, or TCP
between processes: `p2p`) and `mpi-pipeline` (mpi4jax's answered messages).

The computations keep the lowered order too: every action's input waits for what came
before (`after`), and each result and message is folded into that order (`tie`); left to
itself XLA ran all of the first stage's forwards before its first send, and two stages were
no faster than one. A receive waits for that order; a send waits only for its message and
the messages before it, as MPI's token orders mpi4jax's: the last stage computes each
micro-batch's gradient in its forward slot, and under GPipe a send that also waited for the
later forwards held the first stage's backwards back (CNN, 2 ranks, a step: GPipe 31.5-32
ms against 36-38, 1F1B 22-23 against 26-28).

    order = execute(program[d], schedule, copies.run, transport, like)
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from jaxpar.parallel.pipeline.schedules import (BACKWARD, FORWARD, Action, Recv, Schedule, Send,
                                                consumer, message)
from jaxpar.parallel.pipeline.schedules.actions import WEIGHT
from jaxpar.parallel.pipeline.schedules.messages import taker
from jaxpar.parallel.pipeline.stage_fns import StageFunctions


def tie(order, tree):
    """`order`, now also after every leaf of `tree` was computed (received): a zero made from
    one element of each (whether it is NaN, times zero: XLA does not fold a float product
    with zero, and a NaN or inf in a diverging run still gives zero) added to it."""
    return order + sum(jnp.isnan(leaf.ravel()[0]).astype(jnp.float32) * 0.0
                       for leaf in jax.tree.leaves(tree) if leaf.size)


def after(x, order):
    """`x`, usable only after `order` (a zero that depends on what came first): a computation
    on it cannot move before that."""
    return x + order.astype(x.dtype)


class Transport(Protocol):
    def send(self, x: jax.Array, dest: int, after: jax.Array) -> jax.Array:
        """Send `x` to device `dest` once `after` exists; a value that exists once sent."""

    def receive(self, like: jax.ShapeDtypeStruct, source: int, after: jax.Array) -> jax.Array:
        """The next array from device `source`, received once `after` exists."""


# run(action, arrived, order) -> ({kind: array to hand on}, order)
RunAction = Callable[[Action, Any, jax.Array], tuple[dict, jax.Array]]


def execute(ops, schedule: Schedule, run: RunAction, transport: Transport,
            like: Callable[[Any], jax.ShapeDtypeStruct],
            stamp: Callable[[jax.Array, int], jax.Array] | None = None) -> jax.Array:
    """Run one device's lowered ops in order. `run` computes an action from what arrived for
    it and returns what it hands on by kind ("F": its output, "B": its input's gradient;
    the last stage hands its gradient on from its forward when computing both at once);
    `like(message)` is the shape of a message. `stamp(order, mark)`, if given, reads a clock
    in the program as each action and receive begins (mark 2i, i its index in `ops`) and
    ends (2i + 1): `stamp_marks`. Returns the order after the last op."""
    inbox: dict[Action, Any] = {}   # the consuming action -> what arrived (or was handed) for it
    outbox: dict = {}               # message -> the array to send
    order = messages = jnp.zeros((), jnp.float32)
    stamped = (lambda value, mark: tie(value, stamp(value, mark))) if stamp else (lambda value, mark: value)
    for i, op in enumerate(ops):
        if isinstance(op, Action):
            order = stamped(order, 2 * i)
            produced, order = run(op, inbox.pop(op, None), order)
            order = stamped(order, 2 * i + 1)
            for kind, x in produced.items():
                made = op._replace(kind=kind)
                msg, local = message(made, schedule), consumer(made, schedule)
                if msg is not None:
                    outbox[msg] = x
                elif local is not None:
                    inbox[local] = x  # the next stage on this device takes it directly
        elif isinstance(op, Send):
            sent = transport.send(outbox.pop(op.message), op.to, messages)
            order, messages = tie(order, sent), tie(messages, sent)
        else:
            assert isinstance(op, Recv)
            order = stamped(order, 2 * i)
            got = transport.receive(like(op.message), op.source, order)
            inbox[taker(op.message, schedule)] = got
            order, messages = stamped(tie(order, got), 2 * i + 1), tie(messages, got)
    return order


def stamp_marks(ops) -> list[int]:
    """The marks `execute` stamps in one run of `ops`, in the order it stamps them."""
    return [2 * i + edge for i, op in enumerate(ops) if not isinstance(op, Send) for edge in (0, 1)]


def message_like(schedule: Schedule, boundary_shapes, rows: int) -> Callable:
    """like(message): the shape of what a message carries for one micro-batch of a `rows`-row
    batch: the activation crossing the boundary below its receiver, or the gradient of the one
    above it (`boundary_shapes[b]`: what stage b hands on, per example; f32)."""
    def like(msg):
        boundary = msg.sender if msg.kind == FORWARD else msg.receiver
        return jax.ShapeDtypeStruct((rows // schedule.microbatches, *boundary_shapes[boundary]), jnp.float32)
    return like


class StageCopy:
    """One stage copy's part of its device's program: its state, what it accumulates, and what
    its forwards keep for its backwards. The last stage runs each micro-batch's forward, loss
    and backward at once in its forward's slot, handing the gradient on there (`early`) or at
    its backward's slot. Where the schedule splits backwards (`split`), the forwards keep each
    layer's vjp, an input gradient keeps each layer's cotangent, and the weight gradient
    (`W`) uses both (the last stage computes its input gradient in its forward's slot)."""

    def __init__(self, fns: StageFunctions, r, s, params, stats, image, label, weight, early=False,
                 split=False):
        self.fns, self.r, self.s, self.params, self.stats = fns, r, s, params, stats
        self.early, self.split = early and s == fns.stages - 1, split
        self.for_weights = {}  # by micro-batch: (layers' vjps, cotangents) awaiting their W
        self.acc, self.z, self.sums = fns.zeros(s, params, stats)
        self.images = fns.split_images(r, image) if s == 0 else None
        self.labels, self.weights, self.denom = (fns.split_labels(r, label, weight) if s == fns.stages - 1
                                                 else (None,) * 3)
        self.kept, self.to_send = {}, {}  # by micro-batch: what F keeps for B; the last stage's gradients

    def run(self, action: Action, arrived, order):
        """The copy's action: ({"F": activation} or {"B": gradient} to hand on, the order after it)."""
        if self.split:
            return self._run_split(action, arrived, order)
        fns, s, last = self.fns, self.s, self.fns.stages - 1
        m = action.microbatch
        i = m - self.r * (fns.microbatches // fns.replicas)  # the micro-batch's index in its replica
        if action.kind == FORWARD and s < last:
            x = after(self.images[i] if s == 0 else arrived, order)
            out, vjp, self.z = fns.train_forward(s, self.params, self.stats, x, self.z)
            self.kept[m] = x if fns.remat else vjp
            return {FORWARD: out}, tie(order, out)
        if action.kind == FORWARD:  # the last stage: forward, loss and backward at once
            x = after(arrived, order)
            self.acc, self.to_send[m], self.z, self.sums = fns.last(
                self.params, self.stats, x, self.labels[i], self.weights[i], self.denom, self.acc,
                self.z, self.sums)
            # tied to the accumulated gradients too, else XLA sums them all at the end and
            # holds every micro-batch's parameter gradients until then
            order = tie(order, (self.to_send[m], self.acc))
            return ({BACKWARD: self.to_send.pop(m)} if self.early and s > 0 else {}), order
        if s == last:  # its backward slot only hands on what its forward slot computed
            grad = self.to_send.pop(m, None)
            return ({} if self.early or s == 0 else {BACKWARD: grad}), order
        g = after(arrived, order)
        if fns.remat:
            # the input made to wait for this slot: the recomputed forward is then not the
            # first one's expression, which XLA would merge with it (and keep its residuals)
            x = after(self.kept.pop(m), order)
            self.acc, dx = fns.backward_remat(s, self.params, self.stats, x, g, self.acc)
        else:
            self.acc, dx = fns.backward(s, self.kept.pop(m), g, self.acc)
        return ({BACKWARD: dx} if s > 0 else {}), tie(order, self.acc)  # receives wait for the slot's work

    # --- schedules that split backwards: input gradient (I) and weight gradient (W) --------------
    def _run_split(self, action: Action, arrived, order):
        fns, s, last, kind = self.fns, self.s, self.fns.stages - 1, action.kind
        m = action.microbatch
        i = m - self.r * (fns.microbatches // fns.replicas)
        if kind == FORWARD and s < last:
            x = after(self.images[i] if s == 0 else arrived, order)
            if fns.remat:
                out, _, self.z = fns.layers_forward(s, self.params, self.stats, x, self.z)
                self.kept[m] = x
            else:
                out, self.kept[m], self.z = fns.layers_forward(s, self.params, self.stats, x, self.z)
            return {FORWARD: out}, tie(order, out)
        if kind == FORWARD:  # the last stage: forward, loss and input gradient at once
            dx, vjps, cts, self.z, self.sums = fns.last_input(
                self.params, self.stats, after(arrived, order), self.labels[i], self.weights[i], self.denom,
                self.z, self.sums)
            self.for_weights[m], self.to_send[m] = (vjps, cts), dx
            order = tie(order, (dx, cts))
            return ({BACKWARD: self.to_send.pop(m)} if self.early and s > 0 else {}), order
        if kind == WEIGHT:
            vjps, cts = self.for_weights.pop(m)
            self.acc = fns.backward_weight(vjps, jax.tree.map(lambda a: after(a, order), cts), self.acc)
            return {}, tie(order, self.acc)
        out, order = self._input_gradient(s, last, m, arrived, order)
        if kind == BACKWARD:  # a whole backward in a schedule that splits others: W at once
            return self._run_split(action._replace(kind=WEIGHT), None, order)[0] | out, tie(order, self.acc)
        return out, order

    def _input_gradient(self, s, last, m, arrived, order):
        """I(m): the input gradient (the last stage's was computed in its forward's slot)."""
        if s == last:
            grad = self.to_send.pop(m, None)
            return ({} if self.early or s == 0 else {BACKWARD: grad}), order
        g = after(arrived, order)
        vjps = self.kept.pop(m)
        if self.fns.remat:  # recomputed from the input, made to wait for this slot
            _, vjps, _ = self.fns.layers_forward(s, self.params, self.stats, after(vjps, order), self.z)
        dx, cts = self.fns.backward_input(vjps, g)
        self.for_weights[m] = (vjps, cts)
        return ({BACKWARD: dx} if s > 0 else {}), tie(order, (dx, cts) if s > 0 else cts)
