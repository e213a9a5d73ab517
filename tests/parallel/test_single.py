"""`single`, the reference itself, agrees with a hand-written loop over the shared step.

And the equivalence check is strict enough to catch a gradient N times too large."""

import jax
import numpy as np
import pytest

import equivalence as eq
from jaxpar import step
from jaxpar.optim import make_optimizer
from jaxpar.train import build_model


def test_single_matches_a_hand_written_loop():
    cfg = eq.config()
    got = eq.run(cfg, steps=3)
    tx = make_optimizer(cfg.optim, 3)
    graphdef, params, model_state = step.split_model(build_model(cfg))
    state = step.init_state(params, model_state, tx)
    for batch in eq.batches(cfg.data.batch_size, 3):
        state, _ = step.train_step(graphdef, tx, state, batch)
    eq.assert_tree_close(jax.device_get(state.params), got.params)


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_protocol_catches_scaled_gradients(factor):
    ref = eq.run(eq.config(), steps=2)
    scaled = jax.tree.map(lambda g: g * factor, ref.grads)
    with pytest.raises(AssertionError, match="gradients"):
        eq.assert_tree_close(ref.grads, scaled, what="step-1 gradients")
    eq.assert_tree_close(ref.grads, jax.tree.map(np.copy, ref.grads))
