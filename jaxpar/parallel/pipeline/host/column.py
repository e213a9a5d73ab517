"""A host-driven pipeline's step as one program per device, each on its stage's own device.

Walking the schedule from the host (`walk`) costs some 40 dispatches and transfers a step on
the cores the stages compute on: across processes (CNN, 2 single-threaded ranks, 1F1B) ~10
ms a step beside the stages' 27 ms, 1.2x one rank; within one process (CNN, 2 simulated
devices) ~6 ms of a core a step, and on 4 devices more. Where every stage has a device of its
own (`pipeline`, `layer-split`, and GEMS, each of whose devices holds a stage of each
replica), its step is instead one jitted program per device: the device's lowered schedule
written out (`device_program.execute`), the activations and gradients sent and received by
the program itself (`p2p`), then the optimizer update (GEMS: after each stage's two copies
exchange and sum their gradients). Within a process the links are in-memory channels, whose
sends never wait (and whose waiting receives hold no thread of XLA's pool), so each slot's
sends go before its receives; all devices' programs are dispatched before any is waited on,
and run at once, each on its device's thread. Across processes (one stage each, no
replicas) they are TCP connections whose sends never wait either (`p2p`'s outboxes): the
last stage sends each micro-batch's gradient from the forward slot that computes it, and
over a link the gradients then flow back while the activations still come, the link's two
directions at once (CNN, GPipe, 2 emulated hosts, a step: 422 against 656 ms at 100 Mbit/s,
41 against 63 at 1 Gbit/s, 29 against 42 unlimited, when they left from the backward
slots); each program ends once its messages are written out (`Links.flush`). The stage
functions are the host walk's own (`StageFunctions`), so both give the same step;
`gradients`, `eval_step` and the measured timeline keep the host walk.

    why_not(placement, schedule)   # None: the step runs as one program per device
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar import step as steplib
from jaxpar.parallel.pipeline.device_program import StageCopy, after, execute, message_like, tie
from jaxpar.parallel.pipeline.host import timeline
from jaxpar.parallel.pipeline.schedules import lower
from jaxpar.parallel.transport import addresses, p2p, processes
from jaxpar.profiling import measure


def why_not(placement, schedule) -> str | None:
    """Why the step is not one program per device here (None: it is)."""
    if not placement.one_device_per_stage():
        return "not one stage on each device"
    if not processes.many():
        return p2p.unavailable()
    if schedule.replicas != 1:
        return "a stage has copies on two processes (GEMS)"
    owners = {d.process_index for d in placement.devices}
    if len(owners) != schedule.devices or schedule.devices != jax.process_count():
        return "not one device, and its stages, per process"
    # Every process must choose alike (connecting is a collective): one that cannot build
    # the custom calls (no compiler on its host) sends the whole job to the host walk.
    every = addresses.exchange(p2p.unavailable() or "")
    return next((f"process {i}: {why}" for i, why in enumerate(every) if why), None)


class ColumnStep:
    """The devices this process holds, each step as one program; messages over `p2p` links."""

    def __init__(self, schedule, fns, placement, states, programs, boundary_shapes):
        self.schedule, self.fns, self.placement, self.states = schedule, fns, placement, states
        self.programs, self.boundary_shapes = programs, boundary_shapes
        self.across = processes.many()  # one stage per process, TCP between them
        self.lowered = lower(schedule, buffered=True, sends_first=True, early_last_gradients=self.across,
                             late_receives=True)
        self.mine = [d for d in range(schedule.devices) if processes.owns(placement.devices[d])]
        self.links = self._connect()
        self.stamping = False  # its programs stamp each action and receive (`timeline.program_steps`)
        for d in self.mine:
            programs.register(f"rank_step{d}", functools.partial(self._step, d),
                              donate_argnums=(0, 1), static_argnums=(6,))

    def _connect(self) -> dict[int, p2p.Links]:
        """Per device held here, its links keyed by the devices it exchanges with: across
        processes one connection per process; within one, a channel pair each."""
        S, sch = self.schedule.devices, self.schedule
        peers = {d: set() for d in range(S)}
        for d, ops in enumerate(self.lowered):
            for op in ops:
                other = getattr(op, "to", getattr(op, "source", None))
                if other is not None:
                    peers[d].add(other)
                    peers[other].add(d)
        if sch.replicas > 1:  # each stage's two copies exchange their gradients
            for d in range(S):
                if S - 1 - d != d:
                    peers[d].add(S - 1 - d)
        if self.across:
            process_of = {e: self.placement.devices[e].process_index for e in range(S)}
            (d,) = self.mine
            links = p2p.connect({process_of[e] for e in peers[d]})
            return {d: links.renamed({e: process_of[e] for e in peers[d]})}
        ends = {(d, e): p2p.pair() for d in range(S) for e in peers[d] if d < e}
        return {d: p2p.Links({e: ends[min(d, e), max(d, e)][0 if d < e else 1] for e in peers[d]})
                for d in self.mine}

    def _copies(self, d) -> list[tuple[int, int, int]]:
        """(replica, stage, index in the state's tuples) of each stage copy device d holds."""
        sch = self.schedule
        return [(r, s, r * sch.stages + s) for r in range(sch.replicas) for s in range(sch.stages)
                if sch.placement[r][s] == d]

    def step(self, state, batch):
        """The copies held here updated by their devices' programs (all dispatched before any
        is waited on: they exchange messages while they run); other processes' stages stay
        the handles they are here."""
        last = self.schedule.stages - 1
        params, opts, stats = list(state.params), list(state.opt_state), list(state.model_state)
        sums = None
        for d in self.mine:
            args, rows = self._arguments(d, state, batch)
            compiled = self.programs.compiled.get(self._key(d))  # AOT (`compile`): no static argument
            new_params, new_opts, new_stats, out = (
                compiled(*args) if compiled else self.programs.jitted[f"rank_step{d}"](*args, rows))
            for (_, _, i), a, b, c in zip(self._copies(d), new_params, new_opts, new_stats):
                params[i], opts[i], stats[i] = a, b, c
            sums = out if out is not None else sums
        if sums is None:  # the metric sums live on the last stage's device, another process's
            sums = {k: processes.handle((), jnp.float32, self.placement.device(last)) for k in steplib.SUMS}
        return state.replace(step=state.step + 1, params=tuple(params), opt_state=tuple(opts),
                             model_state=tuple(stats)), sums

    def compile(self, state, batch) -> list[measure.Program]:
        """The programs of the devices held here, compiled (as `step` then calls them)."""
        parts = []
        for d in self.mine:
            args, rows = self._arguments(d, state, batch)
            executable = self.programs.jitted[f"rank_step{d}"].lower(*args, rows).compile()
            self.programs.compiled[self._key(d)] = executable
            parts.append(measure.Program(f"rank_step{d}@0", executable, stage=d))
        return parts

    def _key(self, d):
        return ("step", f"rank_step{d}", self.placement.devices[d].id)

    def _arguments(self, d, state, batch) -> tuple[tuple, int]:
        """Device d's program arguments, per copy it holds (its state; a replica's images
        where the copy is its first stage, labels and weights where its last), and the
        global batch's rows (static)."""
        copies, last = self._copies(d), self.schedule.stages - 1
        pick = lambda key, stage: tuple(batch[key][r] if s == stage else None for r, s, _ in copies)  # noqa: E731
        return (tuple(state.params[i] for *_, i in copies), tuple(state.opt_state[i] for *_, i in copies),
                tuple(state.model_state[i] for *_, i in copies), pick("image", 0), pick("label", last),
                pick("weight", last)), batch["label"][0].shape[0]

    def _step(self, d, params, opts, stats, images, labels, weights, rows):
        links, fns, split = self.links[d], self.fns, self.schedule.splits_backward
        copies = {(r, s): StageCopy(fns, r, s, params[k], stats[k], images[k], labels[k], weights[k],
                                    early=self.across, split=split)
                  for k, (r, s, _) in enumerate(self._copies(d))}
        run = lambda action, arrived, order: copies[action.replica, action.stage].run(action, arrived, order)  # noqa: E731
        stamp = (lambda x, mark: p2p.stamp(x, timeline.device_mark(d, mark))) if self.stamping else None  # noqa: E731
        order = execute(self.lowered[d], self.schedule, run, links,
                        message_like(self.schedule, self.boundary_shapes, rows), stamp)
        order = self._combine(d, copies, order)
        # the update after the schedule's last op: else XLA may start it inside the last action
        # (both need its gradients), and a stamped timeline counts it there
        out = [fns.update(params[k], opts[k], *jax.tree.map(lambda x: after(x, order), (c.acc, c.z)))
               for k, c in enumerate(copies.values())]
        links.flush(after=tie(order, out))  # after the update: its wait holds a thread
        last = self.schedule.stages - 1
        held_sums = [c.sums for c in copies.values() if c.r == 0 and c.s == last]
        return (tuple(o[0] for o in out), tuple(o[1] for o in out), tuple(o[2] for o in out),
                held_sums[0] if held_sums else None)

    def _combine(self, d, copies, order):
        """With replicas: each copy's gradients and statistics summed with the other copy of
        its stage (on device S-1-d, which sends its copies in replica order), and replica 1's
        metric sums (on device 0) added into replica 0's (on device S-1)."""
        S, links = self.schedule.devices, self.links[d]
        if self.schedule.replicas == 1:
            return order
        other = S - 1 - d
        copies = {r: c for (r, _), c in copies.items()}  # one copy of each replica here
        mine = {r: (c.acc, c.z) for r, c in copies.items()}
        for r in sorted(mine):
            order = _send_tree(links, mine[r], other, order)
        theirs = {}
        for r in sorted(mine):  # the other device's copy r holds the stage of my copy 1 - r
            theirs[1 - r], order = _receive_tree(links, mine[1 - r], other, order)
        for r, c in copies.items():
            c.acc, c.z = jax.tree.map(jnp.add, (c.acc, c.z), theirs[r])
        if d == 0:  # replica 1's last stage
            order = _send_tree(links, copies[1].sums, S - 1, order)
        if d == S - 1:
            got, order = _receive_tree(links, copies[0].sums, 0, order)
            copies[0].sums = jax.tree.map(jnp.add, copies[0].sums, got)
        return order


def _send_tree(links, tree, dest, order):
    """`tree` to `dest`, leaf by leaf in order (as `_receive_tree` reads it); the order."""
    for leaf in jax.tree.leaves(tree):
        order = tie(order, links.send(leaf, dest, order))
    return order


def _receive_tree(links, like, sender, order):
    """A tree shaped like `like` from `sender`, leaf by leaf in order (each receive after the
    one before: unchained, XLA may run them in any order), and the order."""
    leaves, tree = jax.tree.flatten(like)
    got = []
    for x in leaves:
        got.append(links.receive(jax.ShapeDtypeStruct(x.shape, x.dtype), sender, order))
        order = tie(order, got[-1])
    return jax.tree.unflatten(tree, got), order
