"""The equivalence protocol (docs/design.md) and the helpers every strategy's tests share.

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
import functools
from typing import Any

import jax
import numpy as np

from jaxpar import data as datalib
from jaxpar.config import TrainConfig, with_options
from jaxpar.optim import make_optimizer
from jaxpar.train import build_model, make_strategy

TOL = 1e-5  # per-leaf norm-relative, f32
ADAM_TOL = 1e-4  # Adam divides by sqrt(v): rounding in tiny gradients is amplified
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
        sums = strategy.host_sums(sums)  # waits: one collective step in flight (CPU rendezvous)
        losses.append(sums["loss_sum"] / sums["count"])
    return Trace(grads, strategy.to_reference(state), losses, strategy, state)


@functools.lru_cache(maxsize=None)
def reference(optimizer: str = "sgd", batch_size: int = 64, steps: int = 5, lr: float = 0.1) -> Trace:
    """`single` on `config(...)`'s MLP: what the data-parallel strategies are compared with."""
    return run(config(optimizer=optimizer, batch_size=batch_size, lr=lr), steps=steps)


def accounting(strategy: str, devices: int = 8, batch_size: int = 64, **options) -> dict:
    """`strategy.accounting` of `strategy`'s compiled step on `config(...)`'s MLP."""
    t = run(config(strategy=strategy, batch_size=batch_size, **options), steps=1, devices=devices)
    batch = t.strategy.place_batch(batches(batch_size, 1)[0])
    return t.strategy.accounting(t.strategy.compile("step", t.state, batch), t.state)


def assert_explicit_collectives_equal_theory(acc: dict) -> None:
    """Bytes written with explicit collectives equal the strategy's theory, op by op."""
    theory = acc["collective_bytes_theory"]
    assert acc["collective_bytes_per_step"] == theory["total"]
    for op, nbytes in acc["collective_bytes_by_op"].items():
        assert nbytes == theory.get(op), (op, acc["collective_bytes_by_op"], theory)


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
