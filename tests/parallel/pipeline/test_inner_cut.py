"""A stage boundary inside the CNN's conv2 (`jaxpar/parallel/pipeline/inner_cut.py`, `CNNCut`): the same
function, states that convert both ways exactly, and the cut taken only where it helps.

    python -m pytest -q tests/parallel/pipeline/test_inner_cut.py
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import equivalence as eq
from jaxpar import step as steplib
from jaxpar.models.cnn import CNN, CNNCut
from jaxpar.parallel.pipeline import inner_cut


@pytest.mark.parametrize("batch_norm", [False, True])
def test_the_cut_cnn_is_the_cnn(batch_norm):
    """conv2 as two convolutions over the same input, channels joined: the CNN's logits in
    training and inference mode, and its batch-norm statistics after a training call."""
    cnn = CNN(batch_norm=batch_norm, rngs=nnx.Rngs(0))
    cut = CNNCut(cnn, 24, (28, 28, 1))
    x = jax.random.normal(jax.random.key(1), (4, 28, 28, 1))
    for train in (False, True):
        np.testing.assert_allclose(cut(x, train), cnn(x, train), rtol=1e-5, atol=1e-5)
    names = [layer.name for layer in cut.layers()]
    assert names == ["conv1", "conv2[:24]", "conv2[24:64]", "fc1", "fc2"]
    if batch_norm:  # both ran one training call above; the statistics, joined, agree
        plan = inner_cut.Plan((0, 2), tuple(names), (1.0,) * 5, channels=24)
        joined = plan.from_view(nnx.to_pure_dict(nnx.state(cut, nnx.BatchStat)))
        want = nnx.to_pure_dict(nnx.state(cnn, nnx.BatchStat))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), joined, want)


def test_a_state_converts_both_ways_exactly():
    """Parameters, Adam's moments and the statistics of a batch-norm CNN: to the cut's layout
    and back, bit for bit; the cut layout matches the cut model's own tree."""
    cnn = CNN(batch_norm=True, rngs=nnx.Rngs(0))
    _, params, stats = steplib.split_model(cnn)
    state = steplib.init_state(params, stats, optax.adam(1e-3))
    state = state.replace(opt_state=jax.tree.map(lambda a: a + 0.5, state.opt_state))  # not all zero
    plan = inner_cut.Plan((0, 2), (), (), channels=40)
    view = plan.to_view(jax.device_get(state))
    _, cut_params, cut_stats = steplib.split_model(CNNCut(cnn, 40, (28, 28, 1)))
    assert jax.tree.structure(view.params) == jax.tree.structure(cut_params)
    jax.tree.map(np.testing.assert_array_equal, view.params, jax.device_get(cut_params))
    jax.tree.map(np.testing.assert_array_equal, view.model_state, jax.device_get(cut_stats))
    assert view.params["conv2a"]["kernel"].shape == (3, 3, 32, 40)
    back = plan.from_view(view)
    jax.tree.map(np.testing.assert_array_equal, back, jax.device_get(state))


def test_the_cnn_is_cut_inside_conv2_where_whole_layers_cannot_balance():
    cfg = eq.config(model="cnn", width=None, depth=None)
    two = inner_cut.plan(cfg, 2, inside=True)
    assert two.channels is not None and two.names[two.starts[1]].startswith("conv2[")
    whole = inner_cut.plan(cfg, 2, inside=False)
    assert whole.channels is None and whole.names == ("conv1", "conv2", "fc1", "fc2")
    assert max(two.stage_costs()) < 0.7 * max(whole.stage_costs())  # whole layers: conv2 ~85%
    assert two.speedup_bound(0.0) > 1.7 > whole.speedup_bound(0.0)
    # --stage-boundaries are the model's own layers; other models have no cut inside a layer
    assert inner_cut.plan(eq.config(model="cnn", width=None, depth=None, stage_boundaries=(2,)), 2, True).channels is None
    assert inner_cut.plan(eq.config(model="mlp", width=32, depth=3), 2, True).channels is None


@pytest.mark.parametrize("strategy", ["pipeline", "gems"])
def test_stage_programs_cut_inside_where_stages_have_workers_and_equal_single(strategy, monkeypatch):
    """`pipeline` and `gems` as stage programs keep whole layers on CPU (devices share the
    cores) and cut inside conv2 where stages have workers of their own (an accelerator;
    forced here): either way they equal `single`."""
    from jaxpar.parallel.pipeline.strategy import PipelineStrategy

    cfg = dict(model="cnn", width=None, depth=None, batch_size=16, lr=0.01)
    ref = eq.run(eq.config(strategy="single", **cfg), steps=2, devices=1)
    staged = eq.config(strategy=strategy, mesh="stage=2", microbatches=4, pipeline_impl="mpmd", **cfg)
    assert eq.run(staged, steps=1, devices=2).strategy.describe()["cut_inside"] is None  # CPU
    monkeypatch.setattr(PipelineStrategy, "cuts_inside_layers", lambda self: True)
    got = eq.run(staged, steps=2, devices=2)
    assert got.strategy.describe()["cut_inside"] is not None
    eq.assert_equivalent(ref, got)


def test_stage_programs_cut_inside_where_each_device_has_a_thread_of_its_own(monkeypatch):
    """--single-thread: each simulated device one XLA thread, as a rank has."""
    from jaxpar import mesh
    from jaxpar.train import make_strategy

    staged = make_strategy(eq.config(strategy="pipeline", microbatches=4, pipeline_impl="mpmd"))
    assert not staged.cuts_inside_layers()  # this suite: XLA's shared threads
    monkeypatch.setattr(mesh, "single_threaded", lambda: True)
    assert staged.cuts_inside_layers()


def test_layer_split_keeps_whole_layers():
    cfg = eq.config(strategy="layer-split", mesh="stage=2", model="cnn", width=None, depth=None, batch_size=16)
    assert eq.run(cfg, steps=1, devices=2).strategy.describe()["cut_inside"] is None
