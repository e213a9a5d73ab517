"""Scaling study: data-parallel strategies over simulated device counts, strong (fixed global
batch) and weak (fixed per-device batch) — one `bench` process per point, since the device
count must be fixed before JAX starts.

    python -m experiments scaling --out figures/data/scaling            # full: MLP and CNN
    python -m experiments scaling --quick --out /tmp/scaling            # seconds
    python -m experiments scaling --ranks 1,2 --out figures/data/scaling  # MPI ranks instead

Writes one result JSON per point under OUT/<mode>/<model>-<strategy>-<devices>/ (rank points:
see experiments/rank_scaling.py) and a markdown table OUT/summary.md. Simulated devices share
the machine's cores: the table states the cores and threads behind every figure.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments import rank_scaling
from experiments.points import run_point
from jaxpar import results
from experiments.points import pending
from jaxpar.config import ConfigError
from jaxpar.parallel import STRATEGIES
from experiments.speedup import device_rows, load_points

DP_STRATEGIES = tuple(n for n, c in STRATEGIES.items() if c.family == "data parallel")
POINT_TIMEOUT_S = 600  # one bench process (or mpiexec job); a hang must not stall the study
QUICK_TIMEOUT_S = 120


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/scaling", help="output folder (default: results/scaling)")
    p.add_argument("--quick", action="store_true", help="tiny MLP, 1 and 2 devices (or ranks), strong "
                                                        "scaling only, few steps")
    p.add_argument("--models", default="mlp,cnn", help="comma-separated (default: mlp,cnn)")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated (default: {','.join(DP_STRATEGIES)}; with --ranks: "
                        f"{','.join(rank_scaling.MPI_STRATEGIES)})")
    p.add_argument("--device-counts", default="1,2,4,8", help="comma-separated (default: 1,2,4,8)")
    p.add_argument("--ranks", default=None,
                   help="comma-separated MPI process counts, e.g. 1,2: rank scaling (one thread "
                        "per rank) beside its single-process baselines, instead of the device study")
    p.add_argument("--baseline-strategies", default=",".join(rank_scaling.BASELINE_STRATEGIES),
                   help="with --ranks: single-process strategies run on --device-counts devices "
                        "for the best single-process baseline (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="global batch (strong) or per-device/per-rank batch (weak) (default: 128)")
    p.add_argument("--modes", default="strong,weak", help="strong,weak (default: both)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per point (default: 20)")


@dataclass(frozen=True)
class Point:
    """One bench run. ranks None: a device point (one process, default threads); ranks R: R
    single-threaded processes (under mpiexec when R > 1), one device each."""
    mode: str
    model: str
    strategy: str
    devices: int = 1
    ranks: int | None = None

    def folder(self) -> str:
        if self.ranks is None:
            return f"{self.mode}/{self.model}-{self.strategy}-{self.devices}"
        return f"ranks/{self.mode}/{self.model}-{self.strategy}-r{self.ranks}"

    def batch(self, per_worker: int) -> int:
        return per_worker * ((self.ranks or self.devices) if self.mode == "weak" else 1)


def plan(args: argparse.Namespace) -> tuple[list[Point], list[str]]:
    """The study's points and the bench flags they share; checks the flags before any work."""
    models, modes = args.models.split(","), args.modes.split(",")
    counts = _ints("--device-counts", args.device_counts)
    ranks = _ints("--ranks", args.ranks) if args.ranks else None
    default = rank_scaling.MPI_STRATEGIES if ranks else DP_STRATEGIES
    strategies = args.strategies.split(",") if args.strategies else list(default)
    extra: list[str] = []
    if args.quick:
        models, extra = ["mlp"], ["--width", "64", "--depth", "1", "--warmup", "1"]
        args.iters, modes = 3, ["strong"]
        counts, strategies = ([1], strategies[:1]) if ranks else ([1, 2], strategies[:2])
        if ranks:
            ranks = [1, 2]
    baseline = args.baseline_strategies.split(",") if ranks else strategies
    if ranks:
        rank_scaling.check(strategies, ranks)
    points = [Point(mode, model, strategy, n) for mode in modes for model in models
              for n in counts for strategy in (["single"] if n == 1 else baseline)]
    if ranks:
        points += [Point(mode, model, strategy, ranks=r) for mode in modes for model in models
                   for r in ranks for strategy in (["single"] if r == 1 else strategies)]
    return points, extra


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated whole numbers, e.g. 1,2; got {text!r}") from None


def bench_command(point: Point, batch: int, iters: int, extra: list[str]) -> list[str]:
    """The `bench` command line of one point (under mpiexec for a multi-rank point)."""
    bench = [sys.executable, "-m", "experiments", "bench", "--model", point.model,
             "--strategy", point.strategy, "--devices", str(point.devices), "--batch-size",
             str(batch), "--iters", str(iters), "--no-matmul-peak", *extra]
    return bench if point.ranks is None else rank_scaling.command(point.ranks, bench)


def run(args: argparse.Namespace) -> list[Path]:
    points, extra = plan(args)
    out = results.ensure_writable(args.out)
    # Resuming a stopped study: points whose result file is complete are not run again.
    todo = pending(points, lambda p: out / p.folder() / results.RESULT_FILE)
    if len(todo) < len(points):
        print(f"{len(points) - len(todo)} of {len(points)} points already done in {out}; running the rest")
    timeout = QUICK_TIMEOUT_S if args.quick else POINT_TIMEOUT_S
    written = []
    for point in todo:
        batch = point.batch(args.batch_size)
        where = f"devices={point.devices}" if point.ranks is None else f"ranks={point.ranks}"
        print(f"{point.mode:6} {point.model:4} {point.strategy:16} {where} batch={batch}", flush=True)
        run_point([*bench_command(point, batch, args.iters, extra), "--out", str(out / point.folder())],
                  timeout)
        written.append(out / point.folder())
    table = summary(out)
    results.write_atomic(out / "summary.md", table)
    print(table)
    return written


def summary(folder: Path) -> str:
    """Markdown tables of every bench result under `folder`: device points with speed-up over
    1 device, then rank points (if any) with speed-up over 1 rank and over the best 1-process."""
    points = load_points(folder)
    rows = device_rows(points)
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
                     f"threads: {env['threads']}; jax {env['jax']}; one process per point.")
    ranks = rank_scaling.table(points)
    return "\n".join(lines) + "\n" + (f"\n{ranks}" if ranks else "")
