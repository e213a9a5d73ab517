"""Batch-size study (Shallue et al. 2018, "Measuring the Effects of Data Parallelism on Neural
Network Training"): steps to reach a target validation error versus batch size.

For each batch size B (powers of two), a grid of learning rates x momenta (heavy-ball momentum
SGD, constant learning rate, as in the paper's SGD-with-momentum runs) is trained *at once*:
the hyperparameters are traced values (`optax.inject_hyperparams`), so every trial has the same
shapes and one vmapped program trains them all on the same batches. Validation error is
measured on a fixed geometric schedule (`--evals-per-octave` points per doubling of the step
count); steps-to-target is the first evaluation at which the best trial reaches the target.
Everything is seeded, so a re-run gives the same steps exactly.

    python -m experiments batch-size --quick --out /tmp/bs          # seconds, synthetic data
    python -m experiments batch-size --out figures/data/batch_size  # ~1 h on 2 cores

The default full run uses an MLP (784-256-10), not the paper's simple CNN: on 2 CPU cores the
CNN would take many hours over this batch-size range. An MLP cannot reach the CNN's 0.10
validation error on Fashion-MNIST within a short budget, so the default target is 0.12 (both
flags can be changed).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from jaxpar import results

SYNTHETIC_NOISE = 400.0
DEFAULT_LRS = ",".join(f"{2.0 ** -k:g}" for k in range(9, -1, -1))  # 2^-9 .. 1


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/batch-size", help="output folder (default: results/batch-size)")
    p.add_argument("--quick", action="store_true",
                   help="synthetic data, tiny MLP, batch sizes 16..256, 4 trials (seconds)")
    p.add_argument("--full-range", action="store_true",
                   help="batch sizes 2^3..2^14 instead of 2^4..2^12 (several hours on 2 cores)")
    p.add_argument("--dataset", default="fashion_mnist", choices=("fashion_mnist", "mnist", "synthetic"),
                   help="dataset (default: fashion_mnist)")
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"), help="model (default: mlp)")
    p.add_argument("--width", type=int, default=256, help="MLP hidden width (default: 256)")
    p.add_argument("--depth", type=int, default=1, help="MLP hidden layers (default: 1)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated powers of two (default: 16,32,...,4096)")
    p.add_argument("--lrs", default=DEFAULT_LRS, help=f"learning-rate grid (default: {DEFAULT_LRS})")
    p.add_argument("--momenta", default="0.9,0.99", help="momentum grid (default: 0.9,0.99)")
    p.add_argument("--target-error", type=float, default=0.12, help="validation error to reach (default: 0.12)")
    p.add_argument("--max-epochs", type=float, default=40,
                   help="step budget per batch size, in epochs of the training split (default: 40)")
    p.add_argument("--evals-per-octave", type=int, default=6,
                   help="validations per doubling of the step count (default: 6)")
    p.add_argument("--val-size", type=int, default=10000,
                   help="validation examples carved (seeded) from train (default: 10000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, split and data order (default: 0)")


def eval_schedule(max_steps: int, per_octave: int) -> list[int]:
    """Steps at which validation runs: ceil(2^(k/per_octave)) for k = 0, 1, ..., up to max_steps.

    Geometric, so a log-log plot has even resolution (a 2^(1/per_octave) ratio between points),
    and fixed in advance, so steps-to-target cannot depend on when we happened to look."""
    steps, k = [], 0
    while True:
        s = math.ceil(2 ** (k / per_octave) - 1e-9)
        if s > max_steps:
            break
        if not steps or s > steps[-1]:
            steps.append(s)
        k += 1
    if steps[-1] != max_steps:
        steps.append(max_steps)
    return steps


def _chunks(n: int, largest: int = 64) -> list[int]:
    """Split n steps into power-of-two scan lengths (<= largest): few distinct programs."""
    out = []
    while n:
        piece = min(largest, 1 << (n.bit_length() - 1))
        out.append(piece)
        n -= piece
    return out


class _Order:
    """Step -> example indices: a fresh seeded permutation each epoch, last partial batch dropped
    (the order jaxpar.data.train_batches uses)."""

    def __init__(self, n: int, batch: int, seed: int):
        self.n, self.batch, self.seed = n, batch, seed
        self.per_epoch = n // batch
        self._perm: dict[int, np.ndarray] = {}

    def indices(self, first: int, count: int) -> np.ndarray:
        rows = []
        for step in range(first, first + count):
            epoch, pos = divmod(step, self.per_epoch)
            if epoch not in self._perm:
                self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
            rows.append(self._perm[epoch][pos * self.batch:(pos + 1) * self.batch])
        return np.stack(rows).astype(np.int32)


def _programs(graphdef, tx):
    """(train_chunk, val_error): jitted, vmapped over the trial axis of the state."""
    import jax
    import jax.numpy as jnp

    from jaxpar.step import eval_step, train_step

    def train_chunk(states, images, labels, idx):  # idx [L, B]: one row of indices per step
        def body(st, rows):
            batch = {"image": images[rows], "label": labels[rows],
                     "weight": jnp.ones(rows.shape, jnp.float32)}
            st, _ = jax.vmap(lambda s: train_step(graphdef, tx, s, batch))(st)
            return st, None
        return jax.lax.scan(body, states, idx)[0]

    def val_error(states, images, labels):
        batch = {"image": images, "label": labels, "weight": jnp.ones(labels.shape, jnp.float32)}
        sums = jax.vmap(lambda s: eval_step(graphdef, s, batch))(states)
        err = 1.0 - sums["correct"] / sums["count"]
        # A diverged trial (NaN logits) counts as wrong everywhere, not as a NaN minimum.
        return jnp.where(jnp.isfinite(sums["loss_sum"]), err, 1.0)

    return jax.jit(train_chunk, donate_argnums=0), jax.jit(val_error)


def run_batch_size(splits, batch: int, trials: list[tuple[float, float]], args,
                   max_steps: int) -> dict:
    """Train every (lr, momentum) trial at batch size `batch` until the best trial's validation
    error reaches the target or `max_steps` pass; returns the row for this batch size."""
    import jax
    import optax

    from jaxpar.models import make_model
    from jaxpar.step import init_state, split_model

    kw = {"width": args.width, "depth": args.depth} if args.model == "mlp" else {}
    graphdef, params, rest = split_model(make_model(args.model, seed=args.seed, **kw))
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0, momentum=0.0)
    one = init_state(params, rest, tx)
    states = jax.tree.map(lambda x: np.stack([np.asarray(x)] * len(trials)), one)
    hp = states.opt_state.hyperparams
    hp["learning_rate"] = np.array([lr for lr, _ in trials], np.float32)
    hp["momentum"] = np.array([m for _, m in trials], np.float32)
    states = jax.device_put(states)
    train_chunk, val_error = _programs(graphdef, tx)
    images, labels = jax.device_put(splits.train[0]), jax.device_put(splits.train[1])
    val_images, val_labels = jax.device_put(splits.val[0]), jax.device_put(splits.val[1])
    order = _Order(len(splits.train[1]), batch, args.seed)

    start, done, curve, reached = time.perf_counter(), 0, [], None
    for point in eval_schedule(max_steps, args.evals_per_octave):
        for length in _chunks(point - done):
            states = train_chunk(states, images, labels, order.indices(done, length))
            done += length
        errors = np.asarray(val_error(states, val_images, val_labels))
        curve.append({"step": point, "best_error": float(errors.min()), "errors": errors.tolist()})
        if errors.min() <= args.target_error:
            reached = point
            break
    best = int(np.argmin(curve[-1]["errors"]))
    row = {"batch_size": batch, "reached": reached is not None, "steps": reached,
           "examples": reached * batch if reached else None, "budget_steps": max_steps,
           "best_lr": trials[best][0], "best_momentum": trials[best][1],
           "best_error": curve[-1]["best_error"], "wall_s": time.perf_counter() - start,
           "curve": curve}
    status = f"{reached} steps" if reached else f"not reached in {max_steps} steps"
    print(f"batch {batch:6d}: {status}; best lr {row['best_lr']:g} momentum {row['best_momentum']:g} "
          f"error {row['best_error']:.4f} ({row['wall_s']:.1f} s)", flush=True)
    return row


def _parse(args) -> tuple[list[int], list[tuple[float, float]]]:
    if args.quick:
        args.dataset, args.width, args.max_epochs, args.val_size = "synthetic", 32, 3, 2000
        args.target_error, args.evals_per_octave = min(args.target_error, 0.12), 4
        args.lrs, args.momenta = "0.003,0.01,0.03,0.1", "0.9"
    if args.batch_sizes:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    elif args.quick:
        sizes = [16, 32, 64, 128, 256]
    else:
        lo, hi = (3, 14) if args.full_range else (4, 12)
        sizes = [2 ** k for k in range(lo, hi + 1)]
    bad = [b for b in sizes if b < 1 or b & (b - 1)]
    if bad:
        raise ValueError(f"--batch-sizes must be powers of two, got {bad}")
    if not 0 < args.target_error < 1:
        raise ValueError(f"--target-error must be in (0, 1), got {args.target_error}")
    if args.evals_per_octave < 1 or args.max_epochs <= 0:
        raise ValueError("--evals-per-octave must be >= 1 and --max-epochs > 0")
    lrs = [float(x) for x in args.lrs.split(",")]
    moms = [float(x) for x in args.momenta.split(",")]
    return sizes, [(lr, m) for m in moms for lr in lrs]


def run(args: argparse.Namespace) -> list[Path]:
    """Every batch size, smallest first; writes OUT/result.json (RunResult, kind 'batch-size')."""
    from jaxpar.config import DataConfig
    from jaxpar.data import Splits, load, synthetic

    sizes, trials = _parse(args)
    out = results.ensure_writable(args.out)  # fail before the work, not after it
    data_cfg = DataConfig(dataset=args.dataset, val_size=args.val_size, batch_size=max(sizes),
                          synthetic_size=12000)
    if args.dataset == "synthetic":  # noisier than the default synthetic set: a real curve
        images, labels = synthetic(12000, seed=1, noise=SYNTHETIC_NOISE)
        v = args.val_size
        splits = Splits(train=(images[v:], labels[v:]), val=(images[:v], labels[:v]), test=None)
    else:
        splits = load(data_cfg, seed=args.seed)
    n = len(splits.train[1])
    print(f"{len(trials)} trials per batch size (lr x momentum), {n} training / "
          f"{len(splits.val[1])} validation examples, target error {args.target_error}")
    rows = [run_batch_size(splits, b, trials, args, max(1, math.ceil(args.max_epochs * n / b)))
            for b in sizes]
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(batch_sizes=sizes, trials=trials, train_examples=n)
    result = results.RunResult(kind="batch-size", config=config, env=results.environment(),
                               metrics={"target_error": args.target_error, "rows": rows})
    path = results.save(result, out)
    print(f"wrote {path}")
    return [path]
