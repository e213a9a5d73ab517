"""One walk of a schedule table by a host-driven pipeline (`host_pipeline.HostPipeline`):
each table entry dispatched to its device's stage program, what each device holds between
its slots (arrived activations and gradients, kept vjps), and at the end the gradients of
every stage copy (with replicas, summed over the copies).
"""

from __future__ import annotations

import functools

import jax

from jaxpar.parallel.transport import processes
from jaxpar.parallel.pipeline import schedules


class Walk:
    """What each device holds between its slots while the table is walked."""

    def __init__(self, pipe, state, batch, kind):
        self.p, self.state, self.kind = pipe, state, kind
        self.doing: tuple[str, int | None] = ("other", None)  # (kind, micro-batch) being run
        S, R = pipe.S, pipe.replicas
        self.images, self.labels, self.weights, self.denom = {}, {}, {}, {}
        for r in range(R):
            self.images[r] = self.prog(f"split_images{r}", 0, r)(batch["image"][r])
            self.labels[r], self.weights[r], self.denom[r] = self.prog(f"split_labels{r}", S - 1, r)(
                batch["label"][r], batch["weight"][r])
        self.acc, self.z_sum, self.sums = {}, {}, {}
        for r, s in pipe.copies:
            self.acc[r, s], self.z_sum[r, s], sums = self.prog(f"zeros{s}", s, r)(
                pipe._copy(state.params, r, s), pipe._copy(state.model_state, r, s))
            if s == S - 1:
                self.sums[r] = sums
        self.inbox: dict[tuple, jax.Array] = {}  # ("act" | "grad", r, m, s) -> arrived there
        self.kept: dict[tuple, object] = {}      # (r, m, s) -> the vjp (or input, --remat)
        # Across processes off the CPU a send is a collective program both processes queue at
        # the same point of the walk; sent as each slot ends, the receiving process's own slot
        # of the row would queue behind it and wait for the sender's work, so the stages took
        # turns. A row's sends go after the row's work instead (`end_row`): a slot only reads
        # what earlier rows sent. (Within a process a send is a `device_put`, on CPU across
        # processes a transfer neither queues: `transfers`; deferred to the row's end alike.)
        self.outbox: list[tuple] | None = [] if processes.many() else None

    def prog(self, name, s, r):
        device = self.p.device(s, r)
        if self.kind != "timeline":
            return self.p._prog(name, self.kind, device)
        kind, m = self.doing
        program = self.p._stamped(name)
        tag = self.p.stamps.tag(program=name, device=self.p.devices.index(device), stage=s,
                                replica=r, kind=kind, microbatch=m)
        return functools.partial(program, tag)

    def _send(self, what, x, r, m, s):
        if self.outbox is not None:
            self.outbox.append((what, x, r, m, s))
        else:
            self.inbox[what, r, m, s] = self.p.move(x, s, r)

    def end_row(self):
        """Send what the row's slots put in the outbox (across processes), in the row's order:
        every process walks the same table, so all queue the same collectives in one order."""
        if self.outbox:
            for what, x, r, m, s in self.outbox:
                self.inbox[what, r, m, s] = self.p.move(x, s, r)
            self.outbox.clear()

    def run(self, kind, m, r, d):
        """Device d's table entry: a forward or backward of micro-batch m of replica r."""
        p, S = self.p, self.p.S
        s = schedules.stage_of(d, r, S)
        i = m - r * (p.M // p.replicas)  # the micro-batch's index within its replica
        self.doing = ("F+B" if kind == "F" and s == S - 1 else kind, m)
        params, stats = p._copy(self.state.params, r, s), p._copy(self.state.model_state, r, s)
        if kind == "F":
            x = self.images[r][i] if s == 0 else self.inbox.pop(("act", r, m, s))
            if s == S - 1:  # forward, loss and backward at once
                self.acc[r, s], dx, self.z_sum[r, s], self.sums[r] = self.prog("last", s, r)(
                    params, stats, x, self.labels[r][i], self.weights[r][i], self.denom[r],
                    self.acc[r, s], self.z_sum[r, s], self.sums[r])
                if S > 1:
                    self._send("grad", dx, r, m, s - 1)
                return
            out, vjp, self.z_sum[r, s] = self.prog(f"train_fwd{s}", s, r)(params, stats, x, self.z_sum[r, s])
            self.kept[r, m, s] = x if p.remat else vjp
            self._send("act", out, r, m, s + 1)
            return
        if s == S - 1:
            return  # done with its forward
        g, kept = self.inbox.pop(("grad", r, m, s)), self.kept.pop((r, m, s))
        args = (params, stats, kept, g) if p.remat else (kept, g)
        self.acc[r, s], dx = self.prog(f"bwd{s}", s, r)(*args, self.acc[r, s])
        if s > 0:
            self._send("grad", dx, r, m, s - 1)

    def finish(self):
        self.doing = ("other", None)
        return self._combine()

    def _combine(self):
        """(gradients, statistics per copy, metric sums): with replicas, each copy of a stage
        gets the sum of every replica's, so all copies take the same update."""
        p = self.p
        acc, z_sum = dict(self.acc), dict(self.z_sum)
        if p.replicas > 1:
            for r, s in p.copies:
                for other in range(p.replicas):
                    if other != r:
                        theirs = p.move((self.acc[other, s], self.z_sum[other, s]), s, r)
                        acc[r, s], z_sum[r, s] = self.prog(f"add{s}", s, r)((acc[r, s], z_sum[r, s]), theirs)
            sums = self.prog("add_sums", p.S - 1, 0)(self.sums[0], p.move(self.sums[1], p.S - 1, 0))
        else:
            sums = self.sums[0]
        order = p.copies
        return tuple(acc[c] for c in order), tuple(z_sum[c] for c in order), sums
