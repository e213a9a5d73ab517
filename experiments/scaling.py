"""Scaling study: data-parallel strategies over simulated device counts, strong (fixed global
batch) and weak (fixed per-device batch) — one `bench` process per point, since the device
count must be fixed before JAX starts.

    python -m experiments scaling --out figures/data/scaling            # full: MLP and CNN
    python -m experiments scaling --quick --out /tmp/scaling            # seconds

Writes one result JSON per point under OUT/<mode>/<model>-<strategy>-<devices>/ and a
markdown table OUT/summary.md. Simulated devices share the machine's cores: the table states
the cores and threads behind every figure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from jaxpar import results
from jaxpar.checkpoint import pending

DP_STRATEGIES = ("dp-pmap", "dp-shard-map", "dp-auto", "fsdp", "local-sgd")
POINT_TIMEOUT_S = 600  # one bench process; a hang must not stall the study


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/scaling", help="output folder (default: results/scaling)")
    p.add_argument("--quick", action="store_true", help="tiny MLP, 1 and 2 devices, strong scaling only, few steps")
    p.add_argument("--models", default="mlp,cnn", help="comma-separated (default: mlp,cnn)")
    p.add_argument("--strategies", default=",".join(DP_STRATEGIES), help="comma-separated DP strategies")
    p.add_argument("--device-counts", default="1,2,4,8", help="comma-separated (default: 1,2,4,8)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="global batch (strong) or per-device batch (weak) (default: 128)")
    p.add_argument("--modes", default="strong,weak", help="strong,weak (default: both)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per point (default: 20)")


def bench_point(out: Path, model: str, strategy: str, devices: int, batch: int, iters: int,
                extra: list[str]) -> Path:
    """Run one `bench` process; returns its result folder (raises with its stderr on failure)."""
    cmd = [sys.executable, "-m", "experiments", "bench", "--model", model, "--strategy", strategy,
           "--devices", str(devices), "--batch-size", str(batch), "--iters", str(iters),
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=POINT_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return out


def run(args: argparse.Namespace) -> list[Path]:
    out = results.ensure_writable(args.out)
    models = args.models.split(",")
    strategies = args.strategies.split(",")
    counts = [int(c) for c in args.device_counts.split(",")]
    extra: list[str] = []
    if args.quick:
        models, counts, extra = ["mlp"], [1, 2], ["--width", "64", "--depth", "1", "--warmup", "1"]
        strategies, args.iters, args.modes = strategies[:2], 3, "strong"
    points = [(mode, model, n, strategy) for mode in args.modes.split(",") for model in models
              for n in counts for strategy in (["single"] if n == 1 else strategies)]
    folder = lambda p: out / p[0] / f"{p[1]}-{p[3]}-{p[2]}"  # noqa: E731
    # Resuming a stopped study: points whose result file is complete are not run again.
    todo = pending(points, lambda p: folder(p) / results.RESULT_FILE)
    if len(todo) < len(points):
        print(f"{len(points) - len(todo)} of {len(points)} points already done in {out}; running the rest")
    written = []
    for point in todo:
        mode, model, n, strategy = point
        batch = args.batch_size * (n if mode == "weak" else 1)
        print(f"{mode:6} {model:4} {strategy:13} devices={n} batch={batch}", flush=True)
        written.append(bench_point(folder(point), model, strategy, n, batch, args.iters, extra))
    table = summary(out)
    results.write_atomic(out / "summary.md", table)
    print(table)
    return written


def summary(folder: Path) -> str:
    """A markdown table of every bench result under `folder`, with speed-up over 1 device."""
    rows = [results.load(p) for p in sorted(Path(folder).rglob(results.RESULT_FILE))]
    base = {}
    for r in rows:
        if r.env["device_count"] == 1 and r.strategy.get("strategy") == "single":
            base[(_mode(r, rows), r.config["model"]["model"])] = r.metrics["images_per_sec"]
    lines = ["| mode | model | strategy | devices | global batch | ms/step | images/s | speed-up | "
             "efficiency | collective B/step (theory) | state B/device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (_mode(r, rows), r.config["model"]["model"],
                                         r.strategy.get("strategy") != "single",
                                         r.strategy.get("strategy"), r.env["device_count"])):
        m, n = r.metrics, r.env["device_count"]
        b = base.get((_mode(r, rows), r.config["model"]["model"]))
        speed = m["images_per_sec"] / b if b else float("nan")
        theory = m.get("collective_bytes_theory", {}).get("total", 0)
        lines.append(f"| {_mode(r, rows)} | {r.config['model']['model']} | {r.strategy.get('strategy')} | "
                     f"{n} | {r.config['data']['batch_size']} | {m['step_time_ms_median']:.1f} | "
                     f"{m['images_per_sec']:,.0f} | {speed:.2f} | {speed / n:.2f} | "
                     f"{m['collective_bytes_per_step']:,} ({theory:,}) | {m['state_bytes_per_device']:,} |")
    if rows:
        env = rows[0].env
        lines.append(f"\n{env['cpu_cores']} CPU cores shared by all simulated devices of a point; "
                     f"threads: {env['threads']}; jax {env['jax']}; one process per point.")
    return "\n".join(lines) + "\n"


def _mode(result, rows) -> str:
    return "weak" if "/weak/" in str(result.config.get("out") or "") else "strong"
