"""A layer's backward cut into its input and weight halves (`split_backward`): together they
give what the whole vjp gives, and the weight half repeats none of the input half's work: for
a residual block, exactly its two weight matmuls (the two VJPs each asked for one half ran a
third, the hidden activation's cotangent, twice)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.parallel.pipeline import split_backward
from jaxpar.parallel.pipeline.split_backward import _cut


def _block(p, h):
    return h + jax.nn.relu(h @ p["up"] + p["b"]) @ p["down"]


def _setup():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"up": jax.random.normal(k[0], (16, 64)) * 0.1, "b": jnp.zeros(64),
         "down": jax.random.normal(k[1], (64, 16)) * 0.1}
    h, g = jax.random.normal(k[2], (8, 16)), jax.random.normal(k[3], (8, 16))
    return p, h, g


def _dots(eqns) -> int:
    return sum(e.primitive.name == "dot_general" for e in eqns)


@pytest.mark.parametrize("jit", [False, True])
def test_the_halves_give_the_whole_vjp(jit):
    p, h, g = _setup()

    def halves(p, h, g):
        _, vjp = jax.vjp(_block, p, h)
        dx, kept = split_backward.input_half(vjp, g)
        return dx, split_backward.weight_half(vjp, kept), vjp(g)

    dx, grads, (want_grads, want_dx) = (jax.jit(halves) if jit else halves)(p, h, g)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), grads, want_grads)


def test_the_weight_half_runs_only_the_weight_matmuls():
    p, h, g = _setup()
    _, vjp = jax.vjp(_block, p, h)
    cut = _cut(vjp, g)
    assert _dots(cut.weight_eqns) == 2  # h^T g_hidden and a^T g: the block's two weights
    assert _dots(cut.input_eqns) == 2   # g W_down^T and g_hidden W_up^T
    assert not set(map(id, cut.weight_eqns)) & set(map(id, cut.input_eqns))
    assert cut.handed  # the hidden activation's cotangent, computed once, by the input half


def test_a_flax_layer_with_batch_norm_splits_alike():
    """A module's parameters as a tree (conv, batch norm with its running statistics: the
    pipeline's own, by micro-batch, are tests/parallel/pipeline/test_every_schedule.py's CNN):
    the weight half's tree and values are vjp's."""
    model = nnx.Sequential(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)),
                           nnx.BatchNorm(4, use_running_average=True, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 3))

    def layer(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    out, vjp = jax.vjp(layer, params, x)
    g = jnp.ones_like(out)
    dx, kept = split_backward.input_half(vjp, g)
    grads = split_backward.weight_half(vjp, kept)
    want_grads, want_dx = vjp(g)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grads, want_grads)
