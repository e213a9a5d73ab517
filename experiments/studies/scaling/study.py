"""Scaling study: data-parallel strategies over simulated device counts, strong (fixed global
batch) and weak (fixed per-device batch) — one `bench` process per point, since the device
count must be fixed before JAX starts — and, with --ranks, MPI ranks beside them.

    python -m experiments scaling --out figures/data/scaling            # full: MLP and CNN
    python -m experiments scaling --quick --out /tmp/scaling            # seconds
    python -m experiments scaling --ranks 1,2 --out figures/data/scaling  # MPI ranks beside
    python -m experiments scaling --ranks 1,2,4 --models stack-mlp --depth 4 \
        --rank-strategies tensor,pipeline,hybrid,layer-split,mpi-pipeline --out /tmp/ranks-mp

Writes one bench result per point and round under OUT/<mode>/<model>-<strategy>-<devices>/r<k>/,
each recording its mode (config["point"]["labels"]), and a markdown table OUT/summary.md
(`tables.scaling_summary`). Every point is measured --rounds times, round after round (each
round's order rotated), and its step is the median of its rounds: on this project's VM one
configuration measured in two fresh processes minutes apart differs by up to 1.6x (the MLP's
`single`, 5.6 and 3.4 ms in one run of this study): the machine runs in slow spells of a second
or two, longer than a point's timed steps. Simulated devices share the machine's cores: the
table states the cores and threads behind every figure.

Rank points (--ranks): R processes under `mpiexec` (this venv's own), one pinned thread each
(`single_thread`), one simulated device per process. Data-parallel strategies (mpi4jax or
jax.distributed) and model-parallel ones (tensor, pipeline, hybrid, layer-split on one
jax.distributed mesh over the ranks; mpi-pipeline, a stage per rank) alike, each on the models
it places; more ranks than cores are run all the same, reported as oversubscribed. Their
baselines, in the same results folder: 1 single-threaded rank (`single`, no launcher) and the
best single-process configuration (the device points). Rank points go to
OUT/ranks/<mode>/<model>-<strategy>-r<R>/, device points to OUT/<mode>/..., so either run
reuses the other's. Speed-ups and efficiencies: `speedup.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import BenchOptions, option
from experiments.points import points
from experiments.points.mpi import check_ranks, places_model
from experiments.points.points import Point
from experiments.studies.scaling.speedup import REFERENCE
from experiments.studies.scaling.tables import scaling_summary
from experiments.studies.study import Study, at_least
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES

SCALING_MODES = ("strong", "weak")


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
    modes: tuple[str, ...] = option(SCALING_MODES, "strong (fixed global batch) and/or weak (fixed batch per device or rank)")
    iters: int = options.iters()
    warmup: int = options.warmup()
    rounds: int = option(3, "passes over every point, each in a fresh process, the order rotated each pass; a point's step is the median over them")
    timeout: int = options.timeout()


# A tiny MLP on 1 and 2 devices (or ranks), strong scaling only, a few steps, one round.
QUICK = dataclasses.replace(
    ScalingConfig(), models=("mlp",), width=64, depth=1, strategies=("dp-pmap", "dp-shard-map"),
    device_counts=(1, 2), rank_strategies=("mpi-allreduce",), modes=("strong",), iters=3,
    warmup=1, rounds=1, timeout=120)


def scaling_points(config: ScalingConfig) -> list[Point]:
    """The study's points; checks every option before any work."""
    bad = [m for m in config.modes if m not in SCALING_MODES]
    if bad:
        raise ConfigError(f"--modes takes {' and/or '.join(SCALING_MODES)}, got {', '.join(bad)}")
    at_least(config, 1, "batch_size", "device_counts", "iters", "microbatches", "rounds")
    at_least(config, 0, "warmup")
    if config.ranks:
        check_ranks(config.rank_strategies, config.ranks, config.models)
    device = config.strategies or tuple(n for n, c in STRATEGIES.items() if c.family == "data parallel")
    found = [scaling_point(config, mode, model, strategy, devices=n) for mode in config.modes
             for model in config.models for n in config.device_counts
             for strategy in ([REFERENCE] if n == 1 else device)]
    for r in config.ranks or ():
        found += [scaling_point(config, mode, model, strategy, ranks=r) for mode in config.modes
                  for model in config.models
                  for strategy in ([REFERENCE] if r == 1 else config.rank_strategies)
                  if places_model(strategy, model)]
    return points.in_rounds(found, config.rounds)


def scaling_point(config: ScalingConfig, mode: str, model: str, strategy: str, devices: int = 1,
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
    planned = scaling_points(config)
    points.refuse_other_rounds(planned, config.out)
    points.run_points(planned, config.out, config.timeout)
    out = Path(config.out)
    table = scaling_summary(out)
    results.write_summary(out / "summary.md", table)
    print(table)
    return [out / p.folder for p in planned]


STUDY = Study("scaling", "data-parallel strategies over device counts (or MPI ranks: --ranks), strong "
                         "and weak scaling (one bench process per point and round); writes OUT/summary.md",
              ScalingConfig, QUICK, run)
