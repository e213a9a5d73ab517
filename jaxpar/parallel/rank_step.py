"""A host-driven pipeline's step as one program per stage, each on its stage's own device.

Walking the schedule from the host (`host_walk`) costs some 40 dispatches and transfers a step
on the cores the stages compute on: across processes (CNN, 2 single-threaded ranks, 1F1B) ~10
ms a step beside the stages' 27 ms, 1.2x one rank; within one process (CNN, 2 simulated
devices) ~6 ms of a core a step, and on 4 devices more. Where every stage has a device of its
own (`pipeline` and `layer-split`; not GEMS, whose devices hold two stages' copies), its step
is instead one jitted program per stage: the stage's column of the table written out
(`column.walk`), the activations and gradients sent and received by the program itself
(`p2p`: a loopback connection per boundary within a process, one per neighbouring process
across processes), then the optimizer update. Within a process all stages' programs are
dispatched before any is waited on, and run at once, each on its device's thread. The stage
functions are the host walk's own (`HostPipeline._train_forward`, `_backward`, `_last`,
`_update`), so both give the same step; `gradients`, `eval_step` and the measured timeline
keep the host walk.

    RankStep.reason_not(pipe)   # None: the step runs as one program per stage
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar import measure
from jaxpar import step as steplib
from jaxpar.parallel import addresses, column, p2p, processes


class RankStep:
    """The stages this process holds, each step as one program; messages over `p2p` links."""

    def __init__(self, pipe):
        self.p = pipe
        self.mine = [s for s in range(pipe.S) if processes.owns(pipe.device(s))]
        self.links = self._connect()
        for s in self.mine:
            pipe._register(f"rank_step{s}", functools.partial(self._step, s),
                           donate_argnums=(0, 1), static_argnums=(6,))

    def _connect(self) -> dict[int, p2p.Links]:
        """Per stage held here, its links keyed by neighbouring stage: across processes one
        connection per neighbouring process; within one, a connected pair per boundary."""
        S, near = self.p.S, lambda s: [t for t in (s - 1, s + 1) if 0 <= t < self.p.S]  # noqa: E731
        if processes.many():
            process_of = {t: self.p.device(t).process_index for t in range(S)}
            (s,) = self.mine
            links = p2p.connect({process_of[t] for t in near(s)})
            return {s: links.renamed({t: process_of[t] for t in near(s)})}
        ends = {b: p2p.pair() for b in range(S - 1)}  # boundary b: stage b <-> stage b + 1
        return {s: p2p.Links({t: ends[min(s, t)][0 if s < t else 1] for t in near(s)}) for s in self.mine}

    @staticmethod
    def reason_not(pipe) -> str | None:
        """Why `pipe`'s step is not one program per stage here (None: it is)."""
        if pipe.replicas != 1:
            return "a stage has copies on two devices (GEMS)"
        if pipe.mesh.devices.size != pipe.S or len({pipe.device(s) for s in range(pipe.S)}) != pipe.S:
            return "not one stage on each device"
        if not processes.many():
            return p2p.unavailable()
        owners = {pipe.device(s).process_index for s in range(pipe.S)}
        if len(owners) != pipe.S or pipe.S != jax.process_count():
            return "not one stage, on one device, per process"
        # Every process must choose alike (connecting is a collective): one that cannot build
        # the custom calls (no compiler on its host) sends the whole job to the host walk.
        every = addresses.exchange(p2p.unavailable() or "")
        return next((f"process {i}: {why}" for i, why in enumerate(every) if why), None)

    def step(self, state, batch):
        """`HostPipeline.step`'s result: the stages held here updated by their programs (all
        dispatched before any is waited on: they exchange messages while they run); other
        processes' stages stay the handles they are here."""
        p, S = self.p, self.p.S
        params, opts, stats = list(state.params), list(state.opt_state), list(state.model_state)
        sums = None
        for s in self.mine:
            args, rows = self._arguments(s, state, batch)
            compiled = p.compiled.get(self._key(s))  # AOT (`compile`): no static argument
            out = compiled(*args) if compiled else getattr(p, f"_jit_rank_step{s}")(*args, rows)
            params[s], opts[s], stats[s], sums = out if s == S - 1 else (*out[:3], sums)
        if sums is None:  # the metric sums live on the last stage's device, another process's
            sums = {k: processes.handle((), jnp.float32, p.device(S - 1)) for k in steplib.SUMS}
        return state.replace(step=state.step + 1, params=tuple(params), opt_state=tuple(opts),
                             model_state=tuple(stats)), sums

    def compile(self, state, batch) -> list[measure.Program]:
        """The programs of the stages held here, compiled (as `step` then calls them)."""
        parts = []
        for s in self.mine:
            args, rows = self._arguments(s, state, batch)
            executable = getattr(self.p, f"_jit_rank_step{s}").lower(*args, rows).compile()
            self.p.compiled[self._key(s)] = executable
            parts.append(measure.Program(f"rank_step{s}@0", executable, stage=s))
        return parts

    def _key(self, s):
        """Where `compile` keeps stage s's program (`HostPipeline.compiled`'s keys)."""
        return ("step", f"rank_step{s}", self.p.device(s).id)

    def _arguments(self, s, state, batch) -> tuple[tuple, int]:
        """Stage s's program arguments (its state; the images on the first stage, labels and
        weights on the last) and the global batch's rows (static)."""
        first, last = s == 0, s == self.p.S - 1
        return (state.params[s], state.opt_state[s], state.model_state[s],
                batch["image"][0] if first else None, batch["label"][0] if last else None,
                batch["weight"][0] if last else None), batch["label"][0].shape[0]

    def _arriving(self, t: int, rows: int) -> jax.ShapeDtypeStruct:
        """What crosses boundary t (stage t's output, or its gradient) for a micro-batch."""
        return jax.ShapeDtypeStruct((rows // self.p.M, *self.p.boundary_shapes[t]), jnp.float32)

    def _step(self, s, params, opt, stats, image, label, weight, rows):
        p, S = self.p, self.p.S
        acc, z_sum, sums = p._zeros(s, params, stats)
        box = {"acc": acc, "z": z_sum, "sums": sums}
        images = p._split_images(0, image) if s == 0 else None
        labels, weights, denom = p._split_labels(0, label, weight) if s == S - 1 else (None,) * 3
        kept, to_send = {}, {}  # by micro-batch: what F keeps for B; the last stage's gradients

        def run_slot(kind, m, arrived, order):
            if kind == "F" and s < S - 1:
                x = column.after(images[m] if s == 0 else arrived, order)
                out, vjp, box["z"] = p._train_forward(s, params, stats, x, box["z"])
                kept[m] = x if p.remat else vjp
                return {"F": out}, column.tie(order, out)
            if kind == "F":  # the last stage: forward, loss and backward at once, as the walk does
                x = column.after(arrived, order)
                box["acc"], to_send[m], box["z"], box["sums"] = p._last(
                    params, stats, x, labels[m], weights[m], denom, box["acc"], box["z"], box["sums"])
                # tied to the accumulated gradients too, else XLA sums them all at the end
                # and holds every micro-batch's parameter gradients until then
                return {}, column.tie(order, (to_send[m], box["acc"]))
            if s == S - 1:  # its backward slot only sends what its forward slot computed
                return {"B": to_send.pop(m)}, order
            g = column.after(arrived, order)
            if p.remat:
                # the input made to wait for this slot: the recomputed forward is then not the
                # first one's expression, which XLA would merge with it (and keep its residuals)
                x = column.after(kept.pop(m), order)
                box["acc"], dx = p._backward_remat(s, params, stats, x, g, box["acc"])
            else:
                box["acc"], dx = p._backward(s, kept.pop(m), g, box["acc"])
            return {"B": dx}, column.tie(order, box["acc"])  # receives wait for the slot's work

        def receive(kind, sender, order):
            spec = self._arriving(s - 1 if kind == "F" else s, rows)
            return self.links[s].receive(spec, sender, order)

        column.walk(p.table, s, S, run_slot, receive, lambda kind, x, dest: self.links[s].send(x, dest))
        params, opt, stats = p._update(params, opt, box["acc"], box["z"])
        return params, opt, stats, (box["sums"] if s == S - 1 else None)
