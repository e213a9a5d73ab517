"""A layer's backward in two halves that share their work: the input gradient (I, on the
pipeline's critical path) and the weight gradient (W, deferred into the bubble by zero-bubble
schedules).

Two VJPs of one layer, one asked for the input half and one for the parameter half (XLA
pruning the other), each compute every cotangent inside the layer that their outputs need: a
residual block's weight gradients need its hidden activation's cotangent, which its input
gradient has computed already, so W computed it again, and W cost a whole backward
(stack-mlp, 5 blocks of 256 x 1024, 32 rows, one thread: the backward 7.1 ms whole; split,
I 2.5 + W 7.1). Here the layer's backward is traced once as a jaxpr and cut in two: I runs
the equations its input gradient needs and also returns each of their values that the
weight gradient's equations read; W runs only the equations I did not (I 2.5 + W 5.1, the
weight gradients' own matmuls). Both halves trace the same backward, so they agree on what
is handed over; an equation that makes both halves' values at once (a fused custom call)
runs in I.

    dx, kept = input_half(vjp, g)      # vjp = jax.vjp(layer, params, h)[1]; g: its output's cotangent
    grads = weight_half(vjp, kept)     # the parameter gradients, as vjp(g)[0] gives them
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Var, jaxpr_as_fun
# Pruning a jaxpr to some of its outputs has no public API; this is the one jax.vjp and jit use.
from jax._src.interpreters.partial_eval import dce_jaxpr


@dataclass(frozen=True)
class _Cut:
    backward: ClosedJaxpr   # the whole backward: g's leaves -> parameter leaves + input leaves
    grads_tree: object      # the parameter gradients' structure
    input_tree: object      # the input gradient's structure
    input_eqns: list        # the equations of the input half, in order
    weight_eqns: list       # those of the parameter half that the input half does not run
    handed: list            # the input half's values the weight half reads, in a fixed order


def _cut(vjp, g) -> _Cut:
    closed, shape = jax.make_jaxpr(vjp, return_shape=True)(g)
    grads_tree, input_tree = jax.tree.structure(shape[0]), jax.tree.structure(shape[1])
    jaxpr, n_grads = closed.jaxpr, grads_tree.num_leaves
    outs = len(jaxpr.outvars)
    for_input, _ = dce_jaxpr(jaxpr, [i >= n_grads for i in range(outs)], instantiate=True)
    for_weight, _ = dce_jaxpr(jaxpr, [i < n_grads for i in range(outs)], instantiate=True)
    made = {v for e in for_input.eqns for v in e.outvars}
    rest = [e for e in for_weight.eqns if not all(v in made for v in _vars(e.outvars))]
    own = {v for e in rest for v in e.outvars}
    handed = []
    for v in [v for e in rest for v in _vars(e.invars)] + _vars(for_weight.outvars):
        if v in made and v not in own and v not in handed:
            handed.append(v)
    return _Cut(closed, grads_tree, input_tree, for_input.eqns, rest, handed)


def _vars(atoms) -> list:
    return [v for v in atoms if isinstance(v, Var)]  # not literals


def _run(cut: _Cut, invars, eqns, outvars, args) -> list:
    """The backward's `eqns` as a function of `invars` (and its constants: the layer's
    residuals), applied to `args`."""
    named = DebugInfo("split_backward", "a layer's backward, cut", tuple(f"in{i}" for i in range(len(invars))),
                      tuple(f"out{i}" for i in range(len(outvars))))
    jaxpr = cut.backward.jaxpr.replace(invars=list(invars), eqns=list(eqns), outvars=list(outvars),
                                       debug_info=named)
    return jaxpr_as_fun(ClosedJaxpr(jaxpr, cut.backward.consts))(*args)


def input_half(vjp, g):
    """(the layer's input gradient, what `weight_half` needs: g and the values handed over)."""
    cut = _cut(vjp, g)
    jaxpr, n_grads = cut.backward.jaxpr, cut.grads_tree.num_leaves
    out = _run(cut, jaxpr.invars, cut.input_eqns, jaxpr.outvars[n_grads:] + cut.handed, jax.tree.leaves(g))
    n_in = cut.input_tree.num_leaves
    return jax.tree.unflatten(cut.input_tree, out[:n_in]), (g, list(out[n_in:]))


def weight_half(vjp, kept):
    """The layer's parameter gradients from what `input_half` kept."""
    g, handed = kept
    cut = _cut(vjp, g)
    jaxpr, n_grads = cut.backward.jaxpr, cut.grads_tree.num_leaves
    out = _run(cut, list(jaxpr.invars) + cut.handed, cut.weight_eqns, jaxpr.outvars[:n_grads],
               [*jax.tree.leaves(g), *handed])
    return jax.tree.unflatten(cut.grads_tree, out)
