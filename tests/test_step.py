"""The shared loss (`jaxpar/step.py`): weight-0 padding changes nothing; shards own their share.

The denominator is what a shard passes to own its share of the global mean."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import data, step
from jaxpar.models import make_model


def _setup():
    graphdef, params, model_state = step.split_model(make_model("mlp", seed=0, width=32, depth=1))
    images, labels = data.synthetic(12, seed=0)
    batch = {"image": images, "label": labels, "weight": np.ones(12, np.float32)}
    return graphdef, params, model_state, batch


def test_zero_weight_padding_equals_unpadded_batch():
    graphdef, params, model_state, batch = _setup()
    padded = data.pad_batch(batch, 16)
    g1, _ = step.grad_fn(params, graphdef, model_state, batch)
    g2, (_, s2) = step.grad_fn(params, graphdef, model_state, padded)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(s2["count"]) == 12


def test_shard_gradients_with_global_denominator_sum_to_global_gradient():
    graphdef, params, model_state, batch = _setup()
    full, _ = step.grad_fn(params, graphdef, model_state, batch)
    shards = [{k: v[i::3] for k, v in batch.items()} for i in range(3)]
    parts = [step.grad_fn(params, graphdef, model_state, s, jnp.float32(12))[0] for s in shards]
    summed = jax.tree.map(lambda *g: sum(g), *parts)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(summed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_train_step_lowers_the_loss():
    import optax

    graphdef, params, model_state, batch = _setup()
    tx = optax.sgd(0.1)
    state = step.init_state(params, model_state, tx)
    losses = []
    for _ in range(5):
        state, sums = step.train_step(graphdef, tx, state, batch)
        losses.append(float(sums["loss_sum"] / sums["count"]))
    assert losses[-1] < losses[0] and int(state.step) == 5
