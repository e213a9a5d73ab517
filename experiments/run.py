"""One `train` or `bench` run in this process: devices, processes, the run, its result file.
The CLI's `train` and `bench` commands and every study point (`experiments.points`) go
through `execute`.

    python -m experiments.run OUT/FOLDER     # the study point described by OUT/FOLDER/point.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
from rich.console import Console

from experiments.options import BenchOptions
from experiments.points import POINT_FILE, Point
from jaxpar import distributed, results
from jaxpar.bench import benchmark, report
from jaxpar.config import TrainConfig
from jaxpar.distributed import launcher
from jaxpar.errors import ConfigError, Diverged
from jaxpar.mesh import WITHIN_FIRST, describe_layout, simulate_cpu_devices
from jaxpar.parallel import STRATEGIES
from jaxpar.train import train
from jaxpar.validate import validate


def distributed_mode(config: TrainConfig) -> str:
    """mpi4jax strategies join ranks with MPI itself; the rest join them with jax.distributed."""
    cls = STRATEGIES[config.parallel.strategy]
    if cls.uses_mpi:
        return "none"
    mode = config.parallel.distributed
    many = mode in ("mpi", "slurm") or (mode == "auto" and launcher() is not None)
    if many and not cls.multiprocess:
        able = [n for n, c in STRATEGIES.items() if c.multiprocess or c.uses_mpi]
        raise ConfigError(f"--strategy {cls.name} cannot run across processes (not built or tested "
                          f"for one global mesh over ranks); launch one process, or pick one that "
                          f"can: {', '.join(able)}")
    return mode


def execute(config: TrainConfig, bench: BenchOptions | None = None, console: Console | None = None,
            record: dict | None = None) -> results.RunResult:
    """Train `config` (bench None) or time its step; write OUT/result.json on the main process.

    Args:
      console: where the run prints (None: quietly).
      record: a study point's settings, recorded in the result as config["point"].
    """
    out = config.out
    if bench is None and out is None:
        out = f"results/{config.model.model}-{config.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    simulate_cpu_devices(config.parallel.devices)  # before JAX's backend starts
    distributed.setup(distributed_mode(config), config.parallel.single_thread,
                      config.parallel.devices or 1)
    validate(config)  # every option and combination, before any work or write
    created = out is not None and not Path(out).exists()
    if out is not None:
        results.ensure_writable(out)  # fail before the work, not after it
    main = distributed.is_main()  # only rank 0 prints and writes results
    console = console if main else None
    announce_layout(config, console)
    try:
        result = _work(config, bench, console)
    except Diverged as stop:  # its result says where and why; the message comes from the CLI
        if out is not None and main:
            results.save(stop.result, out)
        raise
    except BaseException:
        if created:
            _remove_if_empty(Path(out))  # a failed run leaves no folder behind
        raise
    if record is not None:
        result.config["point"] = record
    if out is not None and main:
        path = results.save(result, out)
        if console is not None:
            console.print(f"wrote {path}")
    return result


def announce_layout(config: TrainConfig, console: Console | None) -> None:
    """On a global mesh over processes, say which axes sit within a process, which across."""
    if console is None or jax.process_count() == 1:
        return
    axes = STRATEGIES[config.parallel.strategy](config).mesh_layout(jax.devices())
    how = ("as --mesh orders them" if config.parallel.mesh else
           f"by default {' then '.join(WITHIN_FIRST[:-1])} within a process")
    console.print(f"{describe_layout(axes, jax.process_count(), jax.local_device_count())} "
                  f"({how}; --mesh lists axes outermost first, the last within a process)")


def _work(config: TrainConfig, bench: BenchOptions | None, console: Console | None):
    """Train (bench None), or time the step and print its report."""
    if bench is None:
        return train(config, console=console)
    result = benchmark(config, iters=bench.iters, warmup=bench.warmup, matmul_peak=bench.matmul_peak)
    if console is not None:
        console.print(report(result))
    return result


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (a checkpoint, a partial result of the run): leave it


def main(argv: list[str]) -> None:
    """Run the point in folder argv[0] (written there by `experiments.points.run`)."""
    folder = Path(argv[0])
    point = Point.from_json((folder / POINT_FILE).read_text())
    execute(point.config, point.bench, record=point.settings())


if __name__ == "__main__":
    main(sys.argv[1:])
