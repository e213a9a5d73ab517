"""`tensor` (the Megatron split written out in shard_map) equals `single`; bytes equal theory.

By the equivalence protocol; its all-reduce bytes equal Megatron's theory exactly; parameter
bytes per device shrink about 1/T; indivisible widths and unsplittable models are clear
errors. The CNN and the ResNet split their conv pairs by channels; the ResNet's batch norm
sees the whole batch on every device (its channels split, not its rows), so its statistics
equal `single`'s too."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import equivalence as eq
import tensor_cases as tc
from conftest import requires_devices
from jaxpar.errors import ConfigError

CASES = [("stack-mlp", "tensor=4"), ("stack-mlp", "data=2,tensor=2"),
         ("vit", "tensor=2"), ("vit", "tensor=4")]


@requires_devices(4)
@pytest.mark.parametrize("model,mesh", CASES)
def test_tensor_matches_single(model, mesh):
    got = tc.run_and_compare("tensor", model, mesh)
    measured, theory = tc.step_collective_bytes(got)
    assert measured == theory  # explicit collectives: theory exactly
    tc.assert_blocks_split(got)


@requires_devices(4)
@pytest.mark.parametrize("model,mesh", [("cnn", "tensor=2"), ("cnn", "tensor=4"),
                                        ("cnn", "data=2,tensor=2"), ("resnet", "tensor=2"),
                                        ("resnet", "tensor=4")])
def test_channel_split_convs_match_single(model, mesh):
    got = tc.run_and_compare("tensor", model, mesh)
    measured, theory = tc.step_collective_bytes(got)
    assert measured == theory  # explicit collectives: theory exactly
    tc.assert_split_as_specified(got)


@requires_devices(4)
@pytest.mark.parametrize("model,mesh", [("cnn", "tensor=4"), ("resnet", "tensor=2")])
def test_channel_split_equals_single_exactly_in_float64(model, mesh):
    """In float64 no ReLU or max-pool input ties with its threshold within rounding, so the
    split's step-1 gradients equal `single`'s to 1e-10 on a batch (batch 16) where float32
    rounding decides such a tie differently (the ResNet's gradients then differ far beyond
    the protocol's 1e-5)."""
    from jaxpar import step as steplib
    from jaxpar.optim import make_optimizer
    from jaxpar.train import build_model, make_strategy

    cfg = eq.config(model=model, width=None, depth=None, batch_size=16, strategy="tensor", mesh=mesh)
    batch = eq.batches(16, 5)[0]
    with jax.enable_x64(True):
        graphdef, state = nnx.split(build_model(cfg))
        wide = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float64), state))
        _, params, stats = steplib.split_model(wide)
        want = jax.jit(steplib.grad_fn, static_argnums=1)(params, graphdef, stats, batch)[0]
        s = make_strategy(cfg)
        placed = s.init(wide, make_optimizer(cfg.optim, 1), s.make_mesh(jax.devices()[:tc.devices_of(mesh)]))
        got = s.gradients(placed, s.place_batch(batch))
        eq.assert_tree_close(jax.device_get(want), jax.device_get(got), tol=1e-10, what="float64 gradients")


@requires_devices(4)
@pytest.mark.parametrize("mesh", ["tensor=2", "tensor=4"])
def test_cnn_with_batch_norm_matches_single(mesh):
    """bn1 runs on each device's B/T rows normalised by the whole batch's statistics, bn2 on
    its channels of the gathered batch: gradients, parameters and running statistics equal
    `single`'s."""
    options = dict(tc.CONV, model="cnn", batch_norm=True)
    ref = eq.run(eq.config(**options))
    got = eq.run(eq.config(strategy="tensor", mesh=mesh, **options), devices=tc.devices_of(mesh))
    eq.assert_tree_close(ref.grads, got.grads, what="step-1 gradients")
    eq.assert_tree_close(ref.params, got.params, what="parameters")
    stats = [t.strategy.state_to_reference(t.state).model_state for t in (ref, got)]
    eq.assert_tree_close(*stats, what="batch-norm statistics")


@requires_devices(4)
def test_width_not_divisible_is_a_config_error():
    cfg = eq.config(model="stack-mlp", strategy="tensor", mesh="tensor=3", width=32, depth=2)
    with pytest.raises(ConfigError, match="--width"):
        eq.run(cfg, steps=1, devices=3)


def test_unsplittable_model_is_a_config_error():
    cfg = eq.config(model="mlp", strategy="tensor", mesh="tensor=1")
    with pytest.raises(ConfigError, match="--model"):
        eq.run(cfg, steps=1, devices=1)


@requires_devices(4)
@pytest.mark.parametrize("model,mesh,batch_norm", [("cnn", "tensor=2", False), ("cnn", "tensor=4", False),
                                                   ("cnn", "data=2,tensor=2", False), ("cnn", "tensor=2", True)])
def test_cnn_split_by_permutes_matches_single(monkeypatch, model, mesh, batch_norm):
    """The CNN split's gathers, scatters and loss denominator in their permute form (what a
    CPU mesh across processes runs, `comm_forms.choose`), forced here in one process: equal
    to `single` by the protocol, and its gathers really are permutes (no all-gather left;
    the one all-reduce is the replicated parameters' gradients with the metric sums)."""
    from jaxpar.parallel.tensor import comm_forms

    monkeypatch.setattr(comm_forms, "choose", lambda mesh: comm_forms.PERMUTE)
    options = dict(tc.CONV, model=model, batch_norm=batch_norm)
    ref = eq.run(eq.config(**options))
    got = eq.run(eq.config(strategy="tensor", mesh=mesh, **options), devices=tc.devices_of(mesh))
    assert got.strategy.describe()["collective_form"] == "permute"
    eq.assert_tree_close(ref.grads, got.grads, what="step-1 gradients")
    eq.assert_tree_close(ref.params, got.params, what="parameters")
    s = got.strategy
    ops = s.compile("step", got.state, s.place_batch(eq.batches(s.config.data.batch_size, 1)[0])).collective_bytes
    assert "all-gather" not in ops and ops["collective-permute"] > 0, ops
    if not batch_norm:  # (bn1's whole-batch statistics add all-reduces the theory leaves out)
        assert ops["total"] == s.theory()["total"], (ops, s.theory())
