"""Hyperparameter search as parallel vmapped trials vs one trial after another.

Learning rate, momentum and seed do not change shapes: learning rate and momentum are traced
values (`optax.inject_hyperparams`) and the seed only draws the initial parameters, so every
trial of a group has the same shapes and the whole grid is one vmapped program
(`experiments.trials`: jaxpar's train_step under jax.vmap), its trial axis sharded over devices
(a NamedSharding on a DATA mesh; `--devices` simulates CPU devices). Width and depth change
shapes: each (width, depth) is its own group, searched on its own.

Both ways train every trial on the same batches (jaxpar.data's, in the loop's order) for
`--steps` steps (one jitted call a step), then evaluate each trial's validation accuracy; the
best configuration is the trial with the highest validation accuracy, per group and overall,
and the best (lr, momentum) by accuracy averaged over the seeds. Wall times exclude
compilation, which is timed on its own (ahead-of-time `lower().compile()`). Batched and single
matmuls round differently (about an ulp a step), so over long or unstable runs the two ways'
losses drift apart; each trial's largest difference is recorded, and both ways' best
configurations.

    python -m experiments hparam --out figures/data/hparam   # Fashion-MNIST, 4 groups of 16 trials
    python -m experiments hparam --quick --out /tmp/hparam   # synthetic data, seconds

Writes OUT/hparam.json (RunResult, kind 'hparam'), atomically.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments import options, trials
from experiments.options import option
from experiments.study import Study, at_least, distinct
from jaxpar import data as datalib
from jaxpar import results
from jaxpar.config import DataConfig
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA, make_mesh, simulate_cpu_devices
from jaxpar.models import make_model

LOGGED_STEPS = 20  # loss curves kept in the JSON per trial (all steps are compared)
DATA_SEED = 0  # the validation split and the batch order, the same for every trial


@dataclass(frozen=True)
class HparamConfig:
    out: str = options.out("hparam")
    dataset: str = options.train_option("dataset")
    # the trial axis is sharded over them: they must divide the trials per group
    devices: int | None = options.train_option("devices")
    lrs: tuple[float, ...] = option((0.01, 0.03, 0.1, 0.3), "learning rates")
    momenta: tuple[float, ...] = option((0.0, 0.9), "momenta, in [0, 1)")
    seeds: tuple[int, ...] = option((0, 1), "parameter-init seeds")
    widths: tuple[int, ...] = option((64, 256), "MLP hidden widths, one group each")
    depths: tuple[int, ...] = option((1, 2), "MLP hidden layers, one group each")
    steps: int = option(300, "training steps per trial")
    batch_size: int = options.train_option("batch_size")
    val_size: int = options.val_size()


# Synthetic data, 8 trials (2 lrs x 2 momenta x 2 seeds), width 32, depths 1 and 2, 10 steps.
QUICK = dataclasses.replace(HparamConfig(), dataset="synthetic", lrs=(0.03, 0.1), widths=(32,),
                            steps=10, batch_size=32, val_size=1000)


def plan(config: HparamConfig) -> tuple[list[tuple[int, float, float]], list[tuple[int, int]]]:
    """(trials [(seed, lr, momentum)], groups [(width, depth)]); checks options before any work."""
    distinct(config, "lrs", "momenta", "seeds", "widths", "depths")
    if min(config.lrs) <= 0 or not all(0 <= m < 1 for m in config.momenta):
        raise ConfigError("--lrs must be > 0 and --momenta in [0, 1)")
    at_least(config, 1, "widths", "depths", "steps", "batch_size", "val_size")
    if config.devices is not None:
        at_least(config, 1, "devices")
    grid = list(itertools.product(config.seeds, config.lrs, config.momenta))
    if config.devices and len(grid) % config.devices:
        raise ConfigError(f"--devices {config.devices} must divide the {len(grid)} trials per group "
                          f"(lrs x momenta x seeds) so each device trains the same number")
    return grid, list(itertools.product(config.widths, config.depths))


def _compile(fn, *args):
    """(compiled, seconds): compiled ahead of time so the timed loop never compiles."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start


def search(grid, width: int, depth: int, batches: list[dict], val: list[dict], mesh,
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
    pairs = [trials.trial_state(make_model("mlp", seed=seed, width=width, depth=depth), trials.TX,
                                lr, momentum) for seed, lr, momentum in grid]
    graphdef, states = pairs[0][0], [s for _, s in pairs]
    step, evaluate = trials.train_step(graphdef, trials.TX), trials.eval_step(graphdef)
    place = jax.devices()[0]
    if vmapped:
        step, evaluate = trials.vmap_trials(step), trials.vmap_trials(evaluate)
        states = [jax.device_put(trials.stack(states), NamedSharding(mesh, P(DATA)))]
        place = NamedSharding(mesh, P())  # every device sees the whole batch
    batches = [jax.device_put(b, place) for b in batches]  # placed before the clock starts
    val = [jax.device_put(b, place) for b in val]
    train, compile_train = _compile(jax.jit(step, donate_argnums=0), states[0], batches[0])
    evaluate, compile_eval = _compile(jax.jit(evaluate), states[0], val[0])

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
    totals = jax.device_get([jax.tree.map(lambda *xs: sum(xs), *[evaluate(st, b) for b in val])
                             for st in finals])
    eval_s = time.perf_counter() - start

    losses = np.array([[np.asarray(s["loss_sum"]) / np.asarray(s["count"]) for s in per_step]
                       for per_step in jax.device_get(sums)], np.float64)  # [runs, steps, (trials)]
    val_correct, val_count, val_loss = (np.concatenate([np.atleast_1d(t[k]) for t in totals])
                                        for k in ("correct", "count", "loss_sum"))
    return {"losses": np.moveaxis(losses[0], 1, 0) if vmapped else losses,
            "val_accuracy": val_correct / val_count, "val_loss": val_loss / val_count,
            "train_s": train_s, "compile_s": compile_train + compile_eval, "eval_s": eval_s}


def _best(grid, val_accuracy, val_loss) -> dict:
    """Highest validation accuracy; ties go to the lower validation loss. A diverged trial
    (non-finite loss) never wins."""
    acc = np.where(np.isfinite(val_loss), val_accuracy, -1.0)
    i = min(range(len(grid)), key=lambda k: (-acc[k], val_loss[k] if np.isfinite(val_loss[k]) else np.inf))
    seed, lr, momentum = grid[i]
    return {"trial": i, "seed": seed, "lr": lr, "momentum": momentum,
            "val_accuracy": float(val_accuracy[i]), "val_loss": float(val_loss[i])}


def _best_over_seeds(grid, val_accuracy) -> dict:
    """The (lr, momentum) with the highest validation accuracy averaged over the seeds: a
    ranking less at the mercy of one initialisation (or of rounding) than the single best trial."""
    by = {}
    for (_, lr, momentum), acc in zip(grid, val_accuracy):
        by.setdefault((lr, momentum), []).append(float(acc) if np.isfinite(acc) else 0.0)
    (lr, momentum), accs = max(by.items(), key=lambda kv: np.mean(kv[1]))
    return {"lr": lr, "momentum": momentum, "mean_val_accuracy": float(np.mean(accs)), "seeds": len(accs)}


def _data(config: HparamConfig):
    """(host training batches, host validation batches, training examples): the same for
    every trial, the training batches in jaxpar.train's order."""
    cfg = DataConfig(dataset=config.dataset, val_size=config.val_size, batch_size=config.batch_size)
    splits = datalib.load(cfg, seed=DATA_SEED)
    batches = list(trials.loop_batches(splits.train, config.batch_size, DATA_SEED, count=config.steps))
    val = list(datalib.eval_batches(splits.val, min(cfg.eval_batch_size, config.val_size)))
    return batches, val, len(splits.train[1])


def group(grid, width: int, depth: int, batches, val, mesh, steps: int) -> dict:
    """Both ways for one (width, depth): times, differences, best trials, loss curves."""
    par = search(grid, width, depth, batches, val, mesh, vmapped=True)
    seq = search(grid, width, depth, batches, val, None, vmapped=False)
    diff = np.abs(par["losses"] - seq["losses"])
    logged = sorted({1} | {max(1, round(k * steps / LOGGED_STEPS)) for k in range(1, LOGGED_STEPS + 1)})
    return {"width": width, "depth": depth, "trials": len(grid),
            "vmapped_s": par["train_s"], "sequential_s": seq["train_s"],
            "speedup": seq["train_s"] / par["train_s"],
            "vmapped_compile_s": par["compile_s"], "sequential_compile_s": seq["compile_s"],
            "vmapped_eval_s": par["eval_s"], "sequential_eval_s": seq["eval_s"],
            # Same math, but batched and single matmuls round differently (an ulp a step);
            # long or unstable runs can grow that: kept per trial, not hidden in one number.
            "max_loss_diff": float(np.nanmax(diff)) if np.isfinite(diff).any() else 0.0,
            "loss_diff_per_trial": np.nanmax(diff, axis=1).tolist(),
            "max_val_accuracy_diff": float(np.abs(par["val_accuracy"] - seq["val_accuracy"]).max()),
            "best": _best(grid, par["val_accuracy"], par["val_loss"]),
            "best_sequential": _best(grid, seq["val_accuracy"], seq["val_loss"]),
            "best_over_seeds": _best_over_seeds(grid, par["val_accuracy"]),
            "best_over_seeds_sequential": _best_over_seeds(grid, seq["val_accuracy"]),
            "val_accuracy": par["val_accuracy"].tolist(), "val_loss": par["val_loss"].tolist(),
            "val_accuracy_sequential": seq["val_accuracy"].tolist(),
            "loss_steps": logged,  # step k's loss is the loss of the batch before update k
            "losses_vmapped": par["losses"][:, np.array(logged) - 1].tolist(),
            "losses_sequential": seq["losses"][:, np.array(logged) - 1].tolist()}


def _report(g: dict) -> None:
    b, b_seq = g["best"], g["best_sequential"]
    other = "" if b["trial"] == b_seq["trial"] else f" (one by one: lr {b_seq['lr']:g} momentum " \
        f"{b_seq['momentum']:g} seed {b_seq['seed']}, {b_seq['val_accuracy']:.4f})"
    print(f"width {g['width']} depth {g['depth']}: vmapped {g['vmapped_s']:.2f} s (+{g['vmapped_compile_s']:.2f} s "
          f"compile), one by one {g['sequential_s']:.2f} s (+{g['sequential_compile_s']:.2f} s), "
          f"speed-up {g['speedup']:.2f}x; best lr {b['lr']:g} momentum {b['momentum']:g} seed "
          f"{b['seed']}: val accuracy {b['val_accuracy']:.4f}{other}; largest loss difference "
          f"{g['max_loss_diff']:.1e}", flush=True)
    m, m_seq = g["best_over_seeds"], g["best_over_seeds_sequential"]
    print(f"  best (lr, momentum) over {m['seeds']} seeds: ({m['lr']:g}, {m['momentum']:g}) mean val "
          f"accuracy {m['mean_val_accuracy']:.4f}; one by one: ({m_seq['lr']:g}, {m_seq['momentum']:g}) "
          f"{m_seq['mean_val_accuracy']:.4f}", flush=True)


def _overall(groups: list[dict]) -> tuple[dict, dict]:
    """(the best trial of all groups, the best (lr, momentum) over seeds of all groups)."""
    top = max(groups, key=lambda g: g["best"]["val_accuracy"])
    best = {"width": top["width"], "depth": top["depth"], **top["best"]}
    top = max(groups, key=lambda g: g["best_over_seeds"]["mean_val_accuracy"])
    best_mean = {"width": top["width"], "depth": top["depth"], **top["best_over_seeds"]}
    print(f"best overall: width {best['width']} depth {best['depth']} lr {best['lr']:g} momentum "
          f"{best['momentum']:g} seed {best['seed']}: val accuracy {best['val_accuracy']:.4f}; over seeds: "
          f"width {best_mean['width']} depth {best_mean['depth']} lr {best_mean['lr']:g} momentum "
          f"{best_mean['momentum']:g}: {best_mean['mean_val_accuracy']:.4f}")
    return best, best_mean


def run(config: HparamConfig) -> list[Path]:
    """Both ways per (width, depth) group; write OUT/hparam.json; return its path."""
    grid, shapes = plan(config)
    out = results.ensure_writable(config.out)  # fail before the work, not after it
    simulate_cpu_devices(config.devices)  # before JAX's backend starts
    n_dev = len(jax.devices())
    if len(grid) % n_dev:
        raise ConfigError(f"the {len(grid)} trials per group do not divide over the {n_dev} devices "
                          f"present; pass --devices with a divisor of {len(grid)}")
    mesh = make_mesh({DATA: n_dev})
    batches, val, n_train = _data(config)
    print(f"{len(grid)} trials (seed x lr x momentum) per group, {len(shapes)} (width, depth) groups, "
          f"{config.steps} steps of batch {config.batch_size} on {config.dataset} ({n_train} train / "
          f"{config.val_size} validation); vmapped trial axis over {n_dev} device(s)", flush=True)
    groups = []
    for width, depth in shapes:
        groups.append(group(grid, width, depth, batches, val, mesh, config.steps))
        _report(groups[-1])
    best, best_mean = _overall(groups)
    record = {**dataclasses.asdict(config), "trial_list": grid, "groups": shapes, "model": "mlp",
              "optimizer": "sgd (inject_hyperparams)", "train_examples": n_train, "devices_used": n_dev}
    result = results.RunResult(kind="hparam", config=record, env=results.environment(),
                               metrics={"groups": groups, "best": best, "best_over_seeds": best_mean})
    path = results.write_atomic(out / "hparam.json", result.to_json() + "\n")
    print(f"wrote {path}")
    return [path]


STUDY = Study("hparam", "lr/momentum/seed search as vmapped trials (sharded over --devices) vs one by "
                        "one, best by validation accuracy; writes OUT/hparam.json", HparamConfig, QUICK, run)
