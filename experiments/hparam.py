"""Hyperparameter search as parallel vmapped trials vs one trial after another.

Learning rate, momentum and seed do not change shapes: learning rate and momentum are traced
values (`optax.inject_hyperparams`) and the seed only draws the initial parameters, so every
trial of a group has the same shapes and the whole grid is one vmapped program, its trial axis
sharded over devices (a NamedSharding on a DATA mesh; `--devices` simulates CPU devices).
Width and depth change shapes: each (width, depth) is its own group, searched on its own.

Both ways train every trial on the same batches for `--steps` steps (one jitted call a step),
then evaluate each trial's validation accuracy; the best configuration is the trial with the
highest validation accuracy, per group and overall, and the best (lr, momentum) by accuracy
averaged over the seeds. Wall times exclude compilation, which is timed on its own
(ahead-of-time `lower().compile()`). Batched and single matmuls round differently (about an
ulp a step), so over long or unstable runs the two ways' losses drift apart; each trial's
largest difference is recorded, and both ways' best configurations.

    python -m experiments hparam --out figures/data/hparam   # Fashion-MNIST, 4 groups of 16 trials
    python -m experiments hparam --quick --out /tmp/hparam   # synthetic data, seconds

Writes OUT/hparam.json (RunResult, kind 'hparam'), atomically.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import numpy as np

from jaxpar import results
from jaxpar.config import ConfigError

LOGGED_STEPS = 20  # loss curves kept in the JSON per trial (all steps are compared)
QUICK = {"dataset": "synthetic", "lrs": "0.03,0.1", "momenta": "0.0,0.9", "seeds": "0,1",
         "widths": "32", "depths": "1,2", "steps": 10, "batch_size": 32, "val_size": 1000}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/hparam", help="output folder (default: results/hparam)")
    p.add_argument("--quick", action="store_true",
                   help="synthetic data, 8 trials (2 lrs x 2 momenta x 2 seeds), width 32, depths 1 "
                        "and 2, 10 steps")
    p.add_argument("--dataset", default="fashion_mnist", choices=("fashion_mnist", "mnist", "synthetic"),
                   help="dataset (default: fashion_mnist)")
    p.add_argument("--devices", type=int, default=None,
                   help="simulate this many CPU devices for the trial axis; must divide the trials "
                        "per group (default: the devices present)")
    p.add_argument("--lrs", default="0.01,0.03,0.1,0.3", help="learning rates (default: %(default)s)")
    p.add_argument("--momenta", default="0.0,0.9", help="momenta (default: %(default)s)")
    p.add_argument("--seeds", default="0,1", help="parameter-init seeds (default: %(default)s)")
    p.add_argument("--widths", default="64,256", help="MLP hidden widths, one group each (default: %(default)s)")
    p.add_argument("--depths", default="1,2", help="MLP hidden layers, one group each (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="training steps per trial (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=128, help="batch size (default: %(default)s)")
    p.add_argument("--val-size", type=int, default=5000,
                   help="validation examples carved (seeded) from train (default: %(default)s)")


def _numbers(flag: str, text: str, kind: type) -> list:
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None
    if len(set(values)) != len(values):
        raise ConfigError(f"{flag} lists a value twice: {text!r}")
    return values


def plan(args: argparse.Namespace) -> tuple[list[tuple[int, float, float]], list[tuple[int, int]]]:
    """(trials [(seed, lr, momentum)], groups [(width, depth)]); checks options before any work."""
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    lrs = _numbers("--lrs", args.lrs, float)
    moms = _numbers("--momenta", args.momenta, float)
    seeds = _numbers("--seeds", args.seeds, int)
    widths = _numbers("--widths", args.widths, int)
    depths = _numbers("--depths", args.depths, int)
    if min(lrs) <= 0 or not all(0 <= m < 1 for m in moms):
        raise ConfigError("--lrs must be > 0 and --momenta in [0, 1)")
    if min(widths) < 1 or min(depths) < 1:
        raise ConfigError("--widths and --depths must be >= 1")
    if args.steps < 1 or args.batch_size < 1 or args.val_size < 1:
        raise ConfigError("--steps, --batch-size and --val-size must be >= 1")
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {args.devices}")
    trials = list(itertools.product(seeds, lrs, moms))
    if args.devices and len(trials) % args.devices:
        raise ConfigError(f"--devices {args.devices} must divide the {len(trials)} trials per group "
                          f"(lrs x momenta x seeds) so each device trains the same number")
    return trials, list(itertools.product(widths, depths))


def _states(trials, width: int, depth: int):
    """(graphdef, tx, [one TrainState per trial]); each trial's lr and momentum live in its
    optimizer state (inject_hyperparams), so one `tx` serves them all."""
    import jax.numpy as jnp
    import optax

    from jaxpar.models import make_model
    from jaxpar.step import init_state, split_model

    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0, momentum=0.0)
    states = []
    for seed, lr, momentum in trials:
        graphdef, params, rest = split_model(make_model("mlp", seed=seed, width=width, depth=depth))
        state = init_state(params, rest, tx)
        state.opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        state.opt_state.hyperparams["momentum"] = jnp.asarray(momentum, jnp.float32)
        states.append(state)
    return graphdef, tx, states


def _compile(fn, *args):
    """(compiled, seconds): compiled ahead of time so the timed loop never compiles."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start


def search(trials, width: int, depth: int, batches: list[dict], val: list[dict], mesh,
           vmapped: bool) -> dict:
    """Train every (seed, lr, momentum) trial, then evaluate it on the validation batches.

    Args:
      batches, val: host batches (the same for every trial).
      mesh: a DATA mesh whose devices hold the trial axis (vmapped); None: one device.
      vmapped: True = one program over the stacked trials; False = each trial on its own,
        one after another.
    Returns:
      {"losses" [trial, step], "val_accuracy", "val_loss" [trial], "train_s" (excluding
       compilation), "compile_s", "eval_s"}
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxpar.mesh import DATA
    from jaxpar.step import eval_step, train_step

    graphdef, tx, states = _states(trials, width, depth)
    train = jax.jit(lambda st, b: train_step(graphdef, tx, st, b), donate_argnums=0)
    evaluate = jax.jit(lambda st, b: eval_step(graphdef, st, b))
    if vmapped:
        train = jax.jit(jax.vmap(lambda st, b: train_step(graphdef, tx, st, b), in_axes=(0, None)),
                        donate_argnums=0)
        evaluate = jax.jit(jax.vmap(lambda st, b: eval_step(graphdef, st, b), in_axes=(0, None)))
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *states)
        states = [jax.device_put(stacked, NamedSharding(mesh, P(DATA)))]
        place = NamedSharding(mesh, P())  # every device sees the whole batch
    else:
        place = jax.devices()[0]
    batches = [jax.device_put(b, place) for b in batches]  # placed before the clock starts
    val = [jax.device_put(b, place) for b in val]
    train, compile_train = _compile(train, states[0], batches[0])
    evaluate, compile_eval = _compile(evaluate, states[0], val[0])

    start, sums, finals = time.perf_counter(), [], []
    for state in states:  # vmapped: one stacked state
        per_step = []
        for b in batches:
            state, s = train(state, b)
            per_step.append(s)
        jax.block_until_ready(state)
        sums.append(per_step)
        finals.append(state)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    totals = [jax.tree.map(lambda *xs: sum(xs), *[evaluate(st, b) for b in val]) for st in finals]
    totals = jax.device_get(totals)
    eval_s = time.perf_counter() - start

    losses = np.array([[np.asarray(s["loss_sum"]) / np.asarray(s["count"]) for s in per_step]
                       for per_step in jax.device_get(sums)], np.float64)  # [runs, steps, (trials)]
    val_correct = np.concatenate([np.atleast_1d(t["correct"]) for t in totals])
    val_count = np.concatenate([np.atleast_1d(t["count"]) for t in totals])
    val_loss = np.concatenate([np.atleast_1d(t["loss_sum"]) for t in totals]) / val_count
    losses = np.moveaxis(losses[0], 1, 0) if vmapped else losses
    return {"losses": losses, "val_accuracy": val_correct / val_count, "val_loss": val_loss,
            "train_s": train_s, "compile_s": compile_train + compile_eval, "eval_s": eval_s}


def _best(trials, val_accuracy, val_loss) -> dict:
    """Highest validation accuracy; ties go to the lower validation loss. A diverged trial
    (non-finite loss) never wins."""
    acc = np.where(np.isfinite(val_loss), val_accuracy, -1.0)
    i = min(range(len(trials)), key=lambda k: (-acc[k], val_loss[k] if np.isfinite(val_loss[k]) else np.inf))
    seed, lr, momentum = trials[i]
    return {"trial": i, "seed": seed, "lr": lr, "momentum": momentum,
            "val_accuracy": float(val_accuracy[i]), "val_loss": float(val_loss[i])}


def _best_over_seeds(trials, val_accuracy) -> dict:
    """The (lr, momentum) with the highest validation accuracy averaged over the seeds: a
    ranking less at the mercy of one initialisation (or of rounding) than the single best trial."""
    by = {}
    for (_, lr, momentum), acc in zip(trials, val_accuracy):
        by.setdefault((lr, momentum), []).append(float(acc) if np.isfinite(acc) else 0.0)
    (lr, momentum), accs = max(by.items(), key=lambda kv: np.mean(kv[1]))
    return {"lr": lr, "momentum": momentum, "mean_val_accuracy": float(np.mean(accs)), "seeds": len(accs)}


def _data(args):
    """(host training batches, host validation batches): the same for every trial."""
    from jaxpar import data as datalib
    from jaxpar.config import DataConfig

    cfg = DataConfig(dataset=args.dataset, val_size=args.val_size, batch_size=args.batch_size)
    splits = datalib.load(cfg, seed=0)
    per_epoch = datalib.steps_per_epoch(len(splits.train[1]), args.batch_size)
    batches = []
    for epoch in range(-(-args.steps // per_epoch)):
        batches += list(datalib.train_batches(splits.train, args.batch_size, seed=0, epoch=epoch))
    val = list(datalib.eval_batches(splits.val, min(cfg.eval_batch_size, args.val_size)))
    return batches[:args.steps], val, len(splits.train[1])


def run(args: argparse.Namespace) -> list[Path]:
    """Both ways per (width, depth) group; write OUT/hparam.json; return its path."""
    trials, shapes = plan(args)
    out = results.ensure_writable(args.out)  # fail before the work, not after it
    from jaxpar.mesh import DATA, make_mesh, simulate_cpu_devices

    simulate_cpu_devices(args.devices)  # before JAX's backend starts
    import jax

    n_dev = len(jax.devices())
    if len(trials) % n_dev:
        raise ConfigError(f"the {len(trials)} trials per group do not divide over the {n_dev} devices "
                          f"present; pass --devices with a divisor of {len(trials)}")
    mesh = make_mesh({DATA: n_dev})
    batches, val, n_train = _data(args)
    print(f"{len(trials)} trials (seed x lr x momentum) per group, {len(shapes)} (width, depth) groups, "
          f"{args.steps} steps of batch {args.batch_size} on {args.dataset} ({n_train} train / "
          f"{args.val_size} validation); vmapped trial axis over {n_dev} device(s)", flush=True)
    logged = sorted({1} | {max(1, round(k * args.steps / LOGGED_STEPS)) for k in range(1, LOGGED_STEPS + 1)})
    groups = []
    for width, depth in shapes:
        par = search(trials, width, depth, batches, val, mesh, vmapped=True)
        seq = search(trials, width, depth, batches, val, None, vmapped=False)
        diff = np.abs(par["losses"] - seq["losses"])
        g = {"width": width, "depth": depth, "trials": len(trials),
             "vmapped_s": par["train_s"], "sequential_s": seq["train_s"],
             "speedup": seq["train_s"] / par["train_s"],
             "vmapped_compile_s": par["compile_s"], "sequential_compile_s": seq["compile_s"],
             "vmapped_eval_s": par["eval_s"], "sequential_eval_s": seq["eval_s"],
             # Same math, but batched and single matmuls round differently (an ulp a step);
             # long or unstable runs can grow that: kept per trial, not hidden in one number.
             "max_loss_diff": float(np.nanmax(diff)) if np.isfinite(diff).any() else 0.0,
             "loss_diff_per_trial": np.nanmax(diff, axis=1).tolist(),
             "max_val_accuracy_diff": float(np.abs(par["val_accuracy"] - seq["val_accuracy"]).max()),
             "best": _best(trials, par["val_accuracy"], par["val_loss"]),
             "best_sequential": _best(trials, seq["val_accuracy"], seq["val_loss"]),
             "best_over_seeds": _best_over_seeds(trials, par["val_accuracy"]),
             "best_over_seeds_sequential": _best_over_seeds(trials, seq["val_accuracy"]),
             "val_accuracy": par["val_accuracy"].tolist(), "val_loss": par["val_loss"].tolist(),
             "val_accuracy_sequential": seq["val_accuracy"].tolist(),
             "loss_steps": logged,  # step k's loss is the loss of the batch before update k
             "losses_vmapped": par["losses"][:, np.array(logged) - 1].tolist(),
             "losses_sequential": seq["losses"][:, np.array(logged) - 1].tolist()}
        groups.append(g)
        b, b_seq = g["best"], g["best_sequential"]
        other = "" if b["trial"] == b_seq["trial"] else f" (one by one: lr {b_seq['lr']:g} momentum " \
            f"{b_seq['momentum']:g} seed {b_seq['seed']}, {b_seq['val_accuracy']:.4f})"
        print(f"width {width} depth {depth}: vmapped {g['vmapped_s']:.2f} s (+{g['vmapped_compile_s']:.2f} s "
              f"compile), one by one {g['sequential_s']:.2f} s (+{g['sequential_compile_s']:.2f} s), "
              f"speed-up {g['speedup']:.2f}x; best lr {b['lr']:g} momentum {b['momentum']:g} seed "
              f"{b['seed']}: val accuracy {b['val_accuracy']:.4f}{other}; largest loss difference "
              f"{g['max_loss_diff']:.1e}", flush=True)
        m, m_seq = g["best_over_seeds"], g["best_over_seeds_sequential"]
        print(f"  best (lr, momentum) over {m['seeds']} seeds: ({m['lr']:g}, {m['momentum']:g}) mean val "
              f"accuracy {m['mean_val_accuracy']:.4f}; one by one: ({m_seq['lr']:g}, {m_seq['momentum']:g}) "
              f"{m_seq['mean_val_accuracy']:.4f}", flush=True)
    top = max(groups, key=lambda g: g["best"]["val_accuracy"])
    best = {"width": top["width"], "depth": top["depth"], **top["best"]}
    top = max(groups, key=lambda g: g["best_over_seeds"]["mean_val_accuracy"])
    best_mean = {"width": top["width"], "depth": top["depth"], **top["best_over_seeds"]}
    print(f"best overall: width {best['width']} depth {best['depth']} lr {best['lr']:g} momentum "
          f"{best['momentum']:g} seed {best['seed']}: val accuracy {best['val_accuracy']:.4f}; over seeds: "
          f"width {best_mean['width']} depth {best_mean['depth']} lr {best_mean['lr']:g} momentum "
          f"{best_mean['momentum']:g}: {best_mean['mean_val_accuracy']:.4f}")
    config = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    config.update(trial_list=trials, groups=shapes, model="mlp", optimizer="sgd (inject_hyperparams)",
                  train_examples=n_train, devices_used=n_dev)
    result = results.RunResult(kind="hparam", config=config, env=results.environment(),
                               metrics={"groups": groups, "best": best, "best_over_seeds": best_mean})
    path = results.write_atomic(out / "hparam.json", result.to_json() + "\n")
    print(f"wrote {path}")
    return [path]
