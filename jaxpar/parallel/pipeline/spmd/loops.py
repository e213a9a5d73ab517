"""The traced body of the SPMD pipeline: the schedule run inside one `jax.shard_map` program.

- A fill-drain table (GPipe) runs as a `lax.scan` over its M + S - 1 forward ticks; `jax.grad`
  of that loop runs the backward ticks in reverse: every micro-batch's activations kept
  (with remat only each stage's input, the stage recomputed in the backward). XLA keeps the
  residuals of every `lax.switch` branch that differ in shape (zeros for the branches not
  taken), so without remat a device holds every stage's residual types, not only its own.
- Any other table (1F1B, GEMS) runs slot by slot (`slot_program`): each slot a device runs
  one forward or one backward (a `jax.vjp` that recomputes its stage from the stage input
  kept in its inbox), so stage s keeps only the inputs the table has in flight there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar import step as steplib
from jaxpar.mesh import STAGE, TENSOR
from jaxpar.parallel.pipeline.schedules import FORWARD, Schedule, rows
from jaxpar.parallel.pipeline.spmd.layout import REP, SPLIT, PaddedStages


def vary(x, axes: tuple[str, ...]):
    """`x` cast to varying over `axes` (those it is not varying over already): every branch
    of a `lax.switch`, and every carry of a loop, must agree on the axes it varies over."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def slot_program(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, int]:
    """The schedule's table compiled for the slot loop: what each device does, and where its
    messages wait. A message (a stage input sent forward, a gradient sent back) waits in a
    slot of the receiving device's inbox from the end of the slot it was sent in until the
    backward that uses it (a stage input is kept for the backward, which recomputes the stage
    from it); slots are reused as soon as they are free.

    Returns:
      ops [T, S, 6] int32, per slot and device: kind (0 idle, 1 F, 2 B), stage, replica,
        micro-batch, the inbox slot of the stage input (-1: stage 0 reads the images) and of
        the incoming gradient (-1: none);
      recv [T, S, 2] int32: the inbox slot where what device d-1 (0) or d+1 (1) sent in slot
        t is kept (-1: nothing for this device);
      the inbox size (slots per device).
    """
    table, S = rows(schedule), schedule.stages
    T = len(table)
    ops = np.zeros((T, S, 6), np.int32)
    ops[..., 4:] = -1
    recv = -np.ones((T, S, 2), np.int32)
    held: dict[tuple, int] = {}   # (device, "act" | "grad", replica, m) -> inbox slot
    used: list[set[int]] = [set() for _ in range(S)]
    size = 0
    for t, row in enumerate(table):
        for d, a in enumerate(row):  # reads, then frees after a backward
            if a is None:
                continue
            act = held[(d, "act", a.replica, a.microbatch)] if a.stage > 0 else -1
            grad = held[(d, "grad", a.replica, a.microbatch)] if a.kind != FORWARD and a.stage < S - 1 else -1
            ops[t, d] = (1 if a.kind == FORWARD else 2, a.stage, a.replica, a.microbatch, act, grad)
            if a.kind != FORWARD:
                for what in ("act", "grad"):
                    used[d].discard(held.pop((d, what, a.replica, a.microbatch), -1))
        for d, a in enumerate(row):  # sends arrive at the end of the slot
            if a is None or (a.kind == FORWARD and a.stage == S - 1) or (a.kind != FORWARD and a.stage == 0):
                continue  # the last stage's output is the loss; stage 0's gradient ends here
            to = schedule.device_of(a.stage + 1 if a.kind == FORWARD else a.stage - 1, a.replica)
            free = min(set(range(len(used[to]) + 1)) - used[to])
            used[to].add(free)
            held[(to, "act" if a.kind == FORWARD else "grad", a.replica, a.microbatch)] = free
            recv[t, to, 0 if to == d + 1 else 1] = free
            size = max(size, free + 1)
    return ops, recv, size


class Loops:
    """The per-device functions of the SPMD step, for padded `stages` on S devices.

    Args:
      sum_axes: axes over which per-device metrics are summed (STAGE, and DATA for hybrid).
      data_axis: the batch's axis (hybrid: DATA), or None.
    """

    def __init__(self, stages: PaddedStages, schedule: Schedule, remat: bool, data_axis: str | None):
        self.stages, self.schedule, self.remat, self.data_axis = stages, schedule, remat, data_axis
        self.S, self.M = schedule.devices, schedule.microbatches
        self.program = slot_program(schedule)
        self.sum_axes = (STAGE,) + ((data_axis,) if data_axis else ())

    def vary_tree(self, tree, kind: str = REP):
        axes = self.sum_axes + ((TENSOR,) if kind == SPLIT else ())
        return jax.tree.map(lambda x: vary(x, axes), tree)

    def vary_buffers(self, buffers):
        return {k: self.vary_tree(v, k) for k, v in buffers.items()}

    @staticmethod
    def mine(buffers, copy):
        """This device's vectors of one replica copy from its [1, (1,) copies, n] shards."""
        return {k: (v[0] if k == REP else v[0, 0])[copy] for k, v in buffers.items()}

    @staticmethod
    def local(vectors):
        """[copies, n] vectors back in the layout of this device's shard ([1, (1,) copies, n])."""
        return {k: v[None] if k == REP else v[None, None] for k, v in vectors.items()}

    def denom(self, batch):
        total = batch["weight"].sum()
        return lax.psum(total, self.data_axis) if self.data_axis else total

    @staticmethod
    def micro(batch, m_count):
        return jax.tree.map(lambda x: x.reshape(m_count, -1, *x.shape[1:]), batch)

    def forward(self, s, params, state, inp, train):
        run = functools.partial(self.stages.forward, s, train=train)
        out, new = (jax.checkpoint(run) if self.remat else run)(params, state, inp)
        return self.vary_tree(out), self.vary_buffers(new)

    def zero_sums(self):
        return self.vary_tree({k: jnp.zeros((), jnp.float32) for k in steplib.SUMS})

    # --- fill-drain: grad of a forward tick loop ------------------------------------------------
    def fill_drain_loss(self, params, state, batch, m_count, train=True):
        """This stage's share of the loss (non-zero on the last stage), its metric sums and its
        batch-norm statistics summed over its micro-batches."""
        S, s = self.S, lax.axis_index(STAGE)
        p, z = self.mine(params, 0), self.mine(state, 0)
        mb, denom = self.micro(batch, m_count), self.denom(batch)
        branches = [functools.partial(self._tick_branch, st, train) for st in range(S)]
        zeros = lambda tree: self.vary_buffers(jax.tree.map(jnp.zeros_like, tree))  # noqa: E731

        def tick(carry, t):
            recv, loss, sums, z_sum = carry
            first = jax.tree.map(lambda x: x[jnp.clip(t, 0, m_count - 1)], mb)
            out, z_new = lax.switch(s, branches, p, z, first["image"], recv)
            mine = (t - s >= 0) & (t - s < m_count)  # a real micro-batch on this stage
            z_sum = jax.tree.map(lambda a, b: a + jnp.where(mine, b, 0.0), z_sum, z_new)
            m_out = t - (S - 1)
            last = jax.tree.map(lambda x: x[jnp.clip(m_out, 0, m_count - 1)], mb)
            loss_m, sums_m = steplib.loss_from_logits(out[:, :self.stages.classes], last, denom)
            keep = (s == S - 1) & (m_out >= 0)
            loss = loss + jnp.where(keep, loss_m, 0.0)
            sums = jax.tree.map(lambda a, b: a + jnp.where(keep, b, 0.0), sums, sums_m)
            send = lax.ppermute(out, STAGE, [(i, i + 1) for i in range(S - 1)])
            return (send, loss, sums, z_sum), None

        init = (self.vary_tree(jnp.zeros((mb["label"].shape[1], self.stages.width), jnp.float32)),
                self.vary_tree(jnp.zeros((), jnp.float32)), self.zero_sums(), zeros(z))
        (_, loss, sums, z_sum), _ = lax.scan(tick, init, jnp.arange(m_count + S - 1))
        return loss, (sums, z_sum)

    def _tick_branch(self, s, train, p, z, image, recv):
        return self.forward(s, p, z, image if s == 0 else recv, train)
