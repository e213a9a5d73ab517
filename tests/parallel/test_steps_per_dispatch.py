"""--steps-per-dispatch K: K steps in one program equal K steps one by one (the equivalence
protocol against `single`), the loop cuts dispatches at validations, checkpoints and epoch
ends, and chained collective steps do not deadlock the CPU rendezvous."""

import jax
import numpy as np
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar.config import ConfigError, with_options
from jaxpar.optim import make_optimizer
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.base import STEPS_OPTION
from jaxpar.train import build_model, fit, make_strategy
from jaxpar.validate import validate

K = 3
DISPATCHES = 2


def run_chained(cfg, devices=None):
    """`eq.run`'s steps as DISPATCHES calls of K steps each (`Strategy.steps`)."""
    global_batches = eq.batches(cfg.data.batch_size, K * DISPATCHES)
    strategy = make_strategy(cfg)
    mesh = strategy.make_mesh(jax.devices()[:devices] if devices else jax.devices())
    state = strategy.init(build_model(cfg), make_optimizer(cfg.optim, K * DISPATCHES), mesh)
    losses = []
    for d in range(DISPATCHES):
        group = [strategy.place_batch(b) for b in global_batches[d * K:(d + 1) * K]]
        state, sums = strategy.steps(state, group)
        assert len(sums) == K
        losses += [s["loss_sum"] / s["count"] for s in map(strategy.host_sums, sums)]
    assert strategy.trace_counts["steps"] == 1
    return strategy.to_reference(state), losses


CASES = [("single", {}, 1), ("dp-shard-map", {}, 4), ("dp-auto", {}, 4), ("fsdp", {}, 4),
         ("tensor", {"model": "stack-mlp"}, 2), ("tensor-auto", {"model": "stack-mlp"}, 2)]


@requires_devices(4)
@pytest.mark.parametrize("strategy,options,devices", CASES, ids=[c[0] for c in CASES])
def test_chained_steps_equal_the_single_device_run(strategy, options, devices):
    ref = eq.run(eq.config(**options), steps=K * DISPATCHES)
    params, losses = run_chained(eq.config(strategy=strategy, steps_per_dispatch=K, **options),
                                 devices)
    eq.assert_tree_close(ref.params, params)
    np.testing.assert_allclose(losses, ref.losses, rtol=eq.TOL * 10)


@requires_devices(2)
def test_chained_local_sgd_averages_on_the_same_steps():
    # local-sgd is not `single` (replicas drift between averages): chained equals unchained.
    options = dict(strategy="local-sgd", sync_every=2)
    ref = eq.run(eq.config(**options), steps=K * DISPATCHES, devices=2)
    params, losses = run_chained(eq.config(steps_per_dispatch=K, **options), devices=2)
    eq.assert_tree_close(ref.params, params)
    np.testing.assert_allclose(losses, ref.losses, rtol=eq.TOL * 10)


def test_every_strategy_that_lists_the_option_has_a_chained_program():
    takes = {name for name, cls in STRATEGIES.items() if STEPS_OPTION in cls.options}
    assert takes == {c[0] for c in CASES} | {"local-sgd"}


def test_a_strategy_without_it_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--steps-per-dispatch 4 applies to --strategy single"):
        validate(eq.config(strategy="dp-pmap", steps_per_dispatch=4))


def tiny(**kw):
    base = dict(dataset="synthetic", synthetic_size=1200, val_size=200, batch_size=50,
                model="mlp", width=32, depth=1, progress=False, optimizer="adam")
    return with_options(eq.config(), **{**base, **kw})


def test_the_loop_gives_the_same_run_and_cuts_dispatches_at_validations(tmp_path):
    # 20 steps an epoch, 2 epochs, validation every 7 steps: K=4 dispatches are cut at steps
    # 7, 14, 21, 28, 35 and at the epoch's end (20), checkpoints every 10 steps likewise.
    common = dict(epochs=2, eval_every=7, checkpoint_every=10)
    one = fit(tiny(**common, checkpoint_dir=str(tmp_path / "one")))
    four = fit(tiny(**common, steps_per_dispatch=4, checkpoint_dir=str(tmp_path / "four")))
    assert four.result.metrics["steps"] == one.result.metrics["steps"] == 40
    assert [h["step"] for h in four.result.history] == [h["step"] for h in one.result.history]
    for a, b in zip(one.result.history, four.result.history):
        assert a["val_accuracy"] == pytest.approx(b["val_accuracy"], abs=1e-6)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    eq.assert_tree_close(one.strategy.to_reference(one.state),
                         four.strategy.to_reference(four.state), eq.ADAM_TOL)
    saved = sorted(int(p.name) for p in (tmp_path / "four").iterdir() if p.name.isdigit())
    assert saved == sorted(int(p.name) for p in (tmp_path / "one").iterdir() if p.name.isdigit())
    assert four.strategy.trace_counts["steps"] == 1 and four.strategy.trace_counts["step"] == 1
    assert four.result.metrics["steps_compile_s"] > 0


@requires_devices(4)
def test_hundreds_of_chained_collective_steps_do_not_deadlock():
    cfg = tiny(strategy="dp-shard-map", width=16, batch_size=32, steps=300, synthetic_size=2000,
               val_size=100, epochs=1, steps_per_dispatch=4, devices=None)
    out = fit(cfg)
    assert out.result.metrics["steps"] == 300 and np.isfinite(out.result.metrics["final_loss"])
