"""Scaling study: data-parallel strategies over simulated device counts, strong (fixed global
batch) and weak (fixed per-device batch) — one `bench` process per point, since the device
count must be fixed before JAX starts.

    python -m experiments scaling --out figures/data/scaling            # full: MLP and CNN
    python -m experiments scaling --quick --out /tmp/scaling            # seconds
    python -m experiments scaling --ranks 1,2 --out figures/data/scaling  # MPI ranks beside

Writes one bench result per point and round under OUT/<mode>/<model>-<strategy>-<devices>/r<k>/
(rank points: see experiments/points/mpi.py), each recording its mode
(config["point"]["labels"]), and a markdown table OUT/summary.md. Every point is measured
--rounds times, round after round (each round's order rotated), and its step is the median of
its rounds: on this project's VM one configuration measured in two fresh processes minutes
apart differs by up to 1.6x (the MLP's `single`, 5.6 and 3.4 ms in one run of this study):
the machine runs in slow spells of a second or two, longer than a point's timed steps. Simulated devices share the machine's cores:
the table states the cores and threads behind every figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.points import points
from experiments.points import mpi as rank_scaling
from experiments.options import BenchOptions, option
from experiments.points.points import Point
from experiments.studies.scaling.speedup import REFERENCE, device_rows, load_points
from experiments.studies.study import Study, at_least
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES

MODES = ("strong", "weak")


@dataclass(frozen=True)
class ScalingConfig:
    out: str = options.out("scaling")
    models: tuple[str, ...] = option(("mlp", "cnn"), "models, one figure panel per mode each", choices="model")
    width: int | None = options.train_option("width")
    depth: int | None = options.train_option("depth")
    strategies: tuple[str, ...] | None = option(None, "strategies of the device points (default: the data-parallel family); with --ranks they are the single-process baselines", choices="strategy")
    device_counts: tuple[int, ...] = option((1, 2, 4, 8), "simulated device counts (1: single alone, the baseline)")
    ranks: tuple[int, ...] | None = option(None, "MPI process counts, e.g. 1,2: rank points (one thread per rank) beside the device points (default: none)")
    rank_strategies: tuple[str, ...] = option(("mpi-allreduce", "mpi-param-server", "dp-auto"), "strategies of the rank points (any that runs across processes; each on the --models it places, e.g. tensor, pipeline, mpi-pipeline on stack-mlp)", choices="strategy")
    batch_size: int = option(128, "global batch (strong) or per-device/per-rank batch (weak)")
    microbatches: int = options.train_option("microbatches", 8)  # the pipelines' M (bound 2M/(M+1) on 2 stages)
    # the pipelined rank points' schedule: 1F1B holds fewer micro-batches per stage than GPipe
    # for the same bubble (the two measured within run-to-run spread on 2 ranks)
    schedule: str = options.train_option("schedule", "1f1b")
    modes: tuple[str, ...] = option(MODES, "strong (fixed global batch) and/or weak (fixed batch per device or rank)")
    iters: int = options.iters()
    warmup: int = options.warmup()
    rounds: int = option(3, "passes over every point, each in a fresh process, the order rotated each pass; a point's step is the median over them")
    timeout: int = options.timeout()


# A tiny MLP on 1 and 2 devices (or ranks), strong scaling only, a few steps, one round.
QUICK = dataclasses.replace(
    ScalingConfig(), models=("mlp",), width=64, depth=1, strategies=("dp-pmap", "dp-shard-map"),
    device_counts=(1, 2), rank_strategies=("mpi-allreduce",), modes=("strong",), iters=3,
    warmup=1, rounds=1, timeout=120)


def plan(config: ScalingConfig) -> list[Point]:
    """The study's points; checks every option before any work."""
    bad = [m for m in config.modes if m not in MODES]
    if bad:
        raise ConfigError(f"--modes takes {' and/or '.join(MODES)}, got {', '.join(bad)}")
    at_least(config, 1, "batch_size", "device_counts", "iters", "microbatches", "rounds")
    at_least(config, 0, "warmup")
    if config.ranks:
        rank_scaling.check(config.rank_strategies, config.ranks, config.models)
    device = config.strategies or tuple(n for n, c in STRATEGIES.items() if c.family == "data parallel")
    found = [point(config, mode, model, strategy, devices=n) for mode in config.modes
             for model in config.models for n in config.device_counts
             for strategy in ([REFERENCE] if n == 1 else device)]
    for r in config.ranks or ():
        found += [point(config, mode, model, strategy, ranks=r) for mode in config.modes
                  for model in config.models
                  for strategy in ([REFERENCE] if r == 1 else config.rank_strategies)
                  if rank_scaling.takes(strategy, model)]
    return points.in_rounds(found, config.rounds)


def point(config: ScalingConfig, mode: str, model: str, strategy: str, devices: int = 1,
          ranks: int | None = None) -> Point:
    """One bench point. ranks None: one process of `devices` devices, default threads; ranks
    R: R single-threaded processes (under mpiexec when R > 1), one device each."""
    workers = ranks or devices
    train = with_options(TrainConfig(), dataset="synthetic", model=model, width=config.width,
                         depth=config.depth, strategy=strategy, devices=devices,
                         batch_size=config.batch_size * (workers if mode == "weak" else 1),
                         single_thread=ranks is not None,
                         **{k: getattr(config, k) for k in ("microbatches", "schedule")
                            if k in STRATEGIES[strategy].options})
    folder = (f"{mode}/{model}-{strategy}-{devices}" if ranks is None
              else f"ranks/{mode}/{model}-{strategy}-r{ranks}")
    # --no-matmul-peak: speed-ups are ratios of images/s; a peak costs seconds a point.
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return Point(folder, train, bench, ranks, {"mode": mode})


def run(config: ScalingConfig) -> list[Path]:
    """Every point's rounds (resuming a stopped study), then OUT/summary.md; returns the
    rounds' folders."""
    planned = plan(config)
    points.refuse_other_rounds(planned, config.out)
    points.run(planned, config.out, config.timeout)
    out = Path(config.out)
    table = summary(out)
    results.write_atomic(out / "summary.md", table)
    print(table)
    return [out / p.folder for p in planned]


def summary(folder: Path) -> str:
    """Markdown tables of every bench result under `folder`: device points with speed-up over
    1 device, then rank points (if any) with speed-up over 1 rank and over the best 1-process."""
    found = load_points(folder)
    rows = device_rows(found)
    lines = ["| mode | model | strategy | devices | global batch | ms/step | images/s | speed-up | "
             "efficiency | collective B/step (theory) | state B/device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['model']} | {r['strategy']} | {r['devices']} | {r['batch']} | "
                     f"{r['ms']:.1f} | {r['images_per_sec']:,.0f} | {r['speedup']:.2f} | "
                     f"{r['efficiency']:.2f} | {r['comm_bytes']:,} ({r['comm_theory'].get('total', 0):,}) | "
                     f"{r['state_bytes']:,} |")
    if rows:
        env = rows[0]["env"]
        lines.append(f"\n{env['cpu_cores']} CPU cores shared by all simulated devices of a point; "
                     f"threads: {env['threads']}; jax {env['jax']}; {points.rounds_note(max((p['rounds'] for p in found), default=1), 'point')}.")
    ranks = rank_scaling.table(found)
    return "\n".join(lines) + "\n" + (f"\n{ranks}" if ranks else "")


STUDY = Study("scaling", "data-parallel strategies over device counts (or MPI ranks: --ranks), strong "
                         "and weak scaling (one bench process per point and round); writes OUT/summary.md",
              ScalingConfig, QUICK, run)
