"""Pipeline study: bubble fraction, throughput and activation memory vs micro-batch count M for
S stages, GPipe vs 1F1B.

The bubble and the peak micro-batches in flight come from the schedule tables
(jaxpar.parallel.schedules), with GPipe's (S-1)/(M+S-1) beside them. Throughput (images/s,
median step) and temporary memory per device (XLA's memory analysis of the compiled step:
activations and the buffers around them) are measured with one `bench` process per
(schedule, M): the `pipeline` strategy on S simulated CPU devices, mesh stage=S.

    python -m experiments pipeline --out figures/data/pipeline       # full: S=4, M=1..32, minutes
    python -m experiments pipeline --quick --out /tmp/pipe           # S=2, M=1..4, tiny model
    python -m experiments pipeline --no-measure --out /tmp/pipe      # schedule tables only

Writes OUT/pipeline.json (RunResult, kind 'pipeline') and one bench result per measured point
under OUT/points/<schedule>-M<m>/; a stopped study resumes from the points already there.
Simulated devices share the machine's cores, so the measured throughput shows the bubble
only as far as idle stages free cores for busy ones: the figure states the cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.points import bench_point, reusable
from jaxpar import results
from jaxpar.config import ConfigError
from jaxpar.parallel import schedules

SCHEDULES = ("gpipe", "1f1b")
PICTURE_MAX_M = 8  # the schedule picture uses the largest M up to this (readable blocks)
POINT_TIMEOUT_S = 600
QUICK = {"stages": 2, "max_microbatches": 4, "width": 32, "depth": 2, "batch_size": 64,
         "iters": 3, "warmup": 1}
QUICK_TIMEOUT_S = 120


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/pipeline", help="output folder (default: results/pipeline)")
    p.add_argument("--quick", action="store_true",
                   help="S=2, M up to 4, stack-mlp width 32 depth 2, batch 64, 3 timed steps; "
                        "throughput measured at the largest M only")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages S = simulated devices (default: 4)")
    p.add_argument("--max-microbatches", type=int, default=32, help="largest M, powers of two (default: 32)")
    p.add_argument("--width", type=int, default=256, help="stack-mlp width (default: 256)")
    p.add_argument("--depth", type=int, default=8, help="stack-mlp blocks, a multiple of S (default: 8)")
    p.add_argument("--batch-size", type=int, default=512, help="global batch, cut into M micro-batches (default: 512)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per point (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per point (default: 2)")
    p.add_argument("--measure", default=True, action=argparse.BooleanOptionalAction,
                   help="time each (schedule, M) in a bench process (default: on; --no-measure: "
                        "schedule tables only, seconds)")


def plan(args: argparse.Namespace) -> tuple[dict, list[int], list[int]]:
    """(settings, every M, the M's to measure); checks the options before any work."""
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    cfg = {k: getattr(args, k) for k in ("stages", "max_microbatches", "width", "depth",
                                          "batch_size", "iters", "warmup", "measure", "quick")}
    S, top = args.stages, args.max_microbatches
    if S < 2:
        raise ConfigError(f"--stages must be >= 2 for a pipeline, got {S}")
    if top < 1:
        raise ConfigError(f"--max-microbatches must be >= 1, got {top}")
    counts = [2 ** i for i in range(top.bit_length()) if 2 ** i <= top]
    if args.measure:
        if args.depth % S:
            raise ConfigError(f"--depth {args.depth} blocks do not divide into --stages {S}; "
                              f"make --depth a multiple of {S}")
        if args.batch_size % counts[-1]:
            raise ConfigError(f"--batch-size {args.batch_size} must be a multiple of the largest "
                              f"M = {counts[-1]} (each micro-batch gets batch/M rows)")
        if args.iters < 1 or args.warmup < 0:
            raise ConfigError("--iters must be >= 1 and --warmup >= 0")
    measured = [] if not args.measure else counts[-1:] if args.quick else counts
    return cfg, counts, measured


def schedule_rows(stages: int, microbatch_counts: list[int]) -> tuple[list[dict], dict]:
    """Bubble and peak in-flight micro-batches per schedule and M, from the tables.

    Returns:
        (rows [{schedule, M, bubble, theory, peak_in_flight}],
         {schedule: {"M", "table"}} for the largest M <= PICTURE_MAX_M)
    """
    rows, tables = [], {}
    for name in SCHEDULES:
        for m in microbatch_counts:
            table = schedules.schedule(name, stages, m)
            rows.append({"schedule": name, "M": m, "bubble": schedules.bubble_fraction(table),
                         "theory": schedules.bubble_theory(stages, m),
                         "peak_in_flight": max(schedules.peak_in_flight(table))})
        m_pic = max(m for m in microbatch_counts if m <= PICTURE_MAX_M)
        tables[name] = {"M": m_pic, "table": schedules.schedule(name, stages, m_pic)}
    return rows, tables


def bench_flags(cfg: dict, schedule: str, m: int) -> list[str]:
    """The `bench` flags of one point: pipeline strategy on S simulated devices."""
    S = cfg["stages"]
    # --no-matmul-peak: the study does not use it, and it costs seconds a point.
    return ["--no-matmul-peak", "--model", "stack-mlp", "--width", str(cfg["width"]), "--depth", str(cfg["depth"]),
            "--strategy", "pipeline", "--devices", str(S), "--mesh", f"stage={S}",
            "--microbatches", str(m), "--schedule", schedule, "--batch-size", str(cfg["batch_size"]),
            "--iters", str(cfg["iters"]), "--warmup", str(cfg["warmup"])]


def measure(out: Path, cfg: dict, schedule: str, m: int) -> dict:
    """Throughput and memory of one (schedule, M) from its bench process (reused if done)."""
    folder = out / "points" / f"{schedule}-M{m}"
    point = bench_point(folder, bench_flags(cfg, schedule, m),
                        QUICK_TIMEOUT_S if cfg["quick"] else POINT_TIMEOUT_S)
    pm = point["metrics"]
    return {"images_per_sec": pm["images_per_sec"], "step_ms": pm["step_time_ms_median"],
            "temp_bytes": pm["memory_per_device"]["temp_bytes"],
            "state_bytes": pm["state_bytes_per_device"], "compile_s": pm["compile_s"],
            "collective_bytes": pm["collective_bytes_per_step"], "point": f"points/{folder.name}",
            "env": point["env"]}


def run(args: argparse.Namespace) -> list[Path]:
    """Tables for every M, measured points, OUT/pipeline.json; return its path."""
    cfg, counts, measured = plan(args)
    out = results.ensure_writable(args.out)  # fail before the work, not after it
    for schedule in SCHEDULES:  # points of other settings are refused before any work
        for m in measured:
            reusable(out / "points" / f"{schedule}-M{m}", bench_flags(cfg, schedule, m))
    rows, tables = schedule_rows(cfg["stages"], counts)
    point_env = None
    for r in rows:
        r.update(images_per_sec=None, step_ms=None, temp_bytes=None)
        if r["M"] in measured:
            print(f"measuring {r['schedule']} M={r['M']} ...", flush=True)
            got = measure(out, cfg, r["schedule"], r["M"])
            point_env = got.pop("env")
            r.update(got)
        tput = f"{r['images_per_sec']:8,.0f} img/s {r['step_ms']:7.1f} ms temp {r['temp_bytes'] / 2**20:6.2f} MiB" \
            if r["images_per_sec"] else "not measured"
        print(f"{r['schedule']:6s} S={cfg['stages']} M={r['M']:3d} bubble={r['bubble']:.3f} "
              f"theory={r['theory']:.3f} peak_in_flight={r['peak_in_flight']:3d}  {tput}", flush=True)
    config = {**cfg, "model": "stack-mlp", "strategy": "pipeline", "microbatch_counts": counts,
              "measured_microbatch_counts": measured}
    result = results.RunResult(kind="pipeline", config=config, env=results.environment(),
                               metrics={"stages": cfg["stages"], "rows": rows, "tables": tables,
                                        "point_env": point_env})
    path = results.write_atomic(out / "pipeline.json", result.to_json() + "\n")
    print(f"wrote {path}")
    return [path]
