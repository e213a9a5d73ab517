"""One `train` or `bench` run in this process: devices, processes, the run, its result file.
The CLI's `train` and `bench` commands and every study point (`experiments.points.points`) go
through `execute`.

    python -m experiments.points.run OUT/FOLDER     # the study point described by OUT/FOLDER/point.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from experiments.options import BenchOptions
from experiments.points.points import POINT_FILE, Point
from jaxpar import api, results
from jaxpar.api import distributed_mode  # noqa: F401  (the launch checks live with the runs)
from jaxpar.config import TrainConfig


def execute(config: TrainConfig, bench: BenchOptions | None = None, console: Console | None = None,
            record: dict | None = None) -> results.RunResult:
    """Train `config` (bench None) or time its step, through the library's `jaxpar.api.run`
    and `run_bench`; write OUT/result.json on the main process (a run without --out goes to
    results/<model>-<strategy>-<time>; a benchmark without --out writes nothing).

    Args:
      console: where the run prints (None: quietly).
      record: a study point's settings, recorded in the result as config["point"].
    """
    if bench is not None:
        return api.run_bench(config, iters=bench.iters, warmup=bench.warmup,
                             matmul_peak=bench.matmul_peak, timeline=bench.timeline, wire=bench.wire,
                             console=console, record=record)
    out = config.out if config.out is not None else api.default_out(config)
    return api.run(config, out=out, console=console, record=record).result


def main(argv: list[str]) -> None:
    """Run the point in folder argv[0] (written there by `experiments.points.run`)."""
    folder = Path(argv[0])
    point = Point.from_json((folder / POINT_FILE).read_text())
    execute(point.config, point.bench, record=point.settings())


if __name__ == "__main__":
    main(sys.argv[1:])
