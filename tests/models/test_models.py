"""Model zoo: pinned sizes, output shapes, the registry's option checks, the stage layout
that tensor/pipeline parallelism relies on, seeding, and batch-norm train/eval modes.

On CPU, building a model is dominated by XLA compiling one threefry initialiser per
distinct parameter shape (up to ~1 s each), so sizes and shapes at the defaults are checked
abstractly (`nnx.eval_shape`, nothing compiled), numerics run on small configs whose
parameters come from 'rbg' keys (several times cheaper to compile; these tests are about
the architecture, not the key stream) through one jitted forward, and only the seeding
test goes through make_model's own threefry keys.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import MODELS, make_model, param_count

# Exact trainable-parameter counts at each model's defaults (like flax's CNN_PARAMS): a
# change here is a change of architecture, so it must be deliberate.
PARAMS = {
    "mlp": 669_706,          # 784-512-512-10
    "cnn": 421_642,          # conv32-conv64-fc128-fc10
    "resnet": 77_754,        # ResNet-8, 1 input channel
    "stack-mlp": 2_305_802,  # stem 784->256, 4 blocks 256->1024->256, head
    "vit": 204_938,          # d=64, 4 blocks of 4 heads, 16 tokens
}

# Small real configs for the numerical tests (cnn and resnet have no size options).
SMALL = {
    "mlp": dict(depth=1, width=16),
    "cnn": {},
    "resnet": {},
    "stack-mlp": dict(depth=3, width=16),
    "vit": dict(depth=3, width=16),
}

B = 3
X = jax.random.normal(jax.random.key(0), (B, 28, 28, 1), jnp.float32)


@functools.cache
def _built(name, items):
    return MODELS[name](**dict(items), rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))


def small(name, **override):
    """A fresh copy (callers may mutate it) of a cached small model."""
    return nnx.clone(_built(name, tuple(sorted({**SMALL[name], **override}.items()))))


# nnx.jit writes BatchStat updates made inside back into the module it was given.
forward = nnx.jit(lambda model, x, train: model(x, train=train), static_argnames="train")


def abstract(name, **kwargs):
    return nnx.eval_shape(lambda: make_model(name, seed=0, **kwargs))


def params_of(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_registry_names():
    assert set(MODELS) == set(PARAMS)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_default_param_count_and_output_shape(name):
    model = abstract(name)
    assert param_count(model) == PARAMS[name]
    for train in (False, True):
        out = nnx.eval_shape(lambda m, x: m(x, train=train), model, X)
        assert out.shape == (B, 10) and out.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_output_finite(name):
    # Eval mode here; train mode (which differs only with batch norm) in the BN test.
    logits = forward(small(name), X, train=False)
    assert logits.shape == (B, 10)
    assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("name,kwargs,count", [
    ("mlp", dict(depth=1, width=30, activation="sigmoid"), 23_860),  # Nielsen's 784-30-10
    ("cnn", dict(batch_norm=True), 421_738),  # conv biases dropped, BN scale+bias added
    ("resnet", dict(depth=3), 272_186),  # ResNet-20
    ("stack-mlp", dict(depth=2, width=32),
     784 * 32 + 32 + 2 * (32 * 128 + 128 + 128 * 32 + 32) + 32 * 10 + 10),
    ("vit", dict(depth=1, width=32),
     49 * 32 + 32 + 16 * 32 + 4 * (32 * 32 + 32) + (32 * 128 + 128 + 128 * 32 + 32)
     + 3 * 2 * 32 + 32 * 10 + 10),
])
def test_options_are_forwarded(name, kwargs, count):
    assert param_count(abstract(name, **kwargs)) == count


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh"])
def test_mlp_activations(activation):
    logits = forward(small("mlp", activation=activation), X, train=False)
    assert logits.shape == (B, 10) and bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("name", ["mlp", "stack-mlp"])
def test_unknown_activation_lists_choices(name):
    with pytest.raises(ValueError, match="relu, sigmoid, tanh"):
        make_model(name, seed=0, activation="swish")


@pytest.mark.parametrize("name,option,value,users", [
    ("cnn", "width", 8, "mlp, stack-mlp, vit"),
    ("vit", "activation", "tanh", "mlp, stack-mlp"),
    ("mlp", "batch_norm", False, "cnn"),  # an explicit False is still "given"
    ("cnn", "depth", 2, "mlp, resnet, stack-mlp, vit"),
    ("vit", "conv_impl", "xla", "cnn, resnet"),
])
def test_unused_explicit_option_rejected(name, option, value, users):
    with pytest.raises(ValueError, match=f"{option}.*{users}"):
        make_model(name, seed=0, **{option: value})


def test_unknown_model_lists_choices():
    with pytest.raises(ValueError, match="mlp, cnn, resnet, stack-mlp, vit"):
        make_model("lenet", seed=0)


@pytest.mark.parametrize("name", ["stack-mlp", "vit"])
def test_stage_layout(name):
    model = small(name)
    width = SMALL[name]["width"]

    @nnx.jit
    def by_hand_and_whole(model, x):
        h = model.embed(x)
        for block in model.blocks:
            h = block(h)
        return model.readout(h), model(x)

    np.testing.assert_allclose(*by_hand_and_whole(model, X), rtol=1e-6, atol=1e-6)

    # Identical blocks: one graphdef, the same shapes (what the Megatron split assumes).
    splits = [nnx.split(block) for block in model.blocks]
    graphdef0, state0 = splits[0]
    shapes0 = jax.tree.map(jnp.shape, state0)
    for graphdef, state in splits[1:]:
        assert graphdef == graphdef0
        assert jax.tree.map(jnp.shape, state) == shapes0
    # The parameter names a tensor-parallel strategy looks for.
    block = model.blocks[0]
    assert block.up.kernel.shape == (width, 4 * width)
    assert block.down.kernel.shape == (4 * width, width)
    if name == "vit":
        for proj in ("query", "key", "value", "out"):
            assert getattr(block, proj).kernel.shape == (width, width)


@pytest.mark.parametrize("name,kwargs", [(n, {}) for n in sorted(SMALL)] + [("cnn", dict(batch_norm=True))])
def test_layers_compose_to_the_model_and_own_every_parameter(name, kwargs):
    """What layer-split, pipeline and gems cut into stages: `model.layers()` applied in turn
    is the model (batch-norm statistics included), and their keys own every parameter and
    statistic exactly once."""
    whole, pieces = small(name, **kwargs), small(name, **kwargs)

    @nnx.jit
    def by_layers(model, x):
        for layer in model.layers():
            x = layer(x, True)
        return x

    np.testing.assert_allclose(by_layers(pieces, X), forward(whole, X, train=True), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(pieces))):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    keys = [k for layer in whole.layers() for k in layer.keys]
    paths = [tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(whole)))[0]]
    owners = [[k for k in keys if path[:len(k)] == k] for path in paths]
    assert all(len(o) == 1 for o in owners), [(p, o) for p, o in zip(paths, owners) if len(o) != 1]


def test_seeding():
    # Seeding is make_model's (nnx.Rngs(seed)), the same for every model: one suffices.
    a, b, c = (params_of(make_model("mlp", seed=s, **SMALL["mlp"])) for s in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(not np.array_equal(x, z) for x, z in zip(a, c))


@pytest.mark.parametrize("name,kwargs", [("cnn", dict(batch_norm=True)), ("resnet", {})])
def test_batch_norm_train_updates_stats_eval_does_not(name, kwargs):
    model = small(name, **kwargs)
    stats = lambda: jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    before = [np.asarray(s) for s in stats()]
    assert before, "model has no BatchStat state"
    forward(model, X, train=False)
    assert all(np.array_equal(b, a) for b, a in zip(before, stats()))
    logits = forward(model, X, train=True)
    assert logits.shape == (B, 10) and bool(jnp.isfinite(logits).all())
    assert all(not np.array_equal(b, a) for b, a in zip(before, stats()))


def test_cnn_without_batch_norm_has_no_batch_stats():
    assert not jax.tree.leaves(nnx.state(abstract("cnn"), nnx.BatchStat))
