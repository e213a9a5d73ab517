"""What the `pipeline` and `gems` tests share: the seeds' models and their references.

The MLP, the CNN and the ResNet, small enough to compile in seconds; `single` as the
reference, except for the ResNet, whose batch norm a pipeline runs per micro-batch: its
reference is `micro_reference`, single's math with each of the M micro-batches normalised by
its own statistics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import equivalence as eq
from jaxpar import step as steplib
from jaxpar.optim import make_optimizer
from jaxpar.train import build_model

CONV = dict(width=None, depth=None)
# depth 3: the MLP has 4 layers, enough for 4 stages; batch 16 in 4 micro-batches of 4
SEED_MODELS = {"mlp": dict(width=32, depth=3), "cnn": CONV, "resnet": CONV}
COMMON = dict(batch_size=16, lr=0.02)
# The CNN cut after every layer: conv1 hands on [14, 14, 32], conv2 [7, 7, 64], fc1 [128].
CNN_BOUNDARIES = [14 * 14 * 32, 7 * 7 * 64, 128]


def config(model: str, **options):
    return eq.config(model=model, **SEED_MODELS[model], **COMMON, **options)


@functools.lru_cache(maxsize=None)
def reference(model: str, microbatches: int) -> eq.Trace:
    """`single` on `config(model)`; the ResNet's per-micro-batch reference."""
    if model == "resnet":
        return micro_reference(config(model), microbatches)
    return eq.run(config(model))


def micro_reference(cfg, microbatches: int, steps: int = 5) -> eq.Trace:
    """`single`'s step with batch norm per micro-batch: the gradient is the sum over M
    contiguous micro-batches of each one's loss gradient (the global weight total as every
    denominator), each normalised by its own statistics; the running statistics move by
    the mean of the micro-batches' updates (each from the same old statistics)."""
    graphdef, params, model_state = steplib.split_model(build_model(cfg))
    tx = make_optimizer(cfg.optim, total_steps=steps)
    state = steplib.init_state(params, model_state, tx)

    @jax.jit
    def grads(state, batch):
        micro = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
        denom = batch["weight"].sum()
        g, (z, sums) = jax.vmap(lambda b: steplib.grad_fn(state.params, graphdef, state.model_state,
                                                           b, denom))(micro)
        mean = lambda t: jax.tree.map(lambda x: jnp.mean(x, 0), t)  # noqa: E731
        total = lambda t: jax.tree.map(lambda x: jnp.sum(x, 0), t)  # noqa: E731
        return total(g), mean(z), total(sums)

    batches = eq.batches(cfg.data.batch_size, steps)
    first = jax.device_get(grads(state, batches[0])[0])
    losses = []
    for batch in batches:
        g, z, sums = grads(state, batch)
        state = steplib.apply_update(state, g, tx, z)
        losses.append(float(sums["loss_sum"] / sums["count"]))
    return eq.Trace(first, jax.device_get(state.params), losses, None, jax.device_get(state))


def assert_equivalent(ref: eq.Trace, got: eq.Trace) -> None:
    """The protocol, and the batch-norm statistics (none without batch norm) alike."""
    eq.assert_equivalent(ref, got)
    stats = got.strategy.state_to_reference(got.state).model_state
    eq.assert_tree_close(jax.device_get(ref.state.model_state), stats, what="batch-norm statistics")
