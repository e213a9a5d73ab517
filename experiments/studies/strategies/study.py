"""Strategies study: one model under every strategy at the same device count — step time,
images/s, compile time, collective bytes per step (measured, and theory where the strategy
states one), parameter + optimizer state and temporary (activation) memory per device.

    python -m experiments strategies --out figures/data/strategies     # full: minutes
    python -m experiments strategies --quick --out /tmp/strategies     # 3 strategies, seconds

One `bench` point per strategy (`experiments.points.points`: a stopped study resumes, complete points
are not run again), measured --rounds times, round after round, each round's order rotated
(`points.in_rounds`), so a slow spell of a shared machine falls on different strategies each
round; a row is the strategy's median round (`points.median_round`). Every single-process
strategy runs on --devices simulated devices with its default mesh over all of them
(`mesh_for`), the MPI strategies as --devices single-threaded ranks when mpi4jax is installed
(else recorded as skipped, with why), beside them `single` on one thread, as each rank runs
(`one_thread_point`). Without --strategies, a strategy that cannot place
--model (its class says so) is recorded as skipped too; the seeds' comparison is `--model
cnn` (or resnet): data- against model-parallel rows. Writes OUT/points/<strategy>/r<k>/
result.json, OUT/strategies.json (RunResult: config, env, metrics.rows;
`figures.strategies_bars` draws it) and OUT/summary.md (`tables.strategies_summary`), atomically.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import BenchOptions, option
from experiments.points import points
from experiments.points.mpi import mpiexec
from experiments.points.points import Point, PointError
from experiments.studies.strategies.tables import strategies_summary
from experiments.studies.study import Study, at_least
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.mesh import format_mesh
from jaxpar.models import takes
from jaxpar.parallel import STRATEGIES
from jaxpar.runtime.distributed import INSTALL_HINT


@dataclass(frozen=True)
class StrategiesConfig:
    out: str = options.out("strategies")
    # stack-mlp: every strategy takes it (hybrid needs its identical blocks); --model cnn skips hybrid.
    model: str = options.train_option("model", "stack-mlp")
    # width and depth go to the models that take them (not cnn; resnet: depth)
    width: int | None = options.train_option("width", 256)
    depth: int | None = options.train_option("depth", 8)
    devices: int = option(4, "devices every strategy uses (MPI strategies: that many ranks)")
    batch_size: int = options.train_option("batch_size")
    microbatches: int = options.train_option("microbatches", 8)
    strategies: tuple[str, ...] | None = option(None, "strategies to measure (default: every strategy)", choices="strategy")
    iters: int = options.iters()
    warmup: int = options.warmup()
    rounds: int = option(3, "passes over every strategy, each in a fresh process, the order rotated each pass; a row is the strategy's median round")
    timeout: int = options.timeout()


# Enough to check the study's properties (no communication for single; fsdp keeps 1/N of
# dp-auto's state; explicit collectives equal theory), one process of seconds each.
QUICK = dataclasses.replace(StrategiesConfig(), width=32, depth=4, iters=3, warmup=1, rounds=1, timeout=120,
                            strategies=("single", "dp-auto", "fsdp"))


def mesh_for(strategy: str, devices: int) -> str:
    """The --mesh a single-process strategy takes on `devices` devices: its own default
    (`Strategy.default_mesh`), written out so the point's config says it ('' for one device)."""
    axes = STRATEGIES[strategy].default_mesh(devices)
    return "" if math.prod(axes.values()) == 1 else format_mesh(axes)


def _is_mpi(strategy: str) -> bool:
    return STRATEGIES[strategy].uses_mpi


def _mpi_missing() -> str | None:
    """Why the MPI strategies cannot run here, or None when they can."""
    if importlib.util.find_spec("mpi4jax") is None:
        return f"mpi4jax is not installed in this venv; {INSTALL_HINT}"
    if not mpiexec().exists():
        return f"{mpiexec()} is missing; {INSTALL_HINT}"
    return None


def chosen_strategies(config: StrategiesConfig) -> tuple[list[str], dict[str, str]]:
    """(strategies to run, {strategy: why} of those skipped); checks every option first."""
    names = list(config.strategies or STRATEGIES)  # by family, as the registry lists them
    unable = {}
    if config.strategies is None:  # every strategy that can place the model
        for name in names:
            try:
                STRATEGIES[name].check_model(config.model)
            except ConfigError as e:
                unable[name] = str(e)
        names = [n for n in names if n not in unable]
    at_least(config, 1, "devices", "batch_size", "iters", "microbatches", "width", "depth", "rounds")
    at_least(config, 0, "warmup")
    bad = [problem for s in names for problem in _problems(s, config)]
    if config.batch_size % config.devices:
        bad.append(f"--batch-size {config.batch_size} must be a multiple of --devices {config.devices}")
    if bad:
        raise ConfigError("; ".join(bad) + " (or leave those strategies out with --strategies)")
    mpi = [s for s in names if _is_mpi(s)]
    why = None
    if mpi:
        why = _mpi_missing() or ("MPI strategies need --devices >= 2 ranks" if config.devices < 2 else None)
    skipped = {**unable, **({s: why for s in mpi} if why else {})}
    return [s for s in names if s not in skipped], skipped


def _problems(strategy: str, config: StrategiesConfig) -> list[str]:
    """What stops `strategy`'s point from running (`jaxpar.validate`, through the strategy's
    own checks: models it takes, mesh, blocks per stage, width per shard, micro-batches)."""
    try:
        points.check_point(strategy_point(strategy, config))
    except ConfigError as e:
        return [str(e).replace(" Nothing was run or written.", "")]
    return []


def strategy_point(strategy: str, config: StrategiesConfig) -> Point:
    """One strategy's bench point (an MPI strategy: --devices ranks of one device each)."""
    mpi = _is_mpi(strategy)
    sizes = {k: getattr(config, k) for k in ("width", "depth") if k in takes(config.model)}
    train = with_options(
        TrainConfig(), dataset="synthetic", model=config.model, **sizes,
        strategy=strategy, devices=1 if mpi else config.devices,
        mesh="" if mpi else mesh_for(strategy, config.devices), batch_size=config.batch_size,
        single_thread=mpi,
        **({"microbatches": config.microbatches} if "microbatches" in STRATEGIES[strategy].options else {}))
    # --no-matmul-peak: strategies are compared with one another; a peak costs seconds a point.
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return Point(f"points/{strategy}", train, bench, config.devices if mpi else None)


def one_thread_point(config: StrategiesConfig) -> Point:
    """The MPI rows' reference: `single` in one process of one thread, as each rank runs (the
    cost check's anchor for them, measured in the same rounds)."""
    sizes = {k: getattr(config, k) for k in ("width", "depth") if k in takes(config.model)}
    train = with_options(TrainConfig(), dataset="synthetic", model=config.model, **sizes,
                         strategy="single", devices=1, batch_size=config.batch_size, single_thread=True)
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return Point("points/single-1-thread", train, bench)


def strategy_row(strategy: str, measured: list[results.RunResult]) -> dict:
    """One table row from a strategy's rounds: its median round's bench result."""
    result = points.median_round(measured)
    m, env, desc = result.metrics, result.env, result.strategy
    theory = m.get("collective_bytes_theory") or {}
    mem = m["memory_per_device"]
    processes = env.get("mpi_ranks", 1)
    return {
        "strategy": strategy,
        "family": STRATEGIES[strategy].family,
        "mesh": {"ranks": processes} if _is_mpi(strategy) else desc.get("mesh", {}),
        "devices_used": desc.get("devices", 1),
        "processes": processes,
        "threads_per_process": env.get("threads_per_process"),
        "microbatches": desc.get("microbatches"),
        "ms_per_step": m["step_time_ms_median"],
        "ms_per_step_min": m["step_time_ms_min"],
        "ms_per_step_rounds": [r.metrics["step_time_ms_median"] for r in measured],
        "images_per_sec": m["images_per_sec"],
        "compile_s": m["compile_s"],
        "collective_bytes_per_step": m["collective_bytes_per_step"],
        "collective_bytes_theory": theory.get("total"),
        "collective_bytes_by_op": m.get("collective_bytes_by_op", {}),
        "state_bytes_per_device": m["state_bytes_per_device"],
        "temp_bytes_per_device": mem["temp_bytes"],
        # what the step holds besides its state: XLA's temporaries (layer-split: the residuals
        # its stage programs hand from forward to backward, see LayerSplit.accounting)
        "activation_bytes_per_device": m.get("activation_bytes_per_device", mem["temp_bytes"]),
        "argument_bytes_per_device": mem["argument_bytes"],
        "bubble_fraction": m.get("bubble_fraction"),
    }


def run(config: StrategiesConfig) -> list[Path] | None:
    """Every strategy's point, then OUT/strategies.json and OUT/summary.md (atomically).
    Returns their paths, or None when a point failed (the others are still written)."""
    names, skipped = chosen_strategies(config)
    planned = [strategy_point(s, config) for s in names]
    reference = [one_thread_point(config)] if any(_is_mpi(s) for s in names) else []
    outcomes = points.run_rounds(planned + reference, config.rounds, config.out, config.timeout,
                                 keep_going=True)
    rows, failed, env, one_thread = [], {}, None, None
    labelled = [*zip(names, planned), *(("single, 1 thread", p) for p in reference)]
    for label, planned_point in labelled:
        measured = outcomes[planned_point.folder]
        errors = [r for r in measured if isinstance(r, PointError)]
        if errors:
            failed[label] = str(errors[0])[-2000:]
        elif planned_point in reference:
            one_thread = {**strategy_row("single", measured), "point": planned_point.folder}
        else:
            rows.append(strategy_row(label, measured))
            if not _is_mpi(label) and env is None:
                env = measured[0].env  # the machine as the single-process points see it
    asked = list(config.strategies or STRATEGIES)
    record = {**dataclasses.asdict(config), "strategies": asked,
              "meshes": {s: "" if _is_mpi(s) else mesh_for(s, config.devices) for s in asked}}
    study = results.RunResult(kind="strategies", config=record, env=env or results.environment(),
                              metrics={"rows": rows, "skipped": skipped, "failed": failed,
                                       "one_thread": one_thread})
    out = Path(config.out)
    paths = [results.write_atomic(out / "strategies.json", study.to_json() + "\n"),
             results.write_summary(out / "summary.md", strategies_summary(dataclasses.asdict(study)))]
    print(paths[1].read_text())
    return None if failed else paths


STUDY = Study("strategies", "one model under every strategy on the same devices: step time, images/s, "
                            "collective bytes, state and temp memory per device (one bench process "
                            "per strategy and round); writes OUT/strategies.json and OUT/summary.md",
              StrategiesConfig, QUICK, run)
