"""The CPU-fast layers (jaxpar/models/layers.py) against lax's: outputs and gradients of each
convolution shape the models use (and odd sizes, strides, paddings beyond them), pooling with
ties, whole models under either implementation, and one data-parallel run of the CNN.

    pytest -q tests/models/test_layers.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import equivalence as eq
from jaxpar import step as steplib
from jaxpar.config import ConfigError
from jaxpar.models import MODELS, batchnorm, layers, make_model, onednn

DN = ("NHWC", "HWIO", "NHWC")
PADDINGS = ["SAME", "VALID", ((1, 0), (2, 1))]


def normal(*shape, seed=0):
    # numpy, not jax.random: each threefry shape compiles for seconds on a busy CPU.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def grads_and_output(conv, x, w, strides, padding):
    """Output of `conv` and the gradients of a generic scalar of it w.r.t. (x, w)."""
    def loss(x, w):
        y = conv(x, w, strides, padding, dimension_numbers=DN)
        return jnp.sum(jnp.sin(y)), y  # sin: a cotangent that differs at every output
    (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    return y, grads


@pytest.mark.parametrize("padding", PADDINGS, ids=["same", "valid", "explicit"])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("kernel,cin,cout", [
    (3, 1, 8),   # a stem: one input channel (the elementwise form)
    (1, 4, 6),   # a projection shortcut (slice + matmul)
])
@pytest.mark.parametrize("size", [(8, 8), (9, 7)], ids=["even", "odd"])
def test_conv_equals_lax(size, kernel, cin, cout, stride, padding):
    x, w = normal(3, *size, cin, seed=0), normal(kernel, kernel, cin, cout, seed=1)
    ref_y, ref_grads = grads_and_output(lax.conv_general_dilated, x, w, (stride, stride), padding)
    y, grads = grads_and_output(layers.cpu_conv, x, w, (stride, stride), padding)
    assert y.shape == ref_y.shape
    eq.assert_tree_close(ref_y, y, what="outputs")
    eq.assert_tree_close(ref_grads, grads, what="gradients (x, w)")


@pytest.mark.parametrize("kwargs", [
    {},  # 3x3 with several input channels: lax runs it fastest (layers.py)
    dict(feature_group_count=2, rhs_dilation=(2, 2)),  # what the fast forms do not cover
], ids=["3x3", "grouped-dilated"])
def test_other_convs_are_lax_s(kwargs):
    x, w = normal(2, 9, 7, 4, seed=1), normal(3, 3, 4 // kwargs.get("feature_group_count", 1), 4)
    for strides in ((1, 1), (2, 2)):
        np.testing.assert_array_equal(
            layers.cpu_conv(x, w, strides, "SAME", dimension_numbers=DN, **kwargs),
            lax.conv_general_dilated(x, w, strides, "SAME", dimension_numbers=DN, **kwargs))


@pytest.mark.parametrize("size", [(8, 8), (9, 7), (28, 28)])
def test_max_pool_equals_lax_ties_included(size):
    x = normal(2, *size, 5, seed=3)
    # Ties: a constant block (blank background), and zeros from a ReLU.
    x = x.at[:, :4, :4].set(0.5)
    x = jax.nn.relu(x)
    g = normal(2, size[0] // 2, size[1] // 2, 5, seed=4)

    @jax.jit
    def output_and_gradient(x, g):
        return [(y, vjp(g)[0]) for y, vjp in (jax.vjp(pool, x) for pool in
                                              (layers.xla_max_pool, layers.cpu_max_pool))]

    (ref_y, ref_dx), (y, dx) = output_and_gradient(x, g)
    np.testing.assert_array_equal(y, ref_y)
    np.testing.assert_array_equal(dx, ref_dx)  # exactly: the same element of a tie wins


def test_auto_is_onednn_or_cpu_on_cpu_and_xla_elsewhere(monkeypatch):
    assert jax.default_backend() == "cpu"
    assert layers.resolve_conv_impl("auto") == ("cpu" if onednn.unavailable() else "onednn")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert layers.resolve_conv_impl("auto") == "xla"
    assert layers.resolve_conv_impl("cpu") == "cpu"


def test_unknown_conv_impl_names_the_choices():
    with pytest.raises(ConfigError, match="auto, xla, cpu"):
        make_model("cnn", seed=0, conv_impl="im2col")


@functools.lru_cache(maxsize=None)  # the "xla" reference, once for every form compared with it
def model_grads(name, conv_impl, batch_norm=None):
    """(params, model_state) and (train-mode grads and new model_state, eval logits) of a batch."""
    # 'rbg' keys: several times cheaper to compile than threefry (see test_models.py).
    rngs = nnx.Rngs(jax.random.key(0, impl="rbg"))
    kwargs = {} if batch_norm is None else {"batch_norm": batch_norm}
    model = MODELS[name](conv_impl=conv_impl, **kwargs, rngs=rngs)
    graphdef, params, model_state = steplib.split_model(model)
    (batch,) = eq.batches(8, 1)

    @jax.jit
    def grads_and_logits(params, model_state, batch):
        grads, (new_state, _) = steplib.grad_fn(params, graphdef, model_state, batch)
        logits, _ = steplib.forward(graphdef, params, model_state, batch["image"], train=False)
        return grads, new_state, logits

    return (params, model_state), grads_and_logits(params, model_state, batch)


FAST_IMPLS = ["cpu"] + ([] if onednn.unavailable() else ["onednn"])


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("name,kwargs", [
    ("cnn", {}), ("cnn", dict(batch_norm=True)), ("resnet", {})], ids=["cnn", "cnn-bn", "resnet"])
def test_models_equal_across_impls(name, kwargs, impl):
    (ref_init, ref_out) = model_grads(name, "xla", **kwargs)
    (init, out) = model_grads(name, impl, **kwargs)
    # The same parameter and statistics tree with the same values: a checkpoint written under
    # one implementation loads under the other.
    assert jax.tree.structure(init) == jax.tree.structure(ref_init)
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(ref_init)):
        np.testing.assert_array_equal(a, b)
    grads, new_state, logits = out
    ref_grads, ref_new_state, ref_logits = ref_out
    eq.assert_tree_close(ref_grads, grads, what="gradients")
    eq.assert_tree_close(ref_new_state, new_state, what="batch statistics")
    eq.assert_tree_close(ref_logits, logits, what="eval logits")


def test_cnn_data_parallel_equals_single():
    # The "cpu" forms' custom gradients (the stem's, the pool's) run inside shard_map
    # (varying-axis checks on) like any other op; oneDNN's: the ResNet's test below.
    cfg = dict(model="cnn", width=None, depth=None, batch_size=16, conv_impl="cpu")
    ref = eq.run(eq.config(**cfg), steps=2)
    got = eq.run(eq.config(strategy="dp-shard-map", **cfg), steps=2, devices=4)
    eq.assert_equivalent(ref, got)


def batch_norm_pair(features=6, momentum=0.9, **kwargs):
    """Flax's BatchNorm and the fast one with the same (non-trivial) variables."""
    flax_bn = nnx.BatchNorm(features, momentum=momentum, rngs=nnx.Rngs(0), **kwargs)
    fast_bn = batchnorm.FastBatchNorm(features, momentum=momentum, rngs=nnx.Rngs(0), **kwargs)
    for bn in (flax_bn, fast_bn):
        bn.scale[...] = normal(features, seed=5)
        if bn.bias is not None:
            bn.bias[...] = normal(features, seed=6)
        bn.mean[...], bn.var[...] = normal(features, seed=7), 1 + normal(features, seed=8) ** 2
    return flax_bn, fast_bn


def bn_outputs(bn, x):
    """Train-mode output, its gradients w.r.t. (x, scale, bias), the updated running
    statistics, and the eval-mode output, of a generic scalar of the output."""
    graphdef, params, stats = steplib.split_model(bn)

    @jax.jit
    def run(params, stats, x):
        def loss(x, params):
            model = nnx.merge(graphdef, params, stats)
            y = model(x, use_running_average=False)
            new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
            return jnp.sum(jnp.sin(y) * jnp.cos(x)), (y, new_stats)
        (_, (y, new_stats)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, params)
        evaluated = nnx.merge(graphdef, params, stats)(x, use_running_average=True)
        return y, grads, new_stats, evaluated

    return run(params, stats, x)


@pytest.mark.parametrize("shape", [(4, 5, 3, 6), (7, 6)], ids=["nhwc", "dense"])
def test_fast_batch_norm_equals_flax(shape):
    # Off-centre inputs: the one-pass statistics' cancellation shows if it matters.
    x = 3.0 + 2.0 * normal(*shape, seed=9)
    flax_bn, fast_bn = batch_norm_pair(shape[-1])
    ref, got = bn_outputs(flax_bn, x), bn_outputs(fast_bn, x)
    for what, a, b in zip(("train outputs", "gradients (x, params)", "running statistics",
                           "eval outputs"), ref, got):
        eq.assert_tree_close(a, b, what=what)
    # The same variables, so a checkpoint of one loads into the other.
    assert jax.tree.structure(nnx.state(flax_bn)) == jax.tree.structure(nnx.state(fast_bn))


@pytest.mark.parametrize("kwargs,call", [
    ({}, dict(mask=jnp.broadcast_to(jnp.arange(4)[:, None, None] < 3, (4, 3, 6)))),
    (dict(use_bias=False), {}),
], ids=["mask", "no-bias"])
def test_fast_batch_norm_leaves_what_it_does_not_cover_to_flax(kwargs, call):
    x = normal(4, 3, 6, seed=10)
    flax_bn, fast_bn = batch_norm_pair(6, **kwargs)
    np.testing.assert_array_equal(fast_bn(x, use_running_average=False, **call),
                                  flax_bn(x, use_running_average=False, **call))


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_conv_impl_picks_the_batch_norm(impl):
    assert type(make_model("resnet", seed=0, conv_impl=impl).stem_bn) is batchnorm.FastBatchNorm
    assert type(make_model("resnet", seed=0, conv_impl="xla").stem_bn) is nnx.BatchNorm
    cnn = make_model("cnn", seed=0, batch_norm=True, conv_impl=impl)
    assert type(cnn.bn1) is batchnorm.FastBatchNorm


def test_resnet_fast_forms_inside_shard_map_equal_lax_s():
    # Batch norm's custom gradient takes replicated scale and bias and returns their gradient
    # from per-shard (varying) data; under shard_map that must still sum like lax's.
    # The form "auto" picks here (onednn where it builds) against lax's.
    runs = [eq.run(eq.config(model="resnet", width=None, depth=None, batch_size=16,
                             strategy="dp-shard-map", conv_impl=impl), steps=2, devices=4)
            for impl in ("xla", FAST_IMPLS[-1])]
    eq.assert_equivalent(*runs)
