"""A host-driven pipeline's step as one program per process, where each process holds one stage.

Across processes on CPU, walking the schedule from the host (`host_walk`) costs each process
some 40 dispatches and transfers a step on the core its stage computes on (CNN, 2
single-threaded ranks, 1F1B: ~10 ms a step beside the stages' 27 ms; 1.2x one rank). When
every process holds exactly one stage on one device (`pipeline` or `layer-split` with one
device per rank), its step is instead one jitted program: the stage's column of the table
written out (`column.walk`), the activations and gradients sent and received by the program
itself (`p2p`), then the optimizer update. The stage functions are the host walk's own
(`HostPipeline._train_forward`, `_backward`, `_last`, `_update`), so both give the same step;
`gradients`, `eval_step` and the measured timeline keep the host walk.

    RankStep.reason_not(pipe)   # None: the step runs as one program per process
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar import step as steplib
from jaxpar.parallel import addresses, column, p2p, processes


class RankStep:
    """This process's stage, its step as one program; messages over `p2p` links."""

    def __init__(self, pipe):
        self.p = pipe
        self.s = next(s for s in range(pipe.S) if processes.owns(pipe.device(s)))
        self.process_of = {t: pipe.device(t).process_index for t in range(pipe.S)}
        self.links = p2p.connect({self.process_of[t] for t in (self.s - 1, self.s + 1) if 0 <= t < pipe.S})
        pipe._register("rank_step", self._step, donate_argnums=(0, 1), static_argnums=(6,))

    @staticmethod
    def reason_not(pipe) -> str | None:
        """Why `pipe`'s step is not one program per process here (None: it is)."""
        if not processes.many():
            return "one process"
        if pipe.replicas != 1:
            return "a stage has copies on two devices (GEMS)"
        owners = {pipe.device(s).process_index for s in range(pipe.S)}
        if pipe.mesh.devices.size != pipe.S or len(owners) != pipe.S or pipe.S != jax.process_count():
            return "not one stage, on one device, per process"
        # Every process must choose alike (connecting is a collective): one that cannot build
        # the custom calls (no compiler on its host) sends the whole job to the host walk.
        every = addresses.exchange(p2p.unavailable() or "")
        return next((f"process {i}: {why}" for i, why in enumerate(every) if why), None)

    def step(self, state, batch):
        """`HostPipeline.step`'s result: this process's stage updated by its program; the
        other stages' entries stay the handles they are here."""
        p, s, last = self.p, self.s, self.s == self.p.S - 1
        params, opt, stats, sums = p._call(
            "rank_step", state.params[s], state.opt_state[s], state.model_state[s],
            batch["image"][0] if s == 0 else None, batch["label"][0] if last else None,
            batch["weight"][0] if last else None, batch["label"][0].shape[0])
        if not last:  # the metric sums live on the last stage's device
            sums = {k: processes.handle((), jnp.float32, p.device(p.S - 1)) for k in steplib.SUMS}
        swap = lambda tree, new: tree[:s] + (new,) + tree[s + 1:]  # noqa: E731
        return state.replace(step=state.step + 1, params=swap(state.params, params),
                             opt_state=swap(state.opt_state, opt),
                             model_state=swap(state.model_state, stats)), sums

    def _arriving(self, t: int, rows: int) -> jax.ShapeDtypeStruct:
        """What crosses boundary t (stage t's output, or its gradient) for a micro-batch."""
        return jax.ShapeDtypeStruct((rows // self.p.M, *self.p.boundary_shapes[t]), jnp.float32)

    def _step(self, params, opt, stats, image, label, weight, rows):
        p, s, S = self.p, self.s, self.p.S
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
                return {}, column.tie(order, to_send[m])
            if s == S - 1:  # its backward slot only sends what its forward slot computed
                return {"B": to_send.pop(m)}, order
            g = column.after(arrived, order)
            if p.remat:
                box["acc"], dx = p._backward_remat(s, params, stats, kept.pop(m), g, box["acc"])
            else:
                box["acc"], dx = p._backward(s, kept.pop(m), g, box["acc"])
            return {"B": dx}, column.tie(order, box["acc"])  # receives wait for the slot's work

        def receive(kind, sender, order):
            spec = self._arriving(s - 1 if kind == "F" else s, rows)
            return self.links.receive(spec, self.process_of[sender], order)

        column.walk(p.table, s, S, run_slot, receive,
                    lambda kind, x, dest: self.links.send(x, self.process_of[dest]))
        params, opt, stats = p._update(params, opt, box["acc"], box["z"])
        return params, opt, stats, (box["sums"] if s == S - 1 else None)
