"""Pipeline study: bubble fraction, throughput and activation memory vs micro-batch count M for
S stages, GPipe vs 1F1B vs GEMS (bidirectional replicas, `--strategy gems`).

The bubble and the peak micro-batches in flight come from the schedule tables
(jaxpar.parallel.pipeline.schedules), with GPipe's (S-1)/(M+S-1) beside them (GEMS: its own
(S-2)/(2M+S-2); even S and M only). Throughput (images/s, median step), temporary memory per
device (XLA's memory analysis of the compiled step: activations and the buffers around them)
and state memory per device (GEMS holds two stages' parameters) are measured with one
`bench` point per (schedule, M): the `pipeline` strategy (GEMS: `gems`) on S simulated CPU
devices, mesh stage=S, beside `single` on one device at the same batch (the reference, and
the cost check's anchor for this study's session), each measured --rounds times, round after
round, each round's order rotated (`points.in_rounds`); a row is the point's median round
(`points.median_round`).

    python -m experiments pipeline --out figures/data/pipeline       # full: S=4, M=1..32, minutes
    python -m experiments pipeline --quick --out /tmp/pipe           # S=2, M=1..4, tiny model
    python -m experiments pipeline --no-measure --out /tmp/pipe      # schedule tables only

Beside them, every schedule across --ranks MPI ranks (default 2) of one device and one thread
each, `pipeline` over jax.distributed (each rank's step one program), stack-mlp, M in
--rank-microbatches, --rank-rounds rounds rotated: a schedule's gain is the median of its
rounds' step ratios to 1F1B's (rows under metrics["ranks"], points under OUT/ranks/). Its
bubble as a time: each timed step stamped inside the ranks' programs (`bench --timeline`),
what a rank idles within the step's span of actions, against the step's table replayed with
the same step's action times and the measured message latency.

Writes OUT/pipeline.json (RunResult, kind 'pipeline') and one bench result per measured point
and round under OUT/points/<schedule>-M<m>/r<k>/ (the reference: OUT/points/single/r<k>/); a
stopped study resumes from the points already there.
Simulated devices share the machine's cores, so the measured throughput shows the bubble
only as far as idle stages free cores for busy ones: the figure states the cores.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import BenchOptions, option
from experiments.points import points
from experiments.points.mpi import check_ranks
from experiments.points.points import Point
from experiments.studies.study import Study, at_least
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE, format_mesh
from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.gems import Gems

MODEL = "stack-mlp"  # its blocks make stages of equal cost: the bubble is the schedule's alone
PICTURE_MAX_M = 8  # the schedule picture uses the largest M up to this (readable blocks)
# Across ranks, every schedule that runs there as one program per process (GEMS puts a copy of
# each stage on two processes: walked from the host, not comparable).
RANK_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")
GEMS = Gems.name  # `--strategy gems`, and its table in schedules.GENERATORS; the others are `pipeline --schedule NAME`


@dataclass(frozen=True)
class PipelineConfig:
    out: str = options.out("pipeline")
    stages: int = option(4, "pipeline stages S = simulated devices")
    max_microbatches: int = option(32, "largest micro-batch count M; M runs over the powers of two up to it")
    width: int | None = options.train_option("width", 256)
    depth: int | None = options.train_option("depth", 8)  # stack-mlp blocks (+ stem, head: S <= depth + 2)
    # 512: 16 rows per micro-batch at M=32, so the largest M still does real work per slot.
    batch_size: int = options.train_option("batch_size", 512)
    measure: bool = option(True, "time each (schedule, M) in a bench process (--no-measure: schedule tables only, seconds)")
    measured_microbatches: tuple[int, ...] | None = option(None, "the M's to time (default: every M)")
    iters: int = options.iters()
    warmup: int = options.warmup()
    rounds: int = option(3, "passes over every measured point, each in a fresh process, the order rotated each pass; a row is the point's median round")
    timeout: int = options.timeout()
    # The measured timelines: the seeds' CNN as the bounds are stated for it (2 devices, M=8).
    timeline_model: str = options.train_option("model", "cnn")
    timeline_stages: int = option(2, "stages (simulated devices) of the measured timelines (0: none)")
    timeline_microbatches: tuple[int, ...] = option((4, 8), "micro-batches M of the measured timelines")
    timeline_batch_size: int = option(128, "global batch of the measured timelines")
    # Every schedule across processes with a core each, as the schedules' gains are claimed
    # (simulated devices sharing cores fill one another's bubbles): the stack-mlp at the
    # study's width and depth, a batch small enough that each micro-batch's programs are short.
    ranks: int = option(2, "MPI ranks of the rank points: every schedule across R processes of one device and one thread each (0: none)")
    rank_microbatches: tuple[int, ...] = option((4, 8), "micro-batches M of the rank points")
    rank_batch_size: int = option(128, "global batch of the rank points")
    rank_rounds: int = option(7, "passes over every rank point, the order rotated each pass; a schedule's gain is the median of its rounds' ratios to 1F1B's step")


# S=2, M up to 4, a tiny stack-mlp; throughput measured at the largest M only.
QUICK = dataclasses.replace(PipelineConfig(), stages=2, max_microbatches=4, width=32, depth=2,
                            batch_size=64, measured_microbatches=(4,), iters=3, warmup=1,
                            rounds=1, timeout=120, timeline_model=MODEL, timeline_microbatches=(4,),
                            timeline_batch_size=64, ranks=0)


def planned_microbatches(config: PipelineConfig) -> tuple[list[int], list[int]]:
    """(every M, the M's to measure); checks the options before any work."""
    S, top = config.stages, config.max_microbatches
    if S < 2:
        raise ConfigError(f"--stages must be >= 2 for a pipeline, got {S}")
    at_least(config, 1, "max_microbatches", "iters", "batch_size", "rounds")
    at_least(config, 0, "warmup")
    counts = [2 ** i for i in range(top.bit_length()) if 2 ** i <= top]
    measured = [] if not config.measure else list(config.measured_microbatches or counts)
    if set(measured) - set(counts):
        raise ConfigError(f"--measured-microbatches must be among the M's {counts}, got {measured}")
    if measured and config.batch_size % max(measured):
        raise ConfigError(f"--batch-size {config.batch_size} must be a multiple of the largest "
                          f"M = {max(measured)} (each micro-batch gets batch/M rows)")
    return counts, measured


def check_rank_points(config: PipelineConfig) -> None:
    """ConfigError naming the fix for rank points that cannot run, before any work."""
    if not (config.ranks and config.measure):
        return
    if config.ranks < 2:
        raise ConfigError(f"--ranks must be 0 (no rank points) or >= 2 for a pipeline, got {config.ranks}")
    at_least(config, 1, "rank_rounds", "rank_batch_size", "rank_microbatches")
    if not config.rank_microbatches:
        raise ConfigError("--rank-microbatches needs at least one M, e.g. 4,8")
    if config.rank_batch_size % max(config.rank_microbatches):
        raise ConfigError(f"--rank-batch-size {config.rank_batch_size} must be a multiple of the largest "
                          f"--rank-microbatches {max(config.rank_microbatches)}")
    check_ranks(("pipeline",), (config.ranks,), (MODEL,))


def counts_for(name: str, stages: int, microbatch_counts: list[int]) -> list[int]:
    """The M's schedule `name` runs at S stages: those its own rules take (GEMS: even S and M;
    interleaved schedules: M in whole rounds; dualpipev: at least a micro-batch per stage)."""
    def runs(m):
        try:
            schedules.build(name, stages, m)
        except schedules.ScheduleError:
            return False
        return True
    return [m for m in microbatch_counts if runs(m)]


def theory_of(name: str, stages: int, m: int) -> float:
    """The bubble a schedule is held to: GPipe's and 1F1B's (S-1)/(M+S-1), GEMS's
    (S-2)/(2M+S-2), any other's from its own lists with a backward twice a forward."""
    if name == GEMS:
        return schedules.gems_bubble_theory(stages, m)
    if name in ("gpipe", "1f1b"):
        return schedules.bubble_theory(stages, m)
    return schedules.timed_bubble(schedules.build(name, stages, m))


def schedule_rows(stages: int, microbatch_counts: list[int]) -> tuple[list[dict], dict]:
    """Bubble and peak in-flight micro-batches per schedule and M, from the tables.

    Returns:
        (rows [{schedule, M, bubble, theory, peak_in_flight}],
         {schedule: {"M", "table"}} for the largest M <= PICTURE_MAX_M)
    """
    rows, tables = [], {}
    for name in schedules.GENERATORS:
        counts = counts_for(name, stages, microbatch_counts)
        for m in counts:
            schedule = schedules.build(name, stages, m)
            table = schedules.table(schedule)
            classic = name in ("gpipe", "1f1b", GEMS)  # slots of one length: the table's share
            rows.append({"schedule": name, "M": m,
                         "bubble": schedules.bubble_fraction(table) if classic else schedules.timed_bubble(schedule),
                         "theory": theory_of(name, stages, m),
                         "peak_in_flight": max(schedules.peak_in_flight(table))})
        pictured = [m for m in counts if m <= PICTURE_MAX_M]
        if pictured:
            tables[name] = {"M": max(pictured), "table": schedules.table(schedules.build(name, stages, max(pictured)))}
    return rows, tables


def schedule_point(config: PipelineConfig, schedule: str, m: int) -> Point:
    """One (schedule, M) bench point: the pipeline strategy on S simulated devices."""
    S = config.stages
    by_schedule = {"strategy": GEMS} if schedule == GEMS else {"strategy": "pipeline", "schedule": schedule}
    train = with_options(TrainConfig(), dataset="synthetic", model=MODEL, width=config.width,
                         depth=config.depth, devices=S, mesh=format_mesh({STAGE: S}),
                         microbatches=m, batch_size=config.batch_size, **by_schedule)
    # --no-matmul-peak: the study does not use it, and it costs seconds a point.
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return Point(f"points/{schedule}-M{m}", train, bench)


def single_point(config: PipelineConfig) -> Point:
    """The reference: the same model and batch under `single` on one device."""
    train = with_options(TrainConfig(), dataset="synthetic", model=MODEL, width=config.width,
                         depth=config.depth, strategy="single", batch_size=config.batch_size)
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return Point("points/single", train, bench)


def timeline_point(config: PipelineConfig, schedule: str, m: int) -> Point:
    """One stamped step of `schedule` at M = m with one program per stage (`bench --timeline`:
    a stamped step, and each action's programs timed alone), each simulated device on one
    thread of its own (as a rank with a core: sharing threads, another device's work would
    fill a bubble)."""
    S, model = config.timeline_stages, config.timeline_model
    by_schedule = {"strategy": GEMS} if schedule == GEMS else {"strategy": "pipeline", "schedule": schedule}
    small = {"width": config.width, "depth": config.depth} if model == MODEL else {}
    train = with_options(TrainConfig(), dataset="synthetic", model=model, devices=S,
                         mesh=format_mesh({STAGE: S}), microbatches=m, pipeline_impl="mpmd",
                         single_thread=True, batch_size=config.timeline_batch_size, **small, **by_schedule)
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False, timeline=True)
    return Point(f"timelines/{schedule}-S{S}-M{m}", train, bench)


def point_on_ranks(config: PipelineConfig, schedule: str, m: int) -> Point:
    """One (schedule, M) across `config.ranks` MPI ranks: `pipeline` over jax.distributed, a
    stage per rank (its step one program per process), each rank one device on one core."""
    R = config.ranks
    train = with_options(TrainConfig(), dataset="synthetic", model=MODEL, width=config.width,
                         depth=config.depth, strategy="pipeline", schedule=schedule, devices=1,
                         mesh=format_mesh({STAGE: R}), microbatches=m, single_thread=True,
                         batch_size=config.rank_batch_size)
    # --timeline: each timed step stamped inside the ranks' programs (its bubble, lived and replayed)
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False, timeline=True)
    return Point(f"ranks/{schedule}-R{R}-M{m}", train, bench, ranks=R)


def rows_on_ranks(config: PipelineConfig, planned: dict, by_folder: dict) -> list[dict]:
    """Per (schedule, M) across ranks: the median round's step, every round's, and the median
    over rounds of the step's ratio to 1F1B's in the same round (rounds a few minutes apart
    drift together: the ratio within one is the gain); the table's bubble with a backward
    twice a forward; and the bubble as a time a device idles a step, the median over rounds:
    as the stamped steps lived it (within the span of their actions) against each step's
    table replayed with its own action times and the measured message latency (bench's
    `timeline`), and each rank's time blocked in receives and flushes (`p2p_waited_ms`, the
    median round's: waits across steps too, for the other ranks' updates)."""
    rows = []
    for (name, m), point in planned.items():
        measured = by_folder[point.folder]
        rounds = [r.metrics["step_time_ms_median"] for r in measured]
        ones = [r.metrics["step_time_ms_median"] for r in by_folder[planned["1f1b", m].folder]]
        median = points.median_round(measured).metrics
        timelines = [r.metrics["timeline"] for r in measured if r.metrics.get("timeline", {}).get("idle_ms") is not None]
        over_rounds = lambda key: float(statistics.median(t[key] for t in timelines)) if timelines else None  # noqa: E731
        rows.append({"schedule": name, "M": m, "ranks": config.ranks,
                     "step_ms": median["step_time_ms_median"],
                     "step_ms_rounds": rounds,
                     "to_1f1b": float(statistics.median(a / b for a, b in zip(rounds, ones))),
                     "bubble": schedules.timed_bubble(schedules.build(name, config.ranks, m)),
                     "idle_ms": over_rounds("idle_ms"), "idle_ms_replayed": over_rounds("idle_ms_timed"),
                     "bubble_replayed": over_rounds("bubble_timed"), "latency_ms": over_rounds("latency_ms"),
                     "waited_ms_by_rank": median.get("p2p_waited_ms"),
                     "action_ms": median.get("timeline", {}).get("action_ms"),
                     "point": point.folder})
    return rows


def timeline_of(result: results.RunResult, folder: str) -> dict:
    return {**result.metrics["timeline"], "step_ms": result.metrics["step_time_ms_median"],
            "model": result.config["model"]["model"], "point": folder}


def measurement(measured: list[results.RunResult], folder: str) -> dict:
    """Throughput and memory of one (schedule, M) from its rounds: the median round's."""
    result = points.median_round(measured)
    pm = result.metrics
    return {"images_per_sec": pm["images_per_sec"], "step_ms": pm["step_time_ms_median"],
            "step_ms_rounds": [r.metrics["step_time_ms_median"] for r in measured],
            "temp_bytes": pm["memory_per_device"]["temp_bytes"],
            # what the step holds beside its state: the SPMD program's temporaries; with a
            # program per stage, the residuals kept between a forward and its backward too
            "activation_bytes": pm.get("activation_bytes_per_device", pm["memory_per_device"]["temp_bytes"]),
            "state_bytes": pm["state_bytes_per_device"], "compile_s": pm["compile_s"],
            "collective_bytes": pm["collective_bytes_per_step"],
            # host-driven stages move activations with device_put, not collectives
            "moved_bytes": result.strategy.get("stage_transfer_bytes_per_step", pm["collective_bytes_per_step"]),
            "implementation": result.strategy.get("implementation"), "point": folder}


def run(config: PipelineConfig) -> list[Path]:
    """Tables for every M, measured points, OUT/pipeline.json; return its path."""
    counts, measured = planned_microbatches(config)
    check_rank_points(config)
    planned = {(s, m): schedule_point(config, s, m) for s in schedules.GENERATORS
               for m in counts_for(s, config.stages, measured)}
    # --no-measure: the tables alone, no timeline either
    timed = {f"{s}, M={m}": timeline_point(config, s, m) for s in schedules.GENERATORS
             if config.timeline_stages and config.measure
             for m in counts_for(s, config.timeline_stages, list(config.timeline_microbatches))}
    reference = [single_point(config)] if planned else []
    by_folder = points.run_rounds([*reference, *planned.values()], config.rounds, config.out,
                                  config.timeout)
    on_ranks = {(s, m): point_on_ranks(config, s, m) for s in RANK_SCHEDULES if config.ranks and config.measure
                for m in counts_for(s, config.ranks, list(config.rank_microbatches))}
    on_ranks_by_folder = points.run_rounds(list(on_ranks.values()), config.rank_rounds, config.out,
                                           config.timeout) if on_ranks else {}
    outcomes = {key: by_folder[p.folder] for key, p in planned.items()}
    single = {"images_per_sec": None, "step_ms": None}  # --no-measure: no reference either
    for p in reference:
        single = measurement(by_folder[p.folder], p.folder)
    stamped = points.run_points(list(timed.values()), config.out, config.timeout)  # one stamped step each
    timelines = {s: timeline_of(r, timed[s].folder) for s, r in zip(timed, stamped)}
    rows, tables = schedule_rows(config.stages, counts)
    result_ranks = rows_on_ranks(config, on_ranks, on_ranks_by_folder)
    # the median round's stamped step of each schedule at the fewest micro-batches, for the figure
    rank_timelines = {f"{s}, M={m}": timeline_of(points.median_round(on_ranks_by_folder[p.folder]), p.folder)
                      for (s, m), p in on_ranks.items() if m == min(config.rank_microbatches)}
    point_env = None
    for r in rows:
        r.update(images_per_sec=None, step_ms=None, temp_bytes=None, activation_bytes=None)
        key = (r["schedule"], r["M"])
        if key in outcomes:
            r.update(measurement(outcomes[key], planned[key].folder))
            point_env = outcomes[key][0].env
        tput = f"{r['images_per_sec']:8,.0f} img/s {r['step_ms']:7.1f} ms activations {r['activation_bytes'] / 2**20:6.2f} MiB" \
            if r["images_per_sec"] else "not measured"
        print(f"{r['schedule']:6s} S={config.stages} M={r['M']:3d} bubble={r['bubble']:.3f} "
              f"theory={r['theory']:.3f} peak_in_flight={r['peak_in_flight']:3d}  {tput}", flush=True)
    for r in result_ranks:
        print(f"{r['schedule']:16s} on {r['ranks']} ranks M={r['M']}: {r['step_ms']:7.1f} ms, "
              f"{r['to_1f1b']:.3f} of 1F1B's step (median of {len(r['step_ms_rounds'])} rounds)"
              + ("" if r["idle_ms"] is None else  # walked from the host: no stamps in the step
                 f"; a rank idles {r['idle_ms']:.2f} ms a step, its table replayed {r['idle_ms_replayed']:.2f} ms"),
              flush=True)
    if single["images_per_sec"]:
        print(f"single on 1 device, batch {config.batch_size}: {single['images_per_sec']:,.0f} img/s "
              f"{single['step_ms']:.1f} ms", flush=True)
    record = {**dataclasses.asdict(config), "model": MODEL, "strategy": "pipeline", "bidirectional": GEMS,
              "microbatch_counts": counts, "measured_microbatch_counts": measured}
    result = results.RunResult(kind="pipeline", config=record, env=results.environment(),
                               metrics={"stages": config.stages, "rows": rows, "tables": tables,
                                        "point_env": point_env, "timelines": timelines, "rank_timelines": rank_timelines,
                                        "ranks": result_ranks,
                                        "single": single})
    path = results.write_atomic(Path(config.out) / "pipeline.json", result.to_json() + "\n")
    print(f"wrote {path}")
    return [path]


STUDY = Study("pipeline", "pipeline bubble (schedule tables), throughput and memory per device (one "
                          "bench process per point and round) vs micro-batches, GPipe vs 1F1B vs GEMS; writes "
                          "OUT/pipeline.json", PipelineConfig, QUICK, run)
