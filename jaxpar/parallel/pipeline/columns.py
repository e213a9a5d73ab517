"""One stage's column of a schedule table, written out inside one traced step, with the
messages between neighbouring stages in a deadlock-free order. A process per stage runs it:
`mpi-pipeline` (mpi4jax) and `rank_step` (host-driven pipelines across processes, `p2p`).

Deadlock-free by construction. Every stage walks the same table and, after each slot, the
same two message phases: forward (activations s -> s+1), then backward (gradients s -> s-1).
Both ends of a message read it off the shared table, so every send meets its receive in the
same phase; in a phase a stage first meets the neighbour it receives from, then the one it
sends to. All messages of a phase go the same way along the chain of stages, so no stage
waits on one that waits back on it (the waits form no cycle: the end of the chain always
completes, then the stage before it), and the k-th message between two stages matches the
k-th receive posted for it (the transports keep a pair's messages in order).

The computations keep the table's order too: every slot's input waits for what came before
(`after`), and each result and message is folded into that order (`tie`); left to itself
XLA ran all of the first stage's forwards before its first send, and two stages were no
faster than one. A receive waits for that order; a send waits only for its message and the
messages before it (`messages`), as MPI's token orders mpi4jax's: the last stage computes
each micro-batch's gradient in its forward slot, and under GPipe a send that also waited
for the later forwards held the first stage's backwards back (CNN, 2 ranks, a step: GPipe
31.5-32 ms against 36-38, 1F1B 22-23 against 26-28).

    column.walk(table, s, S, run_slot, receive, send)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


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


# run_slot(kind, m, arrived, order) -> ({"F": x} and/or {"B": x} to send, order)
SlotFn = Callable[[str, int, Any, jax.Array], tuple[dict, jax.Array]]


def walk(table, s: int, S: int, run_slot: SlotFn, receive: Callable, send: Callable) -> jax.Array:
    """Stage s's column of `table` (rows of per-stage slots ("F" | "B", micro-batch) or None).

    Args:
      run_slot: runs this stage's slot `kind` on micro-batch m; `arrived` is what came for
        it (an activation for F, a gradient for B; None where nothing comes: F on the first
        stage, B on the last); returns what to send this row, by phase, and the new order.
      receive: (kind, sender, order) -> the array arriving from stage `sender` in that phase.
      send: (kind, x, dest, after) -> a value that exists once x is sent (tied into the
        order; a transport without ordered effects sends after `after`: the messages before).
    Returns the order after the last message.
    """
    inbox: dict[str, dict[int, Any]] = {"F": {}, "B": {}}
    order = messages = jnp.zeros((), jnp.float32)
    for row in table:
        out: dict = {}
        if row[s] is not None:
            kind, m = row[s]
            out, order = run_slot(kind, m, inbox[kind].pop(m, None), order)
        for kind, step in (("F", 1), ("B", -1)):  # the two message phases of this row
            sender = s - step  # the neighbour whose messages of this kind come here
            if 0 <= sender < S and row[sender] is not None and row[sender][0] == kind:
                got = receive(kind, sender, order)
                inbox[kind][row[sender][1]] = got
                order, messages = tie(order, got), tie(messages, got)
            if out.get(kind) is not None:
                sent = send(kind, out[kind], s + step, messages)
                order, messages = tie(order, sent), tie(messages, sent)
    return order


def walk_devices(table, d: int, run_slot: Callable, route: Callable, receive: Callable,
                 send: Callable) -> jax.Array:
    """Device d's column of `table` (slots (kind, m) or (kind, m, replica)) where a send never
    waits for its receiver (in-process channels): each row runs d's slot, sends what it made,
    then receives what the row's other slots send to d. A row's messages are read only by
    later rows, so once every device has done the rows before it, each does this row: no
    deadlock, whatever way each message goes (GEMS's two replicas flow opposite ways). Each
    pair's messages arrive in the order sent, and every device reads them off the same table.

    Args:
      run_slot: (slot, arrived, order) -> ({"F": x} or {"B": x} or {}, order), as `walk`'s.
      route: (device, slot) -> the device that slot's message goes to (None: it sends none).
      receive: (sender, slot, order) -> the array arriving here from that slot.
      send: (x, dest, after) -> a value that exists once x is sent, after `after`: the
        messages before it (as `walk`'s), not the slot's other work. Measured on 2 simulated
        devices (CNN, 8 micro-batches, three rounds each way): GPipe under --single-thread
        29.5-39.7 ms a step against 31.9-44.9 when sends also waited for the slot's work;
        1F1B, GEMS and every-core GPipe the same either way within this machine's noise.
    Returns the order after the last message.
    """
    inbox: dict[tuple[str, int], Any] = {}
    order = messages = jnp.zeros((), jnp.float32)
    for row in table:
        if row[d] is not None:
            kind, m = row[d][0], row[d][1]
            out, order = run_slot(row[d], inbox.pop((kind, m), None), order)
            if out.get(kind) is not None:
                sent = send(out[kind], route(d, row[d]), messages)
                order, messages = tie(order, sent), tie(messages, sent)
        for sender, slot in enumerate(row):
            if sender != d and slot is not None and route(sender, slot) == d:
                got = receive(sender, slot, order)
                inbox[slot[0], slot[1]] = got  # for this device's slot of the same kind and m
                order, messages = tie(order, got), tie(messages, got)
    return order
