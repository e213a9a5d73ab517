"""Bounds study: each model-parallel strategy's step against `single`'s, measured in one run.

DESIGN's invariant 7: a strategy far from its bound is a defect, not a finding. On simulated
CPU devices that share the machine's cores, a strategy's bound is `single`'s step (the
devices add no cores), plus what its schedule idles and what it moves; the limits below are
the ones the project holds its model-parallel strategies to (issue #23): on 2 devices
`pipeline` (every schedule, M=8) within 1.3x `single`'s step, `gems` and `tensor` within
1.5x; on 4 devices each within 2x (a schedule whose stages the model cannot fill there is
left out, saying why). One `bench` process per point, one after another,
`single` first at each device count, so every ratio compares points of the same hour; all of
that --rounds times over (round-robin), each point's step the median of its rounds: on this
VM two fresh processes of one configuration differ by up to ~30% (the same GEMS point: 36.8
and 54.4 ms in two runs), far more than the steps within one process do.

    python -m experiments bounds --out figures/data/bounds          # the CNN, 2 and 4 devices
    python -m experiments bounds --quick --out /tmp/bounds          # tiny stack-mlp, 2 devices

Writes OUT/points/<devices>/<label>/r<k>/result.json and OUT/bounds.json (rows: devices,
strategy, schedule, ms/step (median over rounds) and each round's, ratio to single, limit,
met, bubble, implementation); its table in the docs is `bounds_table`.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import BenchOptions, option
from experiments.points import points
from experiments.points.points import Point
from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, markdown, num, percent, span, times
from experiments.studies.study import Study, at_least
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE, TENSOR, format_mesh
from jaxpar.models import takes

# (label, strategy, schedule or None, {devices: the step's limit as a multiple of single's})
CASES = (("pipeline gpipe", "pipeline", "gpipe", {2: 1.3, 4: 2.0}),
         ("pipeline 1f1b", "pipeline", "1f1b", {2: 1.3, 4: 2.0}),
         *((f"pipeline {s}", "pipeline", s, {2: 1.3, 4: 2.0})
           for s in ("interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")),
         ("gems", "gems", None, {2: 1.5, 4: 2.0}),
         ("tensor", "tensor", None, {2: 1.5, 4: 2.0}))
AXIS = {"pipeline": STAGE, "gems": STAGE, "tensor": TENSOR}


@dataclass(frozen=True)
class BoundsConfig:
    out: str = options.out("bounds")
    model: str = options.train_option("model", "cnn")
    width: int | None = options.train_option("width", None)
    depth: int | None = options.train_option("depth", None)
    device_counts: tuple[int, ...] = option((2, 4), "simulated device counts (each with its own single)")
    batch_size: int = options.train_option("batch_size")
    microbatches: int = options.train_option("microbatches", 8)
    iters: int = options.iters()
    warmup: int = options.warmup()
    rounds: int = option(3, "round-robin passes over every point, each in a fresh process; a point's step is the median over them")
    timeout: int = options.timeout()


QUICK = dataclasses.replace(BoundsConfig(), model="stack-mlp", width=32, depth=2, device_counts=(2,),
                            batch_size=32, microbatches=4, iters=3, warmup=1, rounds=1, timeout=120)


def case_point(config: BoundsConfig, devices: int, label: str, strategy: str, schedule: str | None) -> Point:
    sizes = {k: getattr(config, k) for k in ("width", "depth")
             if k in takes(config.model) and getattr(config, k) is not None}
    staged = strategy in ("pipeline", "gems")
    train = with_options(TrainConfig(), dataset="synthetic", model=config.model, **sizes,
                         strategy=strategy, devices=devices, batch_size=config.batch_size,
                         mesh=format_mesh({AXIS[strategy]: devices}) if strategy in AXIS else "",
                         **({"microbatches": config.microbatches} if staged else {}),
                         **({"schedule": schedule} if schedule else {}))
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return Point(f"points/{devices}/{label.replace(' ', '-')}", train, bench)


def bounds_points(config: BoundsConfig) -> list[tuple[int, str, Point, float | None]]:
    """(devices, label, point, limit) with `single` first at each device count; a schedule
    that cannot run there (more stages per device than the model's layers allow, M too few)
    is left out, saying why."""
    at_least(config, 1, "batch_size", "iters", "microbatches", "rounds")
    at_least(config, 2, "device_counts")
    out = []
    for n in config.device_counts:
        out.append((n, "single", case_point(config, n, "single", "single", None), None))
        for label, strategy, schedule, limits in CASES:
            p = case_point(config, n, label, strategy, schedule)
            try:
                points.check_point(p)
            except ConfigError as e:
                if schedule in ("gpipe", "1f1b", None):
                    raise
                print(f"{n} devices  {label}: left out ({e})", flush=True)
                continue
            out.append((n, label, p, limits.get(n, limits[max(limits)])))
    points.check_point(out[0][2])
    return out


def run(config: BoundsConfig) -> list[Path]:
    planned = bounds_points(config)
    # in the planned order every round: `single` first at each device count
    outcomes = points.run_rounds([p for _, _, p, _ in planned], config.rounds, config.out,
                                 config.timeout, rotate=False)
    per_point = [outcomes[p.folder] for _, _, p, _ in planned]  # each point's rounds
    rows, single = [], {}
    for (n, label, p, limit), measured in zip(planned, per_point):
        result, steps = measured[0], [r.metrics["step_time_ms_median"] for r in measured]
        desc = result.strategy
        ms = statistics.median(steps)
        single.setdefault(n, ms)
        ratio = ms / single[n]
        rows.append({"devices": n, "label": label, "strategy": p.config.parallel.strategy,
                     "ms_per_step": ms, "ms_per_step_rounds": steps,
                     "ms_per_step_min": min(r.metrics["step_time_ms_min"] for r in measured), "ratio": ratio,
                     "limit": limit, "met": None if limit is None else ratio <= limit,
                     "bubble_fraction": desc.get("bubble_fraction"),
                     "implementation": desc.get("implementation"), "point": p.folder})
        print(f"{n} devices  {label:15s} {ms:8.2f} ms  {ratio:5.2f}x single"
              + ("" if limit is None else f"  (limit {limit}x: {'met' if ratio <= limit else 'NOT met'})"),
              flush=True)
    env = per_point[0][0].env
    study = results.RunResult(kind="bounds", config=dataclasses.asdict(config), env=env,
                              metrics={"rows": rows})
    path = results.write_atomic(Path(config.out) / "bounds.json", study.to_json() + "\n")
    print(f"wrote {path}")
    return [path]


def bounds_table(data_dir: Path) -> str:
    """Each model-parallel strategy's step against single's of the same run and device count."""
    rows = sources.load_source(data_dir, "bounds")["metrics"]["rows"]
    met = lambda r: DASH if r["met"] is None else ("yes" if r["met"] else "**no**")  # noqa: E731
    return markdown(
        ["devices", "strategy", "formulation", "ms/step", "x single", "limit", "within", "schedule's bubble"],
        [[r["devices"], r["label"], r["implementation"] or DASH, num(r["ms_per_step"], 1),
          num(r["ratio"], 2), DASH if r["limit"] is None else f"{r['limit']}x", met(r),
          DASH if r["bubble_fraction"] is None else f"{r['bubble_fraction']:.0%}"] for r in rows])


def _point_result(data_dir: Path, row: dict) -> results.RunResult:
    """The first round's result of a row's point (what every round records alike)."""
    folder = sources.path_of(data_dir, "bounds").parent / row["point"]
    return results.load(points.round_files(folder)[0])


def bounds_findings(data_dir: Path) -> str:
    """Which strategies meet their limits, by how much, and what bounds a pipeline of the model."""
    rows = sources.load_source(data_dir, "bounds")["metrics"]["rows"]
    lines = []
    for n in dict.fromkeys(r["devices"] for r in rows):
        here = [r for r in rows if r["devices"] == n and r["limit"] is not None]
        missed = [r for r in here if not r["met"]]
        single = next(r for r in rows if r["devices"] == n and r["limit"] is None)
        verdict = ("every strategy within its limit" if not missed else
                   f"all within their limits but {listing([r['label'] for r in missed])}")
        lines.append(f"On {n} devices, {verdict} (each step over `single`'s, its limit in brackets): "
                     + ", ".join(f"{r['label']} {times(r['ratio'])} ({r['limit']}x)" for r in here)
                     + "".join(f"; {r['label']}'s rounds {span(r['ms_per_step_rounds'], '.1f', ' ms')} against "
                       f"`single`'s {span(single['ms_per_step_rounds'], '.1f', ' ms')}" for r in missed) + ".")
    staged = {r["label"]: r for r in rows if r["devices"] == min(r["devices"] for r in rows)}
    gpipe, f1b = (_point_result(data_dir, staged[k]) for k in ("pipeline gpipe", "pipeline 1f1b"))
    flops = gpipe.strategy["stage_flops_per_example"]
    lines.append(f"GPipe holds every micro-batch's activations until its backward: "
                 f"{gpipe.metrics['activation_bytes_per_device'] / 1e6:.1f} MB of temporaries against 1F1B's "
                 f"{f1b.metrics['activation_bytes_per_device'] / 1e6:.1f} MB on {len(flops)} devices.")
    lines.append(f"Cut between whole layers ({' | '.join(', '.join(s) for s in gpipe.strategy['stage_layers'])}), "
                 f"stage 0 holds {percent(flops[0] / sum(flops))} of the model's FLOPs, which bounds a "
                 f"{len(flops)}-stage GPipe at {times(gpipe.strategy['speedup_bound'])} one worker even on "
                 "devices of their own (`speedup_bound` in its `describe()`).")
    return bullets(lines)


TABLES = {"bounds": bounds_table, "bounds-findings": bounds_findings}


STUDY = Study("bounds", "each model-parallel strategy's step (pipeline gpipe/1f1b, gems, tensor) "
                        "against single's on 2 and 4 simulated devices, one bench process per point "
                        "in one run, beside the limit it is held to; writes OUT/bounds.json",
              BoundsConfig, QUICK, run)
