"""Hyperparameter search as parallel vmapped trials vs one trial after another.

The trials are a grid (every combination of `--lrs`, `--momenta`, `--seeds` and, when given,
`--epochs`) or a random search (`--search random --trials N`: the learning rate drawn
log-uniformly between the smallest and largest of `--lrs`, the momentum, seed and epochs from
their lists, seeded by `--search-seed`). With `--epochs` a trial trains that many passes over
the training split instead of `--steps` steps: at a constant learning rate a trial of E epochs
is the first E epochs of a longer one (same batches, same order), so the vmapped trials train
together to the longest and each is evaluated where its own epochs end (its losses after that
are not its own: left out), while one by one each trial trains its own epochs.

Learning rate, momentum and seed do not change shapes: learning rate and momentum are traced
values (`optax.inject_hyperparams`) and the seed only draws the initial parameters, so every
trial of a group has the same shapes and the whole grid is one vmapped program
(`experiments.studies.trials`: jaxpar's train_step under jax.vmap), its trial axis sharded over devices
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
    python -m experiments hparam --search random --trials 16 --epochs 1,2,4 --momenta 0.9 \
        --out /tmp/hparam-epochs                              # epochs and learning rate

Writes OUT/hparam.json (RunResult, kind 'hparam'), atomically; its table and figure
(tables.py, figures.py) are drawn from that file alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments import options
from experiments.studies import trials
from experiments.options import option
from experiments.studies.study import Study, at_least, distinct
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
    steps: int = option(300, "training steps per trial (without --epochs)")
    epochs: tuple[int, ...] = option((), "an epochs axis: each trial trains E passes over the "
                                         "training split, E from this list (default: --steps steps)")
    search: str = option("grid", "grid: every combination of the lists | random: --trials draws")
    trials: int = option(16, "random search: trials per group")
    search_seed: int = option(0, "random search: seeds the draws")
    batch_size: int = options.train_option("batch_size")
    val_size: int = options.val_size()

SEARCHES = ("grid", "random")


# Synthetic data, 8 trials (2 lrs x 2 momenta x 2 seeds), width 32, depths 1 and 2, 10 steps.
QUICK = dataclasses.replace(HparamConfig(), dataset="synthetic", lrs=(0.03, 0.1), widths=(32,),
                            steps=10, batch_size=32, val_size=1000)


def trials_and_groups(config: HparamConfig) -> tuple[list[tuple], list[tuple[int, int]]]:
    """(trials [(seed, lr, momentum, epochs or None)], groups [(width, depth)]); checks
    options before any work."""
    distinct(config, "lrs", "momenta", "seeds", "widths", "depths", "epochs")
    if min(config.lrs) <= 0 or not all(0 <= m < 1 for m in config.momenta):
        raise ConfigError("--lrs must be > 0 and --momenta in [0, 1)")
    if config.search not in SEARCHES:
        raise ConfigError(f"--search {config.search!r} is not one of: {', '.join(SEARCHES)}")
    at_least(config, 1, "widths", "depths", "steps", "batch_size", "val_size", "trials")
    if config.epochs and min(config.epochs) < 1:
        raise ConfigError(f"--epochs {','.join(map(str, config.epochs))}: each must be >= 1")
    if config.devices is not None:
        at_least(config, 1, "devices")
    grid = draws(config) if config.search == "random" else list(
        itertools.product(config.seeds, config.lrs, config.momenta, config.epochs or (None,)))
    if config.devices and len(grid) % config.devices:
        raise ConfigError(f"--devices {config.devices} must divide the {len(grid)} trials per group "
                          f"({'--trials' if config.search == 'random' else 'lrs x momenta x seeds x epochs'}) "
                          f"so each device trains the same number")
    return grid, list(itertools.product(config.widths, config.depths))


def draws(config: HparamConfig) -> list[tuple]:
    """--trials random trials: lr log-uniform over [min, max] of --lrs (3 significant digits),
    momentum, seed and epochs drawn from their lists; the same --search-seed, the same draws."""
    rng = np.random.default_rng(config.search_seed)
    low, high = np.log(min(config.lrs)), np.log(max(config.lrs))
    pick = lambda values: values[int(rng.integers(len(values)))]  # noqa: E731  (plain Python values)
    return [(pick(config.seeds), float(f"{np.exp(rng.uniform(low, high)):.3g}"),
             pick(config.momenta), pick(config.epochs) if config.epochs else None)
            for _ in range(config.trials)]


def _compile(fn, *args):
    """(compiled, seconds): compiled ahead of time so the timed loop never compiles."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start


def search(grid, width: int, depth: int, batches: list[dict], val: list[dict], mesh,
           vmapped: bool, steps: list[int]) -> dict:
    """Train every (seed, lr, momentum, ...) trial for its `steps`, then evaluate it on the
    validation batches.

    Args:
      batches, val: host batches (the same for every trial), `max(steps)` training batches.
      mesh: a DATA mesh whose devices hold the trial axis (vmapped); None: one device.
      vmapped: True = one program over the stacked trials, all trained to the longest and
        each evaluated where its own steps end; False = each trial on its own, one after another.
    Returns:
      {"losses" [trial, step] (NaN past a trial's steps), "val_accuracy", "val_loss" [trial],
       "train_s" (excluding compilation), "compile_s", "eval_s"}
    """
    pairs = [trials.trial_state(make_model("mlp", seed=seed, width=width, depth=depth), trials.TX,
                                lr, momentum) for seed, lr, momentum, _ in grid]
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

    # Per run (one stacked run, or one per trial): the states to evaluate, by step count.
    ends = [sorted(set(steps))] if vmapped else [[n] for n in steps]
    start, sums, kept = time.perf_counter(), [], []
    for state, stops in zip(states, ends):
        per_step, at = [], {}
        for k, b in enumerate(batches[:stops[-1]], 1):
            state, s = train(state, b)
            per_step.append(s)
            if k in stops:  # a copy: the next step donates (deletes) this state's buffers
                at[k] = state if k == stops[-1] else jax.tree.map(jnp.copy, state)
        jax.block_until_ready(state)
        sums.append(per_step)
        kept.append(at)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    totals = [{k: jax.device_get(jax.tree.map(lambda *xs: sum(xs), *[evaluate(st, b) for b in val]))
               for k, st in at.items()} for at in kept]
    eval_s = time.perf_counter() - start

    if vmapped:  # trial i: row i of the evaluation where its steps end
        pick = [{k: np.atleast_1d(v)[i] for k, v in totals[0][n].items()} for i, n in enumerate(steps)]
    else:
        pick = [t[n] for t, n in zip(totals, steps)]
    val_correct, val_count, val_loss = (np.array([float(p[k]) for p in pick])
                                        for k in ("correct", "count", "loss_sum"))
    return {"losses": _losses(jax.device_get(sums), steps, vmapped),
            "val_accuracy": val_correct / val_count, "val_loss": val_loss / val_count,
            "train_s": train_s, "compile_s": compile_train + compile_eval, "eval_s": eval_s}


def _losses(sums: list[list[dict]], steps: list[int], vmapped: bool) -> np.ndarray:
    """[trial, step] losses from the runs' metric sums; NaN past each trial's own steps."""
    longest = max(steps)
    out = np.full((len(steps), longest), np.nan)
    for run, per_step in enumerate(sums):
        loss = np.array([np.asarray(s["loss_sum"]) / np.asarray(s["count"]) for s in per_step], np.float64)
        if vmapped:  # [steps, trials]
            out[:, :len(loss)] = loss.T
        else:
            out[run, :len(loss)] = loss
    for i, n in enumerate(steps):
        out[i, n:] = np.nan
    return out


def _best(grid, val_accuracy, val_loss) -> dict:
    """Highest validation accuracy; ties go to the lower validation loss. A diverged trial
    (non-finite loss) never wins."""
    acc = np.where(np.isfinite(val_loss), val_accuracy, -1.0)
    i = min(range(len(grid)), key=lambda k: (-acc[k], val_loss[k] if np.isfinite(val_loss[k]) else np.inf))
    seed, lr, momentum, epochs = grid[i]
    return {"trial": i, "seed": seed, "lr": lr, "momentum": momentum, **_epochs(epochs),
            "val_accuracy": float(val_accuracy[i]), "val_loss": float(val_loss[i])}


def _epochs(epochs: int | None) -> dict:
    """{"epochs": E} for a trial of the epochs axis; {} without one (results keep their form)."""
    return {} if epochs is None else {"epochs": epochs}


def _best_over_seeds(grid, val_accuracy) -> dict:
    """The (lr, momentum, epochs) with the highest validation accuracy averaged over the
    seeds: a ranking less at the mercy of one initialisation (or of rounding) than the single
    best trial."""
    by = {}
    for (_, lr, momentum, epochs), acc in zip(grid, val_accuracy):
        by.setdefault((lr, momentum, epochs), []).append(float(acc) if np.isfinite(acc) else 0.0)
    (lr, momentum, epochs), accs = max(by.items(), key=lambda kv: np.mean(kv[1]))
    return {"lr": lr, "momentum": momentum, **_epochs(epochs), "mean_val_accuracy": float(np.mean(accs)),
            "seeds": len(accs)}


def _data(config: HparamConfig, grid: list[tuple]):
    """(host training batches, host validation batches, training examples, each trial's
    steps): the batches the same for every trial, the training ones in jaxpar.train's order,
    as many as the longest trial takes."""
    cfg = DataConfig(dataset=config.dataset, val_size=config.val_size, batch_size=config.batch_size)
    splits = datalib.load_splits(cfg, seed=DATA_SEED)
    per_epoch = datalib.steps_per_epoch(len(splits.train[1]), config.batch_size)
    steps = [config.steps if epochs is None else epochs * per_epoch for *_, epochs in grid]
    batches = list(trials.loop_batches(splits.train, config.batch_size, DATA_SEED, count=max(steps)))
    val = list(datalib.eval_batches(splits.val, min(cfg.eval_batch_size, config.val_size)))
    return batches, val, len(splits.train[1]), steps


def _listed(a: np.ndarray) -> list:
    """`a.tolist()` with NaN as None (JSON has no NaN)."""
    return np.where(np.isnan(a), None, a).tolist()


def search_group(grid, width: int, depth: int, batches, val, mesh, steps: list[int]) -> dict:
    """Both ways for one (width, depth): times, differences, best trials, loss curves."""
    par = search(grid, width, depth, batches, val, mesh, vmapped=True, steps=steps)
    seq = search(grid, width, depth, batches, val, None, vmapped=False, steps=steps)
    diff = np.abs(par["losses"] - seq["losses"])
    longest = max(steps)
    logged = sorted({1} | {max(1, round(k * longest / LOGGED_STEPS)) for k in range(1, LOGGED_STEPS + 1)})
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
            "losses_vmapped": _listed(par["losses"][:, np.array(logged) - 1]),
            "losses_sequential": _listed(seq["losses"][:, np.array(logged) - 1])}


def _report(g: dict) -> None:
    b, b_seq = g["best"], g["best_sequential"]
    other = "" if b["trial"] == b_seq["trial"] else f" (one by one: lr {b_seq['lr']:g} momentum " \
        f"{b_seq['momentum']:g} seed {b_seq['seed']}, {b_seq['val_accuracy']:.4f})"
    print(f"width {g['width']} depth {g['depth']}: vmapped {g['vmapped_s']:.2f} s (+{g['vmapped_compile_s']:.2f} s "
          f"compile), one by one {g['sequential_s']:.2f} s (+{g['sequential_compile_s']:.2f} s), "
          f"speed-up {g['speedup']:.2f}x; best lr {b['lr']:g} momentum {b['momentum']:g} seed "
          f"{b['seed']}{_per(b)}: val accuracy {b['val_accuracy']:.4f}{other}; largest loss difference "
          f"{g['max_loss_diff']:.1e}", flush=True)
    m, m_seq = g["best_over_seeds"], g["best_over_seeds_sequential"]
    print(f"  best (lr, momentum) over {m['seeds']} seeds: ({m['lr']:g}, {m['momentum']:g}){_per(m)} mean val "
          f"accuracy {m['mean_val_accuracy']:.4f}; one by one: ({m_seq['lr']:g}, {m_seq['momentum']:g}) "
          f"{m_seq['mean_val_accuracy']:.4f}", flush=True)


def _per(best: dict) -> str:
    return f" epochs {best['epochs']}" if "epochs" in best else ""


def _overall(groups: list[dict]) -> tuple[dict, dict]:
    """(the best trial of all groups, the best (lr, momentum) over seeds of all groups)."""
    top = max(groups, key=lambda g: g["best"]["val_accuracy"])
    best = {"width": top["width"], "depth": top["depth"], **top["best"]}
    top = max(groups, key=lambda g: g["best_over_seeds"]["mean_val_accuracy"])
    best_mean = {"width": top["width"], "depth": top["depth"], **top["best_over_seeds"]}
    print(f"best overall: width {best['width']} depth {best['depth']} lr {best['lr']:g} momentum "
          f"{best['momentum']:g} seed {best['seed']}{_per(best)}: val accuracy {best['val_accuracy']:.4f}; over seeds: "
          f"width {best_mean['width']} depth {best_mean['depth']} lr {best_mean['lr']:g} momentum "
          f"{best_mean['momentum']:g}: {best_mean['mean_val_accuracy']:.4f}")
    return best, best_mean


def run(config: HparamConfig) -> list[Path]:
    """Both ways per (width, depth) group; write OUT/hparam.json; return its path."""
    grid, shapes = trials_and_groups(config)
    out = results.ensure_writable(config.out)  # fail before the work, not after it
    simulate_cpu_devices(config.devices)  # before JAX's backend starts
    n_dev = len(jax.devices())
    if len(grid) % n_dev:
        raise ConfigError(f"the {len(grid)} trials per group do not divide over the {n_dev} devices "
                          f"present; pass --devices with a divisor of {len(grid)}")
    mesh = make_mesh({DATA: n_dev})
    batches, val, n_train, steps = _data(config, grid)
    length = (f"{','.join(map(str, config.epochs))} epochs ({min(steps)}-{max(steps)} steps)"
              if config.epochs else f"{config.steps} steps")
    print(f"{len(grid)} trials ({config.search} search: seed, lr, momentum"
          f"{', epochs' if config.epochs else ''}) per group, {len(shapes)} (width, depth) groups, "
          f"{length} of batch {config.batch_size} on {config.dataset} ({n_train} train / "
          f"{config.val_size} validation); vmapped trial axis over {n_dev} device(s)", flush=True)
    groups = []
    for width, depth in shapes:
        groups.append(search_group(grid, width, depth, batches, val, mesh, steps))
        _report(groups[-1])
    best, best_mean = _overall(groups)
    record = {**dataclasses.asdict(config), "trial_list": [t[:3] for t in grid], "groups": shapes,
              "trial_epochs": [t[3] for t in grid] if config.epochs else None,
              "trial_steps": steps, "model": "mlp",
              "optimizer": "sgd (inject_hyperparams)", "train_examples": n_train, "devices_used": n_dev}
    result = results.RunResult(kind="hparam", config=record, env=results.environment(),
                               metrics={"groups": groups, "best": best, "best_over_seeds": best_mean})
    path = results.write_atomic(out / "hparam.json", result.to_json() + "\n")
    print(f"wrote {path}")
    return [path]


STUDY = Study("hparam", "lr/momentum/seed (and epochs) search, grid or random, as vmapped trials "
                        "(sharded over --devices) vs one by one, best by validation accuracy; "
                        "writes OUT/hparam.json", HparamConfig, QUICK, run)
