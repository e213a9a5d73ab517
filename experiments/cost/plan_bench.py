"""`plan --bench-top N --out DIR`: `plan`'s first N configurations measured, round after round,
so that what it names can be held against what then runs fastest on this machine.

Each configuration is one `bench` point (`experiments.points`): simulated devices in one process,
or R single-threaded processes (MPI ranks, or jax.distributed processes under mpiexec); every
round runs each configuration once, the order rotated round by round, so a slow spell of a
shared machine falls on each in turn. DIR/plan.json holds the question, the configurations
with their predictions and intervals as `plan` printed them, and the load average around the
rounds; DIR/<configuration>/r<k>/result.json each round's result (`report` reads them).

    python -m experiments plan --model cnn --devices 2 --bench-top 2 --rounds 5 \\
        --out figures/data/cost/plan/cnn-2
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

from experiments.options import BenchOptions
from experiments.points import points
from experiments.points.points import Point
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.parallel import STRATEGIES

PLAN_FILE = "plan.json"
BENCH_ITERS, BENCH_WARMUP = 20, 3     # as the studies time a step
POINT_TIMEOUT_S = 600


def folder_of(row: dict) -> str:
    """A configuration's folder name: strategy, mesh, micro-batches and schedule."""
    parts = [row["strategy"], *([] if row["mesh"] == "default" else [row["mesh"]])]
    parts += [f"M{row['microbatches']}"] if "microbatches" in row else []
    parts += [row["schedule"]] if row.get("schedule") else []
    return re.sub(r"[^\w.-]+", "-", "-".join(parts))


def bench_point(row: dict, model: dict, devices: int, batch: int, processes: bool) -> Point:
    """One configuration of `plan` as a bench point: MPI strategies and, with `processes`,
    every other but `single` as `devices` single-threaded processes of one device each."""
    cls = STRATEGIES[row["strategy"]]
    ranks = cls.uses_mpi or (processes and row["strategy"] != "single")
    takes = {k: row[k] for k in ("microbatches", "schedule") if k in cls.options and row.get(k)}
    train = with_options(TrainConfig(), dataset="synthetic", **{k: v for k, v in model.items() if v},
                         strategy=row["strategy"], batch_size=batch,
                         devices=1 if ranks or not (cls.axes or cls.uses_mpi) else devices,
                         mesh="" if ranks or row["mesh"] == "default" else row["mesh"],
                         single_thread=ranks, **takes)
    bench = BenchOptions(iters=BENCH_ITERS, warmup=BENCH_WARMUP, matmul_peak=False)
    return Point(folder_of(row), train, bench, devices if ranks else None, {"plan": folder_of(row)})


def bench_top(shown: list[dict], question: dict, rounds: int, out: str | Path) -> list[dict]:
    """The first configurations of `shown` (`plan`'s printed rows, fastest first, those that
    fit) measured in `rounds` rotated rounds under `out`; each with its measured median step."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = {k: question[k] for k in ("model", "depth", "width")}
    planned = [bench_point(r, model, question["devices"], question["batch"], question["processes"]) for r in shown]
    load_before = os.getloadavg()[0]
    measured = points.run_rounds(planned, rounds, out, timeout=POINT_TIMEOUT_S)
    found = []
    for r, p in zip(shown, planned):
        steps = [m.metrics["step_time_ms_median"] for m in measured[p.folder]]
        lo, hi = r["interval"] if r.get("interval") else (None, None)
        found.append({"folder": p.folder, "strategy": r["strategy"], "mesh": r["mesh"],
                      "microbatches": r.get("microbatches"), "schedule": r.get("schedule"),
                      "predicted_ms": 1000 * r["prediction"].total_s, "interval_ms": [lo, hi], "tie": r["tie"],
                      "rounds_ms": steps, "measured_ms": statistics.median(steps)})
    record = {"question": question, "rounds": rounds, "configurations": found,
              "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
              "cores": os.cpu_count()}
    results.write_atomic(out / PLAN_FILE, json.dumps(record, indent=2) + "\n")
    return found


def bench_records(data_dir: Path) -> list[dict]:
    """Every committed `plan --bench-top` run under DATA/cost/plan/*/plan.json."""
    return [json.loads(p.read_text()) | {"name": p.parent.name}
            for p in sorted(Path(data_dir).glob(f"cost/plan/*/{PLAN_FILE}"))]
