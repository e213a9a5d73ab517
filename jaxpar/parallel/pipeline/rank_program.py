"""A host-driven pipeline's step as one program per stage, each on its stage's own device.

Walking the schedule from the host (`host_walk`) costs some 40 dispatches and transfers a step
on the cores the stages compute on: across processes (CNN, 2 single-threaded ranks, 1F1B) ~10
ms a step beside the stages' 27 ms, 1.2x one rank; within one process (CNN, 2 simulated
devices) ~6 ms of a core a step, and on 4 devices more. Where every stage has a device of its
own (`pipeline`, `layer-split`, and GEMS, each of whose devices holds a stage of each
replica), its step is instead one jitted program per device: the device's column of the
table written out, the activations and gradients sent and received by the program itself
(`p2p`), then the optimizer update (GEMS: after each stage's two copies exchange and sum
their gradients). Within a process the links are in-memory channels, whose sends never
wait (and whose waiting receives hold no thread of XLA's pool), so each row's slots send
before they receive (`column.walk_devices`: any directions,
GEMS's replicas flow opposite ways); all devices' programs are dispatched before any is
waited on, and run at once, each on its device's thread. Across processes (one stage each,
no replicas) they are TCP connections walked in `column.walk`'s order, except that the last
stage sends each micro-batch's gradient from the forward slot that computes it, not from its
backward slot: its sends never wait (`p2p`'s outboxes), and over a link the gradients then
flow back while the activations still come, the link's two directions at once (CNN, GPipe,
2 emulated hosts, a step: 422 against 656 ms at 100 Mbit/s, 41 against 63 at 1 Gbit/s, 29
against 42 unlimited, when they left from the backward slots, after every activation); each
program ends once its messages are written out (`Links.flush`). The stage
functions are the host walk's own (`HostPipeline._train_forward`, `_backward`, `_last`,
`_update`), so both give the same step; `gradients`, `eval_step` and the measured timeline
keep the host walk.

    RankStep.reason_not(pipe)   # None: the step runs as one program per device
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.profiling import measure
from jaxpar import step as steplib
from jaxpar.parallel.transport import addresses, p2p, processes
from jaxpar.parallel.pipeline import columns as column, schedules


class RankStep:
    """The devices this process holds, each step as one program; messages over `p2p` links."""

    def __init__(self, pipe):
        self.p = pipe
        self.mine = [d for d in range(pipe.S) if processes.owns(pipe.devices[d])]
        self.links = self._connect()
        for d in self.mine:
            pipe._register(f"rank_step{d}", functools.partial(self._step, d),
                           donate_argnums=(0, 1), static_argnums=(6,))

    def _connect(self) -> dict[int, p2p.Links]:
        """Per device held here, its links keyed by the devices it exchanges with (the next
        and previous stages', and with replicas the device holding its stages' other copies):
        across processes one connection per process; within one, a channel pair each."""
        S = self.p.S
        mirror = self.p.replicas > 1
        peers = {d: {e for e in (d - 1, d + 1, *([S - 1 - d] if mirror else [])) if 0 <= e < S and e != d}
                 for d in range(S)}
        if processes.many():
            process_of = {e: self.p.devices[e].process_index for e in range(S)}
            (d,) = self.mine
            links = p2p.connect({process_of[e] for e in peers[d]})
            return {d: links.renamed({e: process_of[e] for e in peers[d]})}
        ends = {(d, e): p2p.pair() for d in range(S) for e in peers[d] if d < e}
        return {d: p2p.Links({e: ends[min(d, e), max(d, e)][0 if d < e else 1] for e in peers[d]})
                for d in self.mine}

    @staticmethod
    def reason_not(pipe) -> str | None:
        """Why `pipe`'s step is not one program per device here (None: it is)."""
        if pipe.mesh.devices.size != pipe.S or len(set(pipe.devices)) != pipe.S:
            return "not one stage on each device"
        if not processes.many():
            return p2p.unavailable()
        if pipe.replicas != 1:
            return "a stage has copies on two processes (GEMS)"
        owners = {pipe.device(s).process_index for s in range(pipe.S)}
        if len(owners) != pipe.S or pipe.S != jax.process_count():
            return "not one stage, on one device, per process"
        # Every process must choose alike (connecting is a collective): one that cannot build
        # the custom calls (no compiler on its host) sends the whole job to the host walk.
        every = addresses.exchange(p2p.unavailable() or "")
        return next((f"process {i}: {why}" for i, why in enumerate(every) if why), None)

    def _copies(self, d) -> list[tuple[int, int, int]]:
        """(replica, stage, index in the state's tuples) of each stage copy device d holds."""
        S = self.p.S
        return [(r, schedules.stage_of(d, r, S), r * S + schedules.stage_of(d, r, S))
                for r in range(self.p.replicas)]

    def step(self, state, batch):
        """`HostPipeline.step`'s result: the copies held here updated by their devices'
        programs (all dispatched before any is waited on: they exchange messages while they
        run); other processes' stages stay the handles they are here."""
        p, S = self.p, self.p.S
        params, opts, stats = list(state.params), list(state.opt_state), list(state.model_state)
        sums = None
        for d in self.mine:
            args, rows = self._arguments(d, state, batch)
            compiled = p.compiled.get(self._key(d))  # AOT (`compile`): no static argument
            new_params, new_opts, new_stats, out = (
                compiled(*args) if compiled else getattr(p, f"_jit_rank_step{d}")(*args, rows))
            for (_, _, i), a, b, c in zip(self._copies(d), new_params, new_opts, new_stats):
                params[i], opts[i], stats[i] = a, b, c
            sums = out if out is not None else sums
        if sums is None:  # the metric sums live on the last stage's device, another process's
            sums = {k: processes.handle((), jnp.float32, p.device(S - 1)) for k in steplib.SUMS}
        return state.replace(step=state.step + 1, params=tuple(params), opt_state=tuple(opts),
                             model_state=tuple(stats)), sums

    def compile(self, state, batch) -> list[measure.Program]:
        """The programs of the devices held here, compiled (as `step` then calls them)."""
        parts = []
        for d in self.mine:
            args, rows = self._arguments(d, state, batch)
            executable = getattr(self.p, f"_jit_rank_step{d}").lower(*args, rows).compile()
            self.p.compiled[self._key(d)] = executable
            parts.append(measure.Program(f"rank_step{d}@0", executable, stage=d))
        return parts

    def _key(self, d):
        """Where `compile` keeps device d's program (`HostPipeline.compiled`'s keys)."""
        return ("step", f"rank_step{d}", self.p.devices[d].id)

    def _arguments(self, d, state, batch) -> tuple[tuple, int]:
        """Device d's program arguments, per copy it holds (its state; a replica's images
        where the copy is its first stage, labels and weights where its last), and the
        global batch's rows (static)."""
        copies, last = self._copies(d), self.p.S - 1
        pick = lambda key, stage: tuple(batch[key][r] if s == stage else None for r, s, _ in copies)  # noqa: E731
        return (tuple(state.params[i] for *_, i in copies), tuple(state.opt_state[i] for *_, i in copies),
                tuple(state.model_state[i] for *_, i in copies), pick("image", 0), pick("label", last),
                pick("weight", last)), batch["label"][0].shape[0]

    def _arriving(self, t: int, rows: int) -> jax.ShapeDtypeStruct:
        """What crosses boundary t (stage t's output, or its gradient) for a micro-batch."""
        return jax.ShapeDtypeStruct((rows // self.p.M, *self.p.boundary_shapes[t]), jnp.float32)

    def _step(self, d, params, opts, stats, images, labels, weights, rows):
        p, S, links = self.p, self.p.S, self.links[d]
        copies = {r: _Copy(p, r, s, params[r], stats[r], images[r], labels[r], weights[r],
                           early_gradients=processes.many())
                  for r, s, _ in self._copies(d)}
        if processes.many():  # one stage per process, no replicas: sockets, column.walk's order
            def receive(kind, sender, order):
                return links.receive(self._arriving(sender if kind == "F" else d, rows), sender, order)

            order = column.walk(p.table, d, S, lambda kind, m, x, o: copies[0].run(kind, m, x, o),
                                receive, lambda kind, x, dest, o: links.send(x, dest, o))
        else:
            order = column.walk_devices(p.table, d, lambda slot, x, o: copies[schedules.op(slot)[2]].run(
                slot[0], slot[1], x, o), functools.partial(self._route, p.S),
                lambda sender, slot, o: links.receive(self._message(sender, slot, rows), sender, o),
                links.send)
        order = self._combine(d, copies, order)
        out = [p._update(params[r], opts[r], c.acc, c.z) for r, c in copies.items()]
        links.flush(after=column.tie(order, out))  # after the update: its wait holds a thread
        held_sums = [c.sums for c in copies.values() if c.r == 0 and c.s == S - 1]
        return (tuple(o[0] for o in out), tuple(o[1] for o in out), tuple(o[2] for o in out),
                held_sums[0] if held_sums else None)

    @staticmethod
    def _route(S, device, slot) -> int | None:
        """The device that `slot`'s message (run on `device`) goes to, or None: a forward's
        activation to the replica's next stage, a backward's gradient to its previous one
        (the last stage sends at its backward slot what its forward slot computed)."""
        kind, _, r = schedules.op(slot)
        s = schedules.stage_of(device, r, S)
        t = s + 1 if kind == "F" else s - 1
        return schedules.device_of(t, r, S) if 0 <= t < S else None

    def _message(self, sender, slot, rows) -> jax.ShapeDtypeStruct:
        """What `slot` on device `sender` sends: the activation leaving its stage, or the
        gradient of its stage's input."""
        kind, _, r = schedules.op(slot)
        s = schedules.stage_of(sender, r, self.p.S)
        return self._arriving(s if kind == "F" else s - 1, rows)

    def _combine(self, d, copies, order):
        """With replicas: each copy's gradients and statistics summed with the other copy of
        its stage (on device S-1-d, which sends its copies in replica order), and replica 1's
        metric sums (on device 0) added into replica 0's (on device S-1)."""
        p, S, links = self.p, self.p.S, self.links[d]
        if p.replicas == 1:
            return order
        other = S - 1 - d
        mine = {r: (c.acc, c.z) for r, c in copies.items()}
        for r in sorted(mine):
            order = self._send_tree(links, mine[r], other, order)
        theirs = {}
        for r in sorted(mine):  # the other device's copy r holds the stage of my copy 1 - r
            theirs[1 - r], order = self._receive_tree(links, mine[1 - r], other, order)
        for r, c in copies.items():
            c.acc, c.z = jax.tree.map(jnp.add, (c.acc, c.z), theirs[r])
        if d == 0:  # replica 1's last stage
            order = self._send_tree(links, copies[1].sums, S - 1, order)
        if d == S - 1:
            got, order = self._receive_tree(links, copies[0].sums, 0, order)
            copies[0].sums = jax.tree.map(jnp.add, copies[0].sums, got)
        return order

    @staticmethod
    def _send_tree(links, tree, dest, order):
        """`tree` to `dest`, leaf by leaf in order (as `_receive_tree` reads it); the order."""
        for leaf in jax.tree.leaves(tree):
            order = column.tie(order, links.send(leaf, dest, order))
        return order

    @staticmethod
    def _receive_tree(links, like, sender, order):
        """A tree shaped like `like` from `sender`, leaf by leaf in order (each receive
        after the one before: unchained, XLA may run them in any order), and the order."""
        leaves, tree = jax.tree.flatten(like)
        got = []
        for x in leaves:
            got.append(links.receive(jax.ShapeDtypeStruct(x.shape, x.dtype), sender, order))
            order = column.tie(order, got[-1])
        return jax.tree.unflatten(tree, got), order


class _Copy:
    """One stage copy's part of its device's program: its state, what it accumulates, and
    what its forwards keep for its backwards."""

    def __init__(self, p, r, s, params, stats, image, label, weight, early_gradients=False):
        self.p, self.r, self.s, self.params, self.stats = p, r, s, params, stats
        # the last stage's gradients sent from its forward slots (sends that never wait), not
        # from the backward slots `column.walk_devices` routes them by
        self.early = early_gradients and s == p.S - 1
        self.acc, self.z, self.sums = p._zeros(s, params, stats)
        self.images = p._split_images(r, image) if s == 0 else None
        self.labels, self.weights, self.denom = (p._split_labels(r, label, weight) if s == p.S - 1
                                                 else (None,) * 3)
        self.kept, self.to_send = {}, {}  # by micro-batch: what F keeps for B; the last stage's gradients

    def run(self, kind, m, arrived, order):
        """The copy's slot (kind, micro-batch m): ({"F": activation} or {"B": gradient} to send,
        the order after it)."""
        p, s, S = self.p, self.s, self.p.S
        i = m - self.r * (p.M // p.replicas)  # the micro-batch's index within its replica
        if kind == "F" and s < S - 1:
            x = column.after(self.images[i] if s == 0 else arrived, order)
            out, vjp, self.z = p._train_forward(s, self.params, self.stats, x, self.z)
            self.kept[m] = x if p.remat else vjp
            return {"F": out}, column.tie(order, out)
        if kind == "F":  # the last stage: forward, loss and backward at once, as the walk does
            x = column.after(arrived, order)
            self.acc, self.to_send[m], self.z, self.sums = p._last(
                self.params, self.stats, x, self.labels[i], self.weights[i], self.denom, self.acc,
                self.z, self.sums)
            # tied to the accumulated gradients too, else XLA sums them all at the end and
            # holds every micro-batch's parameter gradients until then
            order = column.tie(order, (self.to_send[m], self.acc))
            return ({"B": self.to_send.pop(m)} if self.early else {}), order
        if s == S - 1:  # its backward slot only sends what its forward slot computed
            return ({} if self.early else {"B": self.to_send.pop(m)}), order
        g = column.after(arrived, order)
        if p.remat:
            # the input made to wait for this slot: the recomputed forward is then not the
            # first one's expression, which XLA would merge with it (and keep its residuals)
            x = column.after(self.kept.pop(m), order)
            self.acc, dx = p._backward_remat(s, self.params, self.stats, x, g, self.acc)
        else:
            self.acc, dx = p._backward(s, self.kept.pop(m), g, self.acc)
        return {"B": dx}, column.tie(order, self.acc)  # receives wait for the slot's work
