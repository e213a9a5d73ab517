"""Batch-size study (Shallue et al. 2018, "Measuring the Effects of Data Parallelism on Neural
Network Training"): steps to reach a target validation error versus batch size.

For each batch size B (powers of two), a grid of learning rates x momenta (heavy-ball momentum
SGD, constant learning rate, as in the paper's SGD-with-momentum runs) is trained *at once*:
the hyperparameters are traced values, so every trial has the same shapes and one vmapped
program (`experiments.studies.trials`: jaxpar's train_step under jax.vmap, on the batches of
jaxpar.data in the loop's order) trains them all on the same batches. Validation error is
measured on a fixed geometric schedule (`--evals-per-octave` points per doubling of the step
count); steps-to-target is the first evaluation at which the best trial reaches the target.
Everything is seeded, so a re-run gives the same steps exactly.

    python -m experiments batch-size --quick --out /tmp/bs          # seconds, synthetic data
    python -m experiments batch-size --out figures/data/batch_size  # ~1 h on 2 cores

Writes OUT/result.json; its table (`batch_size_table`), regimes (`scaling_regimes`) and figure
(`batch_size_figure`) are drawn from that file alone.

The default full run uses an MLP (784-256-10), not the paper's simple CNN: on 2 CPU cores the
CNN would take many hours over this batch-size range. An MLP cannot reach the CNN's 0.10
validation error on Fashion-MNIST within a short budget, so the default target is 0.12.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import options
from experiments.options import option
from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, markdown, num, span, times
from experiments.publish.plotting import legend_below, pyplot, save
from experiments.studies import trials
from experiments.studies.study import Study, at_least
from jaxpar import results
from jaxpar.config import DataConfig
from jaxpar.data import Splits, load_splits, synthetic
from jaxpar.errors import ConfigError
from jaxpar.models import make_model, takes

SYNTHETIC_NOISE = 400.0  # noisier than the default synthetic set: a real curve


@dataclass(frozen=True)
class BatchSizeConfig:
    out: str = options.out("batch-size")
    dataset: str = options.train_option("dataset")
    model: str = options.train_option("model", "mlp")  # an MLP: the CNN takes hours on 2 cores
    width: int | None = options.train_option("width", 256)
    depth: int | None = options.train_option("depth", 1)
    batch_sizes: tuple[int, ...] | None = option(None, "powers of two (default: 16,32,...,4096; with --full-range 8,...,16384)")
    full_range: bool = option(False, "batch sizes 2^3..2^14 instead of 2^4..2^12 (several hours on 2 cores)")
    # 2^-9 .. 1, written as --lrs prints them (6 significant digits)
    lrs: tuple[float, ...] = option(tuple(float(f"{2.0 ** -k:g}") for k in range(9, -1, -1)), "learning-rate grid")
    momenta: tuple[float, ...] = option((0.9, 0.99), "momentum grid")
    target_error: float = option(0.12, "validation error to reach, in (0, 1)")
    max_epochs: int = options.max_epochs()
    evals_per_octave: int = option(6, "validations per doubling of the step count")
    val_size: int = options.val_size()
    seed: int = options.seed()


# Synthetic data, a tiny MLP, batch sizes 16..256, 4 trials: seconds.
QUICK = dataclasses.replace(BatchSizeConfig(), dataset="synthetic", width=32, max_epochs=3,
                            val_size=2000, evals_per_octave=4, lrs=(0.003, 0.01, 0.03, 0.1),
                            momenta=(0.9,), batch_sizes=(16, 32, 64, 128, 256))


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


def _val_error(graphdef):
    """Each trial's validation error on the whole split; a diverged trial (NaN logits) counts
    as wrong everywhere, not as a NaN minimum."""
    evaluate = trials.vmap_trials(trials.eval_step(graphdef))

    def val_error(states, images, labels):
        sums = evaluate(states, {"image": images, "label": labels,
                                 "weight": jnp.ones(labels.shape, jnp.float32)})
        return jnp.where(jnp.isfinite(sums["loss_sum"]), 1.0 - sums["correct"] / sums["count"], 1.0)

    return jax.jit(val_error)


def _states(config: BatchSizeConfig, grid: list[tuple[float, float]]):
    """(graphdef, stacked states): one model (the seed's), one trial per (lr, momentum)."""
    sizes = {k: getattr(config, k) for k in ("width", "depth") if k in takes(config.model)}
    model = make_model(config.model, seed=config.seed, **sizes)
    pairs = [trials.trial_state(model, trials.TX, lr, m) for lr, m in grid]
    return pairs[0][0], jax.device_put(trials.stack([s for _, s in pairs]))


def run_batch_size(splits: Splits, batch: int, grid: list[tuple[float, float]],
                   config: BatchSizeConfig, max_steps: int) -> dict:
    """Train every (lr, momentum) trial at batch size `batch` until the best trial's validation
    error reaches the target or `max_steps` pass; returns the row for this batch size."""
    graphdef, states = _states(config, grid)
    train_chunk = jax.jit(trials.scan_steps(trials.train_step(graphdef, trials.TX)), donate_argnums=0)
    val_error = _val_error(graphdef)
    images, labels = jax.device_put(splits.train[0]), jax.device_put(splits.train[1])
    val_images, val_labels = jax.device_put(splits.val[0]), jax.device_put(splits.val[1])
    order = trials.loop_indices(len(splits.train[1]), batch, config.seed)

    start, done, curve, reached = time.perf_counter(), 0, [], None
    for point in eval_schedule(max_steps, config.evals_per_octave):
        for length in _chunks(point - done):
            states = train_chunk(states, images, labels, np.stack(list(itertools.islice(order, length))))
            done += length
        errors = np.asarray(val_error(states, val_images, val_labels))
        curve.append({"step": point, "best_error": float(errors.min()), "errors": errors.tolist()})
        if errors.min() <= config.target_error:
            reached = point
            break
    best = int(np.argmin(curve[-1]["errors"]))
    row = {"batch_size": batch, "reached": reached is not None, "steps": reached,
           "examples": reached * batch if reached else None, "budget_steps": max_steps,
           "best_lr": grid[best][0], "best_momentum": grid[best][1],
           "best_error": curve[-1]["best_error"], "wall_s": time.perf_counter() - start,
           "curve": curve}
    status = f"{reached} steps" if reached else f"not reached in {max_steps} steps"
    print(f"batch {batch:6d}: {status}; best lr {row['best_lr']:g} momentum {row['best_momentum']:g} "
          f"error {row['best_error']:.4f} ({row['wall_s']:.1f} s)", flush=True)
    return row


def sizes_and_grid(config: BatchSizeConfig) -> tuple[list[int], list[tuple[float, float]]]:
    """(batch sizes, the (lr, momentum) grid); checks the options before any work."""
    lo, hi = (3, 14) if config.full_range else (4, 12)
    sizes = list(config.batch_sizes or [2 ** k for k in range(lo, hi + 1)])
    bad = [b for b in sizes if b < 1 or b & (b - 1)]
    if bad:
        raise ConfigError(f"--batch-sizes must be powers of two, got {bad}")
    if not 0 < config.target_error < 1:
        raise ConfigError(f"--target-error must be in (0, 1), got {config.target_error}")
    at_least(config, 1, "evals_per_octave", "max_epochs", "val_size")
    return sizes, [(lr, m) for m in config.momenta for lr in config.lrs]


def _splits(config: BatchSizeConfig, largest: int) -> Splits:
    if config.dataset == "synthetic":  # noisier than the default synthetic set: a real curve
        images, labels = synthetic(12000, seed=1, noise=SYNTHETIC_NOISE)
        v = config.val_size
        return Splits(train=(images[v:], labels[v:]), val=(images[:v], labels[:v]), test=None)
    return load_splits(DataConfig(dataset=config.dataset, val_size=config.val_size, batch_size=largest),
                seed=config.seed)


def run(config: BatchSizeConfig) -> list[Path]:
    """Every batch size, smallest first; writes OUT/result.json (RunResult, kind 'batch-size')."""
    sizes, grid = sizes_and_grid(config)
    out = results.ensure_writable(config.out)  # fail before the work, not after it
    splits = _splits(config, max(sizes))
    n = len(splits.train[1])
    print(f"{len(grid)} trials per batch size (lr x momentum), {n} training / "
          f"{len(splits.val[1])} validation examples, target error {config.target_error}")
    rows = [run_batch_size(splits, b, grid, config, max(1, math.ceil(config.max_epochs * n / b)))
            for b in sizes]
    record = {**dataclasses.asdict(config), "batch_sizes": sizes, "trials": grid, "train_examples": n}
    result = results.RunResult(kind="batch-size", config=record, env=results.environment(),
                               metrics={"target_error": config.target_error, "rows": rows})
    path = results.save(result, out)
    print(f"wrote {path}")
    return [path]


REGIMES = {"perfect scaling": "#d8f3dc", "diminishing returns": "#fff3b0",
           "maximal data parallelism": "#ffd6d6", "unclassified": "#ffffff"}


def scaling_regimes(batch_sizes: list[int], steps: list[int], slack: float = 1.25) -> list[str]:
    """Shallue et al.'s regime of each point, judged against the whole curve (so one noisy
    point does not flip it). Perfect scaling: a point whose examples used (steps x B) are
    within `slack` of the fewest any batch size needed, up to the last such point; a point
    before that needing more is 'unclassified' (not perfect, and no regime of the paper).
    After it, maximal data parallelism once the steps no longer fall below 0.9x the fewest
    of any smaller batch, and diminishing returns before that. The paper names the regimes
    by eye; these thresholds are ours."""
    examples = [s * b for s, b in zip(steps, batch_sizes)]
    within = [e <= slack * min(examples) for e in examples]
    knee = max(i for i, ok in enumerate(within) if ok)
    out = []
    for i, s in enumerate(steps):
        if i <= knee:
            out.append("perfect scaling" if within[i] else "unclassified")
        elif s >= 0.9 * min(steps[:i]):
            out.append("maximal data parallelism")
        else:
            out.append("diminishing returns")
    return out

def batch_size_table(data_dir: Path) -> str:
    r = sources.load_source(data_dir, "batch-size")
    rows, target = r["metrics"]["rows"], r["metrics"]["target_error"]
    reached = [x for x in rows if x["reached"]]
    regimes = dict(zip([x["batch_size"] for x in reached],
                       scaling_regimes([x["batch_size"] for x in reached], [x["steps"] for x in reached])))
    fewest = min(x["examples"] for x in reached)
    lr = lambda x: f"2^{round(math.log2(x['best_lr']))}"  # noqa: E731
    return markdown(
        ["batch size", *[x["batch_size"] for x in rows]],
        [[f"steps to {target:g} error", *[num(x["steps"]) if x["reached"] else "not reached" for x in rows]],
         ["examples (k)", *[num(x["examples"] / 1e3) if x["reached"] else DASH for x in rows]],
         ["examples / fewest", *[f"{x['examples'] / fewest:.2f}" if x["reached"] else DASH for x in rows]],
         ["regime", *[regimes.get(x["batch_size"], DASH) for x in rows]],
         ["best lr (momentum)", *[f"{lr(x)} ({x['best_momentum']:g})" if x["reached"] else DASH for x in rows]]])


def batch_size_figure(result: dict, out: Path) -> Path:
    """Steps and examples to the target validation error against batch size (log-log), with
    the perfect-scaling line through the fewest examples, the 1.25x band that defines the
    perfect regime, and each point's regime shaded (`scaling_regimes`)."""
    plt = pyplot()
    rows = [r for r in result["metrics"]["rows"] if r["reached"]]
    cfg, env = result["config"], result["env"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    if rows:
        bs, steps = [r["batch_size"] for r in rows], [r["steps"] for r in rows]
        regimes = scaling_regimes(bs, steps)
        edges = [bs[0] / 2 ** 0.5] + [(a * b) ** 0.5 for a, b in zip(bs, bs[1:])] + [bs[-1] * 2 ** 0.5]
        for a in (ax, ax2):
            for lo, hi, name in zip(edges, edges[1:], regimes):
                a.axvspan(lo, hi, color=REGIMES[name], zorder=0)
        fewest = min(s * b for s, b in zip(steps, bs))
        ax.plot(bs, [fewest / b for b in bs], "k--", lw=1)
        ax.plot(bs, steps, "o-", color="C0")
        ax2.plot(bs, [r["examples"] for r in rows], "o-", color="C0")
        ax2.axhline(fewest, color="k", ls="--", lw=1)
        ax2.axhline(1.25 * fewest, color="k", ls=":", lw=1)
        for b, e in zip(bs, (r["examples"] for r in rows)):
            ax2.annotate(f"{e / fewest:.2f}x", (b, e), textcoords="offset points", xytext=(0, 6),
                         ha="center", fontsize=7)
    missed = [r["batch_size"] for r in result["metrics"]["rows"] if not r["reached"]]
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("batch size")
    ax.set_title("Steps to the target", fontsize=10)
    ax.set_ylabel(f"steps to {result['metrics']['target_error']:.2f} validation error")
    ax2.set_title("Examples to the target (x the fewest)", fontsize=10)
    ax2.set_ylabel("examples (steps x batch size)")
    handles = [plt.Line2D([], [], color="C0", marker="o", label="measured (best trial of the grid)"),
               plt.Line2D([], [], color="k", ls="--", label="perfect scaling (fewest examples)"),
               plt.Line2D([], [], color="k", ls=":", label="1.25x the fewest: perfect-regime cut-off")]
    used = list(dict.fromkeys(regimes)) if rows else []
    handles += [plt.Rectangle((0, 0), 1, 1, fc=REGIMES[n], ec="0.7", label=n) for n in used]
    model = cfg["model"]
    if model == "mlp":
        model += f" {cfg.get('width', '')}x{cfg.get('depth', '')}"
    note = f"; not reached within budget: {missed}" if missed else ""
    fig.suptitle(f"{cfg['dataset']}, {model}, momentum SGD, {len(cfg['trials'])} (lr, momentum) trials per "
                 f"batch size; {env.get('cpu_cores', '?')} CPU cores{note}", fontsize=10)
    fig.tight_layout()
    legend_below(fig, handles, [h.get_label() for h in handles], ncol=4)
    return save(fig, out / "batch_size.png")

def _momenta(config: dict) -> list[float]:
    """The grid's momenta (an older results file wrote the flag's text: '0.9,0.99')."""
    momenta = config["momenta"]
    return [float(m) for m in (momenta.split(",") if isinstance(momenta, str) else momenta)]


def batch_size_findings(data_dir: Path) -> str:
    """The regimes in words, the steps each doubling buys, and the best hyperparameters."""
    r = sources.load_source(data_dir, "batch-size")
    rows = [x for x in r["metrics"]["rows"] if x["reached"]]
    sizes, steps = [x["batch_size"] for x in rows], [x["steps"] for x in rows]
    regimes = scaling_regimes(sizes, steps)
    fewest = min(x["examples"] for x in rows)
    at = lambda regime: [i for i, g in enumerate(regimes) if g == regime]  # noqa: E731
    perfect, fading, maximal = at("perfect scaling"), at("diminishing returns"), at("maximal data parallelism")
    lines = [f"Perfect scaling from batch {sizes[perfect[0]]} to {sizes[perfect[-1]]}: each doubling "
             f"halves the steps ({', '.join(num(steps[i]) for i in perfect)}), the examples within "
             f"{span([rows[i]['examples'] / fewest for i in perfect], '.2f', 'x')} the fewest ({num(fewest / 1e3)}k)."]
    if fading:
        gains = [steps[i - 1] / steps[i] for i in fading if i > 0]
        lines.append(f"Diminishing returns from batch {sizes[fading[0]]} to {sizes[fading[-1]]}: each "
                     f"doubling buys {span(gains, '.1f', 'x')} fewer steps, not 2x.")
    for i in maximal:
        verb = "more" if steps[i] > steps[i - 1] else "no fewer"
        lines.append(f"Maximal data parallelism at batch {sizes[i]}: it needs {verb} steps than "
                     f"{sizes[i - 1]} ({num(steps[i])} against {num(steps[i - 1])}), "
                     f"{times(rows[i]['examples'] / fewest)} the fewest examples.")
    lines += [f"Batch {sizes[i]} needs {times(rows[i]['examples'] / fewest)} the fewest examples: before "
              "the perfect regime but outside its 1.25x, so unclassified." for i in at("unclassified")]
    lr = [round(math.log2(x["best_lr"])) for x in rows]
    top = lr.index(max(lr))
    lines.append(f"The best learning rate grows with the batch, from 2^{lr[0]} at batch {sizes[0]} to "
                 f"2^{lr[perfect[-1]]} at {sizes[perfect[-1]]}, and reaches its largest, 2^{lr[top]}, at batch "
                 f"{sizes[top]}, where it stays.")
    never = [f"{m:g}" for m in _momenta(r["config"]) if m not in {x["best_momentum"] for x in rows}]
    if never:
        lines.append(f"Momentum {listing(never)} never won.")
    return bullets(lines)


TABLES = {"batch-size": batch_size_table, "batch-size-findings": batch_size_findings}
FIGURES = (("batch-size", (("batch_size.png", batch_size_figure),)),)


STUDY = Study("batch-size", "steps to a target validation error vs batch size (Shallue et al. 2018), "
                            "lr x momentum grid as vmapped trials; writes OUT/result.json",
              BatchSizeConfig, QUICK, run)
