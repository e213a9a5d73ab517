"""Trials side by side: the vmapped variant of jaxpar's training step, for the hparam and
batch-size studies.

K trials of the same shapes (learning rate and momentum as traced values in the optimizer
state, `optax.inject_hyperparams`; a seed only draws initial parameters) stack into one
`TrainState` with a leading trial axis, and `jax.vmap` of `jaxpar.step.train_step` steps them
all on the same batch. The batches are `jaxpar.data.train_batches`' in the order
`jaxpar.train`'s loop takes them (epoch by epoch, each a permutation seeded by (seed, epoch),
the last partial batch dropped), so a trial here trains exactly as `train` would with the same
optimizer, batch size and seed.

    graphdef, state = trial_state(make_model("mlp", seed=0), TX, lr=0.1, momentum=0.9)
    states = stack([...])                              # [K, ...] leaves
    step = jax.jit(vmap_trials(train_step(graphdef, TX)))
    for batch in loop_batches(splits.train, 128, seed=0, count=300): states, sums = step(states, batch)
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar import data as datalib
from jaxpar import step as steplib

# Heavy-ball momentum SGD at a constant learning rate, both hyperparameters per trial.
TX = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0, momentum=0.0)


def trial_state(model, tx: optax.GradientTransformation, lr: float, momentum: float):
    """(graphdef, TrainState) of one trial, its lr and momentum in its optimizer state."""
    graphdef, params, rest = steplib.split_model(model)
    state = steplib.init_state(params, rest, tx)
    state.opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    state.opt_state.hyperparams["momentum"] = jnp.asarray(momentum, jnp.float32)
    return graphdef, state


def stack(states: list) -> steplib.TrainState:
    """One state with a leading trial axis on every leaf (host arrays)."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)


def train_step(graphdef, tx: optax.GradientTransformation) -> Callable:
    """jaxpar's one-device step, `(state, batch) -> (state, metric sums)`."""
    return lambda state, batch: steplib.train_step(graphdef, tx, state, batch)


def eval_step(graphdef) -> Callable:
    return lambda state, batch: steplib.eval_step(graphdef, state, batch)


def vmap_trials(fn: Callable) -> Callable:
    """`fn(state, batch)` over a stacked state, every trial on the same batch."""
    return jax.vmap(fn, in_axes=(0, None))


def loop_batches(split: datalib.Arrays, batch_size: int, seed: int, first: int = 0,
                 count: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Batches `first`, `first + 1`, ... (`count` of them, or without end) of the loop's
    order: `jaxpar.data.train_batches` epoch after epoch, as `jaxpar.train` takes them."""
    per_epoch = datalib.steps_per_epoch(len(split[1]), batch_size)

    def endless():
        epoch, start = divmod(first, per_epoch)
        while True:
            yield from datalib.train_batches(split, batch_size, seed, epoch, start)
            epoch, start = epoch + 1, 0

    return itertools.islice(endless(), count)


def loop_indices(n: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """The example indices of each batch in the loop's order (`loop_batches` over an index
    array), for studies that keep the data on the device and gather each batch there."""
    index = np.arange(n, dtype=np.int32)
    for batch in loop_batches((index, index), batch_size, seed):
        yield batch["image"]


def scan_steps(step: Callable) -> Callable:
    """`(states, images, labels, idx [L, B]) -> states`: L vmapped steps in one program, each
    batch gathered on the device from the whole split by one row of indices."""

    def steps(states, images, labels, idx):
        def body(st, rows):
            batch = {"image": images[rows], "label": labels[rows],
                     "weight": jnp.ones(rows.shape, jnp.float32)}
            return vmap_trials(step)(st, batch)[0], None

        return jax.lax.scan(body, states, idx)[0]

    return steps
