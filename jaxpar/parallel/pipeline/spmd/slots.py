"""Any schedule's table run slot by slot inside the SPMD program (`loops.slot_program`): each
slot a device runs one forward or one backward through one of its stage copies, then sends
what it made to both neighbours (`lax.ppermute` each way), which keep it in an inbox slot
until the backward that uses it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar import step as steplib
from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline.spmd.loops import Loops


def run_slots(loops: Loops, params, state, batch):
    """Run the schedule slot by slot. Returns per replica copy the gradients and summed
    batch-norm statistics (local shapes), and the metric sums."""
    ops, recv, size = (jnp.asarray(loops.program[0]), jnp.asarray(loops.program[1]), loops.program[2])
    d, S = lax.axis_index(STAGE), loops.S
    mb, denom = loops.micro(batch, loops.M), loops.denom(batch)
    branches = ([functools.partial(_idle, loops)] + [functools.partial(_slot_forward, loops, st) for st in range(S)]
                + [functools.partial(_slot_backward, loops, st) for st in range(S)])
    zeros = lambda tree: loops.vary_buffers(jax.tree.map(jnp.zeros_like, tree))  # noqa: E731
    rows = mb["label"].shape[1]

    def slot(carry, t):
        inbox, grads, z_sum, sums = carry
        kind, st, r, m, act, grad = (ops[t, d, i] for i in range(6))
        x = jax.tree.map(lambda a: a[m], mb)
        pick = lambda tree: {k: v[r] for k, v in loops.mine(tree, slice(None)).items()}  # noqa: E731
        index = jnp.where(kind == 0, 0, jnp.where(kind == 1, 1 + st, 1 + S + st))
        send, dp, dz, sums_m = lax.switch(index, branches, pick(params), pick(state), x,
                                          inbox[jnp.maximum(act, 0)], inbox[jnp.maximum(grad, 0)], denom)
        grads = {k: v.at[r].add(dp[k]) for k, v in grads.items()}
        z_sum = {k: v.at[r].add(dz[k]) for k, v in z_sum.items()}
        sums = jax.tree.map(jnp.add, sums, sums_m)
        from_left = lax.ppermute(send, STAGE, [(i, i + 1) for i in range(S - 1)])
        from_right = lax.ppermute(send, STAGE, [(i + 1, i) for i in range(S - 1)])
        for got, where in ((from_left, recv[t, d, 0]), (from_right, recv[t, d, 1])):
            inbox = jnp.where(where >= 0, inbox.at[jnp.maximum(where, 0)].set(got), inbox)
        return (inbox, grads, z_sum, sums), None

    init = (loops.vary_tree(jnp.zeros((size, rows, loops.stages.width), jnp.float32)),
            zeros(loops.mine(params, slice(None))), zeros(loops.mine(state, slice(None))), loops.zero_sums())
    (_, grads, z_sum, sums), _ = lax.scan(slot, init, jnp.arange(len(loops.program[0])))
    return grads, z_sum, sums


def _idle(loops, p, z, x, act, grad, denom):
    rows = x["label"].shape[0]
    return (loops.vary_tree(jnp.zeros((rows, loops.stages.width), jnp.float32)),
            loops.vary_buffers(jax.tree.map(jnp.zeros_like, p)),
            loops.vary_buffers(jax.tree.map(jnp.zeros_like, z)), loops.zero_sums())


def _slot_forward(loops, s, p, z, x, act, grad, denom):
    if s == loops.S - 1:  # its backward recomputes it and takes the loss
        return _idle(loops, p, z, x, act, grad, denom)
    out, _ = loops.forward(s, p, z, x["image"] if s == 0 else act, True)
    return (out, *_idle(loops, p, z, x, act, grad, denom)[1:])


def _slot_backward(loops, s, p, z, x, act, grad, denom):
    """Recompute stage s from its input, then its vjp: the gradients of its parameters, of
    its input (sent back), its batch-norm statistics and, on the last stage, the loss's
    metric sums."""
    last = s == loops.S - 1

    def run(q, h):
        out, z_new = loops.forward(s, q, z, x["image"] if s == 0 else h, True)
        if not last:
            return out, (z_new, loops.zero_sums())
        loss, sums = steplib.loss_from_logits(out[:, :loops.stages.classes], x, denom)
        return loss, (z_new, loops.vary_tree(sums))

    if s == 0:
        _, vjp, (z_new, sums) = jax.vjp(lambda q: run(q, act), p, has_aux=True)
        dh = jnp.zeros_like(act)
    else:
        _, vjp, (z_new, sums) = jax.vjp(run, p, act, has_aux=True)
    ct = loops.vary_tree(jnp.ones((), jnp.float32)) if last else grad
    dp, *rest = vjp(ct)
    dh = rest[0] if s > 0 else loops.vary_tree(dh)
    return loops.vary_tree(dh), loops.vary_buffers(dp), z_new, sums
