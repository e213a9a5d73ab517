"""Pipeline study: bubble fraction and activation memory vs micro-batch count M for S stages,
GPipe vs 1F1B, from the schedule tables (jaxpar.parallel.schedules), with the (S-1)/(M+S-1)
theory beside them, plus a GPipe-paper-style schedule picture.

    python -m experiments pipeline --quick --out /tmp/pipe

Throughput vs M (timed pipeline runs) is not measured here yet: results mark it missing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpar.parallel import schedules


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/pipeline", help="output folder (default: results/pipeline)")
    p.add_argument("--quick", action="store_true", help="S=4, M up to 8")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages S (default: 4)")
    p.add_argument("--max-microbatches", type=int, default=32, help="largest M, powers of two (default: 32)")


def study(stages: int, microbatch_counts: list[int]) -> dict:
    """Bubble and peak in-flight micro-batches per schedule and M, from the tables.

    Returns:
        {"stages", "rows": [{schedule, M, bubble, theory, peak_in_flight, throughput: None}],
         "tables": {schedule: table for the largest M <= 8}}
    """
    rows, tables = [], {}
    for name in ("gpipe", "1f1b"):
        for m in microbatch_counts:
            table = schedules.schedule(name, stages, m)
            rows.append({"schedule": name, "M": m, "bubble": schedules.bubble_fraction(table),
                         "theory": schedules.bubble_theory(stages, m),
                         "peak_in_flight": max(schedules.peak_in_flight(table)),
                         "throughput": None})  # missing: timed runs not wired in yet
        m_pic = max(m for m in microbatch_counts if m <= 8)
        tables[name] = {"M": m_pic, "table": schedules.schedule(name, stages, m_pic)}
    return {"stages": stages, "rows": rows, "tables": tables}


def run(args: argparse.Namespace) -> list[Path]:
    """Write OUT/pipeline.json (and figures if matplotlib is there); return the paths."""
    stages = 4 if args.quick else args.stages
    top = 8 if args.quick else args.max_microbatches
    counts = [2 ** i for i in range(top.bit_length()) if 2 ** i <= top]
    data = study(stages, counts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pipeline.json"
    path.write_text(json.dumps(data, indent=1))
    for r in data["rows"]:
        print(f"{r['schedule']:6s} S={stages} M={r['M']:3d} bubble={r['bubble']:.3f} "
              f"theory={r['theory']:.3f} peak_in_flight={r['peak_in_flight']}")
    return [path]
