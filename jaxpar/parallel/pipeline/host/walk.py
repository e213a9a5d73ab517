"""One walk of a schedule's table from the host: each action dispatched to its device's stage
program, what each device holds between its slots (arrived activations and gradients, kept
vjps), and at the end the gradients of every stage copy (with replicas, summed over the copies).

Dispatch is asynchronous: the host runs ahead, each device runs its queue in order, and a
program starts when its inputs have arrived, so the stages overlap as the table says. The
last stage runs each micro-batch's forward and backward together, at its forward's slot.

    acc, z_sum, sums = walk(schedule, programs, placement, states, state, batch, "step")
"""

from __future__ import annotations

import functools

import jax

from jaxpar.parallel.pipeline.schedules import BACKWARD, FORWARD, Action, rows
from jaxpar.parallel.pipeline.schedules.actions import WEIGHT
from jaxpar.parallel.transport import processes


def walk(schedule, programs, placement, states, state, batch, kind: str):
    """Run `schedule` (kind: 'step', 'gradients' or 'timeline', the stamped programs): per
    copy (replica, stage) the summed gradients and batch-norm statistics, and the metric sums
    (on replica 0's last stage)."""
    return drive(Walk(schedule, programs, placement, states, state, batch, kind))


def drive(w: "Walk"):
    """Walk `w`'s table row by row, each row's sends at its end; what `Walk.finish` returns."""
    for row in rows(w.schedule):
        for action in row:
            if action is not None:
                w.run(action)
        w.end_row()
    return w.finish()


class Walk:
    """What each device holds between its slots while the table is walked."""

    def __init__(self, schedule, programs, placement, states, state, batch, kind):
        self.schedule, self.programs, self.placement, self.states = schedule, programs, placement, states
        self.fns, self.state, self.kind = states.fns, state, kind
        self.doing: tuple[str, int | None] = ("other", None)  # (kind, micro-batch) being run
        S, R = schedule.stages, schedule.replicas
        self.images, self.labels, self.weights, self.denom = {}, {}, {}, {}
        for r in range(R):
            self.images[r] = self.prog(f"split_images{r}", 0, r)(batch["image"][r])
            self.labels[r], self.weights[r], self.denom[r] = self.prog(f"split_labels{r}", S - 1, r)(
                batch["label"][r], batch["weight"][r])
        self.acc, self.z_sum, self.sums = {}, {}, {}
        for r, s in states.copies:
            self.acc[r, s], self.z_sum[r, s], sums = self.prog(f"zeros{s}", s, r)(
                states.copy(state.params, r, s), states.copy(state.model_state, r, s))
            if s == S - 1:
                self.sums[r] = sums
        self.inbox: dict[tuple, jax.Array] = {}  # ("act" | "grad", r, m, s) -> arrived there
        self.kept: dict[tuple, object] = {}      # (r, m, s) -> the vjp (or input, with remat)
        self.for_weights: dict[tuple, tuple] = {}  # (r, m, s) -> (vjps, cotangents) awaiting W
        # Across processes off the CPU a send is a collective program both processes queue at
        # the same point of the walk; sent as each slot ends, the receiving process's own slot
        # of the row would queue behind it and wait for the sender's work, so the stages took
        # turns. A row's sends go after the row's work instead (`end_row`): a slot only reads
        # what earlier rows sent. (Within a process a send is a `device_put`, on CPU across
        # processes a transfer neither queues: `transfers`; deferred to the row's end alike.)
        self.outbox: list[tuple] | None = [] if processes.many() else None

    def prog(self, name, s, r):
        device = self.placement.device(s, r)
        if self.kind != "timeline":
            return self.programs.get(name, self.kind, device)
        kind, m = self.doing
        tag = self.programs.stamps.tag(program=name, device=self.placement.devices.index(device), stage=s,
                                       replica=r, kind=kind, microbatch=m)
        return functools.partial(self.programs.stamped(name), tag)

    def _send(self, what, x, r, m, s):
        if self.outbox is not None:
            self.outbox.append((what, x, r, m, s))
        else:
            self.inbox[what, r, m, s] = self.placement.move(x, s, r)

    def end_row(self):
        """Send what the row's slots put in the outbox (across processes), in the row's order:
        every process walks the same table, so all queue the same collectives in one order."""
        if self.outbox:
            for what, x, r, m, s in self.outbox:
                self.inbox[what, r, m, s] = self.placement.move(x, s, r)
            self.outbox.clear()

    def run(self, action: Action):
        """A forward or backward of micro-batch m of replica r through stage s."""
        if self.schedule.splits_backward:
            return self._run_split(action)
        S, fns = self.schedule.stages, self.fns
        kind, m, s, r = action
        i = m - r * self.schedule.per_replica()  # the micro-batch's index within its replica
        self.doing = ("F+B" if kind == FORWARD and s == S - 1 else kind, m)
        params, stats = self.states.copy(self.state.params, r, s), self.states.copy(self.state.model_state, r, s)
        if kind == FORWARD:
            x = self.images[r][i] if s == 0 else self.inbox.pop(("act", r, m, s))
            if s == S - 1:  # forward, loss and backward at once
                self.acc[r, s], dx, self.z_sum[r, s], self.sums[r] = self.prog("last", s, r)(
                    params, stats, x, self.labels[r][i], self.weights[r][i], self.denom[r],
                    self.acc[r, s], self.z_sum[r, s], self.sums[r])
                if S > 1:
                    self._send("grad", dx, r, m, s - 1)
                return
            out, vjp, self.z_sum[r, s] = self.prog(f"train_fwd{s}", s, r)(params, stats, x, self.z_sum[r, s])
            self.kept[r, m, s] = x if fns.remat else vjp
            self._send("act", out, r, m, s + 1)
            return
        if s == S - 1:
            return  # done with its forward
        g, kept = self.inbox.pop(("grad", r, m, s)), self.kept.pop((r, m, s))
        args = (params, stats, kept, g) if fns.remat else (kept, g)
        self.acc[r, s], dx = self.prog(f"bwd{s}", s, r)(*args, self.acc[r, s])
        if s > 0:
            self._send("grad", dx, r, m, s - 1)

    def _run_split(self, action: Action):
        """A schedule that splits backwards: forwards keep each layer's vjp, an input gradient
        (I) each layer's cotangent, and the weight gradient (W) uses both; a whole backward (B)
        is both at once. The last stage computes its input gradient in its forward's slot."""
        S, fns = self.schedule.stages, self.fns
        kind, m, s, r = action
        i, key = m - r * self.schedule.per_replica(), (r, m, s)
        self.doing = ("F+I" if kind == FORWARD and s == S - 1 else kind, m)
        params, stats = self.states.copy(self.state.params, r, s), self.states.copy(self.state.model_state, r, s)
        if kind == FORWARD and s < S - 1:
            x = self.images[r][i] if s == 0 else self.inbox.pop(("act", r, m, s))
            out, vjps, self.z_sum[r, s] = self.prog(f"layers_fwd{s}", s, r)(params, stats, x, self.z_sum[r, s])
            self.kept[key] = x if fns.remat else vjps
            self._send("act", out, r, m, s + 1)
        elif kind == FORWARD:
            x = self.inbox.pop(("act", r, m, s)) if S > 1 else self.images[r][i]
            dx, vjps, cts, self.z_sum[r, s], self.sums[r] = self.prog("last_in", s, r)(
                params, stats, x, self.labels[r][i], self.weights[r][i], self.denom[r], self.z_sum[r, s], self.sums[r])
            self.for_weights[key] = (vjps, cts)
            if S > 1:
                self._send("grad", dx, r, m, s - 1)
        elif kind == WEIGHT:
            self.acc[r, s] = self.prog(f"bwd_w{s}", s, r)(*self.for_weights.pop(key), self.acc[r, s])
        else:  # I, or B: I then W
            if s < S - 1:
                self._input_gradient(params, stats, key, s, r, m)
            if kind == BACKWARD:
                self._run_split(action._replace(kind=WEIGHT))

    def _input_gradient(self, params, stats, key, s, r, m):
        g, kept = self.inbox.pop(("grad", r, m, s)), self.kept.pop(key)
        if self.fns.remat:
            dx, cts, vjps = self.prog(f"bwd_in{s}", s, r)(params, stats, kept, g)
        else:
            (dx, cts), vjps = self.prog(f"bwd_in{s}", s, r)(kept, g), kept
        self.for_weights[key] = (vjps, cts)
        if s > 0:
            self._send("grad", dx, r, m, s - 1)

    def finish(self):
        """(gradients, statistics per copy, metric sums): with replicas, each copy of a stage
        gets the sum of every replica's, so all copies take the same update."""
        self.doing = ("other", None)
        states, move = self.states, self.placement.move
        acc, z_sum = dict(self.acc), dict(self.z_sum)
        if self.schedule.replicas > 1:
            for r, s in states.copies:
                for other in range(self.schedule.replicas):
                    if other != r:
                        theirs = move((self.acc[other, s], self.z_sum[other, s]), s, r)
                        acc[r, s], z_sum[r, s] = self.prog(f"add{s}", s, r)((acc[r, s], z_sum[r, s]), theirs)
            last = self.schedule.stages - 1
            sums = self.prog("add_sums", last, 0)(self.sums[0], move(self.sums[1], last, 0))
        else:
            sums = self.sums[0]
        return tuple(acc[c] for c in states.copies), tuple(z_sum[c] for c in states.copies), sums
