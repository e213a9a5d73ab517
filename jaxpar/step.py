"""The pieces every strategy shares: the loss, the optimizer update, the metrics.

Nothing here knows about devices. A strategy decides where these run and how gradients are
combined (a collective, a pipeline schedule, a parameter server), never what they compute,
so every strategy trains the same model the same way.

A batch is a dict of host or device arrays:
    image  uint8   [B, H, W, C]     normalised on device (uint8 crosses the bus: 4x fewer bytes)
    label  int32   [B]
    weight float32 [B]             1 for real examples, 0 for padding (uneven shards, last
                                   eval batch); the loss is sum(w * l) / sum(w)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

Params = Any  # nested dict of arrays (nnx.to_pure_dict layout)
SUMS = ("loss_sum", "correct", "count")  # the metric sums (`metric_sums`) every step returns


@struct.dataclass
class TrainState:
    """Everything that changes during training, as plain pytrees (easy to shard and save)."""

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    model_state: Params  # non-parameter variables (batch-norm statistics); {} for most models


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, Params, Params]:
    """(graphdef, params, model_state) with the states as plain nested dicts."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def init_state(params: Params, model_state: Params, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(params), model_state=model_state)


def normalize(images: jax.Array) -> jax.Array:
    """uint8 pixels -> float32 in [0, 1]; done on device so the host sends a quarter of the bytes."""
    return images.astype(jnp.float32) / 255.0


def forward(graphdef: nnx.GraphDef, params: Params, model_state: Params, images: jax.Array,
            train: bool) -> tuple[jax.Array, Params]:
    """Logits and the model state after the call (batch-norm statistics move in train mode)."""
    model = nnx.merge(graphdef, params, model_state)
    logits = model(normalize(images), train=train)
    new_state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))) if train else model_state
    return logits, new_state


def metric_sums(logits: jax.Array, losses: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """Weighted sums (not means), so shards and batches combine by plain addition."""
    w = batch["weight"]
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return {"loss_sum": jnp.sum(w * losses), "correct": jnp.sum(w * correct), "count": jnp.sum(w)}


def summarize(sums: dict) -> dict[str, float]:
    """{'loss', 'accuracy'} from `metric_sums` totals."""
    count = float(sums["count"])
    return {"loss": float(sums["loss_sum"]) / count, "accuracy": float(sums["correct"]) / count}


def loss_fn(params: Params, graphdef: nnx.GraphDef, model_state: Params, batch: dict,
            denom: jax.Array | None = None, train: bool = True):
    """Weighted mean cross-entropy, the one loss of the package.

    Args:
      denom: the weight total to divide by. None = this batch's own `sum(weight)`. A
        data-parallel shard passes the *global* total so that its loss is its share of the
        global mean, and the sum of shard gradients is the global gradient.

    Returns:
      (loss, (model_state, metric_sums))
    """
    logits, new_state = forward(graphdef, params, model_state, batch["image"], train)
    loss, sums = loss_from_logits(logits, batch, denom)
    return loss, (new_state, sums)


def loss_from_logits(logits: jax.Array, batch: dict, denom: jax.Array | None = None):
    """The loss tail of `loss_fn`, for strategies that run the model in pieces (a pipeline's
    last stage). Returns (sum(w * l) / denom, metric_sums)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    sums = metric_sums(logits, losses, batch)
    if denom is None:
        denom = sums["count"]
    return sums["loss_sum"] / denom, sums


grad_fn = jax.grad(loss_fn, has_aux=True)
"""grad_fn(params, graphdef, model_state, batch, denom=None) -> (grads, (model_state, sums))"""


def apply_update(state: TrainState, grads: Params, tx: optax.GradientTransformation,
                 model_state: Params | None = None) -> TrainState:
    """The one optimizer update: optax transform, apply, count the step."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        model_state=state.model_state if model_state is None else model_state)


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, state: TrainState,
               batch: dict) -> tuple[TrainState, dict]:
    """One step on one device (the reference every strategy is tested against)."""
    grads, (model_state, sums) = grad_fn(state.params, graphdef, state.model_state, batch)
    return apply_update(state, grads, tx, model_state), sums


def eval_step(graphdef: nnx.GraphDef, state: TrainState, batch: dict) -> dict:
    """Metric sums of one evaluation batch (batch norm uses its running statistics)."""
    logits, _ = forward(graphdef, state.params, state.model_state, batch["image"], train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return metric_sums(logits, losses, batch)
