"""Hyperparameter search as parallel vmapped trials vs one trial after another.

Learning rate, momentum and seed are traced values (optax.inject_hyperparams), so every trial
has the same shapes and the whole grid is one vmapped program, its trial axis sharded over
devices with a NamedSharding. Width/depth change shapes: each is its own group.

    python -m experiments hparam --quick --out /tmp/hparam
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/hparam", help="output folder (default: results/hparam)")
    p.add_argument("--quick", action="store_true", help="4 trials, width 32, 10 steps")
    p.add_argument("--lrs", default="0.01,0.03,0.1,0.3", help="learning rates (default: 0.01,0.03,0.1,0.3)")
    p.add_argument("--momenta", default="0.0,0.9", help="momenta (default: 0.0,0.9)")
    p.add_argument("--seeds", default="0,1", help="seeds (default: 0,1)")
    p.add_argument("--widths", default="64,128", help="MLP widths, one group each (default: 64,128)")
    p.add_argument("--steps", type=int, default=100, help="steps per trial (default: 100)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")


def _trial_state(seed, lr, momentum, width):
    import optax

    from jaxpar.models import make_model
    from jaxpar.step import init_state, split_model

    graphdef, params, rest = split_model(make_model("mlp", seed=seed, width=width))
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=float(lr), momentum=float(momentum))
    return graphdef, tx, init_state(params, rest, tx)


def _batches(steps, batch_size, seed=0):
    from jaxpar.data import synthetic

    images, labels = synthetic(steps * batch_size, seed)
    return [{"image": images[i * batch_size:(i + 1) * batch_size],
             "label": labels[i * batch_size:(i + 1) * batch_size],
             "weight": np.ones(batch_size, np.float32)} for i in range(steps)]


def search(trials: list[tuple], width: int, batches: list[dict], vmapped: bool) -> tuple[np.ndarray, float]:
    """Train every (seed, lr, momentum) trial; return (losses [trial, step], wall seconds).

    vmapped=True: one program over the stacked trials (trial axis sharded over devices when
    their count divides the trials); False: each trial on its own, one after another.
    """
    import jax

    from jaxpar.mesh import DATA, make_mesh
    from jaxpar.step import train_step

    built = [_trial_state(s, lr, m, width) for s, lr, m in trials]
    graphdef, tx = built[0][0], built[0][1]
    step = jax.jit(lambda st, b: train_step(graphdef, tx, st, b))
    start = time.perf_counter()
    if vmapped:
        state = jax.tree.map(lambda *xs: np.stack(xs), *[b[2] for b in built])
        n = len(jax.devices())
        if len(trials) % n == 0 and n > 1:
            from jax.sharding import NamedSharding, PartitionSpec

            mesh = make_mesh({DATA: n})
            state = jax.device_put(state, NamedSharding(mesh, PartitionSpec(DATA)))
        vstep = jax.jit(jax.vmap(lambda st, b: train_step(graphdef, tx, st, b), in_axes=(0, None)))
        losses = []
        for b in batches:
            state, sums = vstep(state, b)
            losses.append(np.asarray(sums["loss_sum"]) / np.asarray(sums["count"]))
        out = np.stack(losses, 1)
    else:
        rows = []
        for _, _, state in built:
            row = []
            for b in batches:
                state, sums = step(state, b)
                row.append(float(sums["loss_sum"]) / float(sums["count"]))
            rows.append(row)
        out = np.array(rows)
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> list[Path]:
    """Both ways per width group; write OUT/hparam.json; return its path."""
    from jaxpar import results

    lrs = [float(x) for x in args.lrs.split(",")]
    moms = [float(x) for x in args.momenta.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    steps = args.steps
    if args.quick:
        lrs, moms, seeds, widths, steps = [0.03, 0.1], [0.0, 0.9], [0], [32], 10
    trials = list(itertools.product(seeds, lrs, moms))
    batches = _batches(steps, args.batch_size)
    groups = []
    for width in widths:
        par, t_par = search(trials, width, batches, vmapped=True)
        seq, t_seq = search(trials, width, batches, vmapped=False)
        best = int(np.argmin(par[:, -1]))
        groups.append({"width": width, "trials": trials, "vmapped_s": t_par, "sequential_s": t_seq,
                       "speedup": t_seq / t_par, "max_loss_diff": float(np.abs(par - seq).max()),
                       "best": {"seed": trials[best][0], "lr": trials[best][1],
                                "momentum": trials[best][2], "final_loss": float(par[best, -1])},
                       "losses_vmapped": par.tolist(), "losses_sequential": seq.tolist()})
        print(f"width {width}: {len(trials)} trials, vmapped {t_par:.2f} s, one by one {t_seq:.2f} s, "
              f"speed-up {t_seq / t_par:.2f}x, best {groups[-1]['best']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hparam.json"
    path.write_text(json.dumps({"env": results.environment(), "steps": steps,
                                "batch_size": args.batch_size, "groups": groups}, indent=1))
    return [path]
