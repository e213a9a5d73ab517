"""The equivalence protocol of DESIGN.md, shared by every strategy's tests.

A strategy and `single` start from the same seed and see the same global batches; they are
compared in the reference layout (`to_reference`):
  - gradients at step 1, directly (catches a gradient N times too large: Adam would hide it);
  - loss and parameters after a few SGD / momentum steps, per-leaf
    ||delta|| / ||reference|| <= 1e-5 in f32.

    ref = run("single", cfg)
    got = run("dp-shard-map", cfg, mesh="data=8")
    assert_close(ref, got)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxpar import data as datalib
from jaxpar.config import TrainConfig, with_options
from jaxpar.optim import make_optimizer
from jaxpar.train import build_model, make_strategy

TOL = 1e-5  # per-leaf norm-relative, f32
FLOOR = 1e-3  # leaves below this share of the tree's norm are compared against it


@dataclasses.dataclass
class Trace:
    grads: Any          # gradients at step 1, reference layout, on host
    params: Any         # parameters after `steps` steps, reference layout, on host
    losses: list[float]  # global mean loss of each step
    strategy: Any
    state: Any


def config(**options) -> TrainConfig:
    """A small, fast run: MLP on synthetic data, plain SGD, constant learning rate."""
    base = dict(dataset="synthetic", model="mlp", width=64, depth=2, optimizer="sgd",
                lr_schedule="constant", lr=0.1, batch_size=64, progress=False)
    return with_options(TrainConfig(), **{**base, **options})


def batches(batch_size: int, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`steps` distinct global batches of synthetic data."""
    images, labels = datalib.synthetic(batch_size * steps, seed=seed)
    return [{"image": images[i * batch_size:(i + 1) * batch_size],
             "label": labels[i * batch_size:(i + 1) * batch_size],
             "weight": np.ones(batch_size, np.float32)} for i in range(steps)]


def run(cfg: TrainConfig, steps: int = 5, devices: int | None = None,
        global_batches: list[dict] | None = None) -> Trace:
    """Run `cfg`'s strategy for `steps` steps on the first `devices` devices."""
    global_batches = global_batches or batches(cfg.data.batch_size, steps)
    strategy = make_strategy(cfg)
    all_devices = jax.devices()
    mesh = strategy.make_mesh(all_devices[:devices] if devices else all_devices)
    tx = make_optimizer(cfg.optim, total_steps=steps)
    state = strategy.init(build_model(cfg), tx, mesh)
    grads = jax.device_get(strategy.gradients(state, strategy.place_batch(global_batches[0])))
    losses = []
    for batch in global_batches[:steps]:
        state, sums = strategy.step(state, strategy.place_batch(batch))
        sums = jax.device_get(sums)  # one collective step in flight (CPU rendezvous hazard)
        losses.append(float(sums["loss_sum"]) / float(sums["count"]))
    return Trace(grads, strategy.to_reference(state), losses, strategy, state)


def relative_errors(ref, got) -> dict[str, tuple[float, float, float]]:
    """Per leaf: (||got - ref|| / ||ref||, max |got - ref|, ||ref||)."""
    ref_leaves = jax.tree_util.tree_leaves_with_path(ref)
    got_leaves = jax.tree.leaves(got)
    if len(ref_leaves) != len(got_leaves):
        raise AssertionError(f"tree structures differ: {jax.tree.structure(ref)} vs "
                             f"{jax.tree.structure(got)}")
    # A leaf whose reference is analytically ~0 (an attention key bias: softmax ignores it)
    # holds only rounding noise; its norm is floored at FLOOR x the whole tree's norm.
    total = float(np.sqrt(sum(np.sum(np.asarray(r, np.float64) ** 2) for _, r in ref_leaves)))
    out = {}
    for (path, r), g in zip(ref_leaves, got_leaves):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        if r.shape != g.shape:
            raise AssertionError(f"{jax.tree_util.keystr(path)}: shape {g.shape} != {r.shape}")
        norm = float(np.linalg.norm(r))
        diff = float(np.linalg.norm(g - r))
        scale = max(norm, FLOOR * total)
        out[jax.tree_util.keystr(path)] = (diff / scale if scale else diff, float(np.max(np.abs(g - r), initial=0)), norm)
    return out


def assert_tree_close(ref, got, tol: float = TOL, what: str = "params") -> None:
    errors = relative_errors(ref, got)
    bad = {k: v for k, v in errors.items() if not v[0] <= tol}
    if bad:
        lines = [f"  {k}: rel {v[0]:.3g}, max abs diff {v[1]:.3g}, ||ref|| {v[2]:.3g}"
                 for k, v in bad.items()]
        raise AssertionError(f"{what} differ from the reference (tol {tol}):\n" + "\n".join(lines))


def assert_equivalent(ref: Trace, got: Trace, tol: float = TOL) -> None:
    """Gradients at step 1, parameters and losses after the run, all within `tol`."""
    assert_tree_close(ref.grads, got.grads, tol, "step-1 gradients")
    assert_tree_close(ref.params, got.params, tol, "parameters")
    np.testing.assert_allclose(got.losses, ref.losses, rtol=tol * 10, err_msg="losses")
