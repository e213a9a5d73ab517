"""The peers study's model-parallel section: PyTorch's model parallelism beside jaxpar's on the
same ranks, the same model cut at the same layer, the same micro-batches, Adam, global batch.

    python -m experiments peers --sections model-parallel --out figures/data/peers   # a few minutes

PyTorch: `torch.distributed.pipelining` (ScheduleGPipe, Schedule1F1B), a stage per gloo rank,
and DTensor tensor parallelism (experiments/peers/torch_parallel.py); jaxpar: `mpi-pipeline` (a
stage per MPI rank), `pipeline` on one jax.distributed mesh over the ranks and, for
completeness, on simulated devices in one process, and `tensor` over the ranks. Rank points
run --ranks processes x 1 thread. Both pipelines cut the model where jaxpar cuts it for --ranks
stages (`jaxpar.parallel.pipeline.inner_cut.plan`: the CNN inside conv2). Every configuration is measured in
each of --rounds interleaved rounds (study.interleaved_rounds); a row is the median of the
round medians, its ratio jaxpar / PyTorch of the same kind (pipeline of the same schedule,
tensor parallelism). The section's rows, settings and load go to peers.json under
metrics.model_parallel, which a run of the other section alone keeps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from experiments.options import BenchOptions
from experiments.peers.jaxpar_side import peer_train_config
from experiments.peers.torch_point import PIPELINE_CLASSES, TorchPoint
from experiments.points.mpi import check_ranks, places_model
from experiments.points.points import Point
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline import inner_cut, schedules


SECTION = "model-parallel"
SCHEDULES = PIPELINE_CLASSES  # jaxpar's name: PyTorch's class (every schedule both ship)


@dataclass(frozen=True)
class Entry:
    """One configuration of the section: its framework, label and PyTorch peer (None: a peer);
    for jaxpar, its strategy, schedule and whether it runs on ranks (else simulated devices)."""
    framework: str
    what: str
    peer: str | None = None
    strategy: str | None = None
    schedule: str | None = None
    on_ranks: bool = True


def per_rank(schedule: str) -> str:
    """'a stage per rank', or 'V stages per rank' for a schedule with several."""
    v = schedules.virtual_stages(schedule)
    return "a stage per rank" if v == 1 else f"{v} stages per rank"


def entries(config) -> dict[str, Entry]:
    """Every configuration of the section, in table order, by key."""
    found = {}
    for s in config.schedules:
        peer = f"torch-{s}"
        found |= {
            peer: Entry("pytorch", f"torch.distributed.pipelining {SCHEDULES[s]}, {per_rank(s)} (gloo)"),
            f"jaxpar-mpi-pipeline-{s}": Entry("jaxpar", f"mpi-pipeline {s}, {per_rank(s)} (mpi4jax)",
                                              peer, "mpi-pipeline", s),
            f"jaxpar-pipeline-ranks-{s}": Entry("jaxpar", f"pipeline {s}, one jax.distributed mesh over the ranks",
                                                peer, "pipeline", s),
            f"jaxpar-pipeline-devices-{s}": Entry(
                "jaxpar", f"pipeline {s}, {config.ranks} simulated devices in one process", peer, "pipeline", s,
                on_ranks=False)}
    found["torch-tp"] = Entry("pytorch", "DTensor tensor parallel: the Megatron pair of Linear layers split, "
                                         "the rest replicated")
    found["jaxpar-tensor-ranks"] = Entry("jaxpar", "tensor over the ranks (the CNN: every layer split, "
                                                   "conv1 over the batch's rows)", "torch-tp", "tensor")
    return found


def mp_train_config(config, entry: Entry) -> TrainConfig:
    """What a jaxpar configuration trains (the data-parallel section's settings)."""
    base = peer_train_config(config, config.mp_model, entry.strategy,
                             1 if entry.on_ranks else config.ranks, ranks=entry.on_ranks)
    if not entry.on_ranks:  # one pinned thread per simulated device, as each rank has: the
        # devices sharing both threads measured 46 ms a step (1F1B) against 29 ms pinned
        base = with_options(base, single_thread=True)
    if entry.schedule is None:
        return base
    return with_options(base, microbatches=config.microbatches, schedule=entry.schedule)


def stage_plan(config, schedule: str | None = None) -> inner_cut.Plan:
    """Where jaxpar's pipelines cut --mp-model into the schedule's stages (--ranks x its stages
    per rank; the CNN inside conv2 where that balances them): the cut both frameworks run."""
    schedule = schedule or config.schedules[0]
    entry = Entry("jaxpar", "", strategy="mpi-pipeline", schedule=schedule)
    stages = config.ranks * schedules.virtual_stages(schedule)
    return inner_cut.plan(mp_train_config(config, entry), stages, inside=True)


def stage_ranks(config, schedule: str) -> tuple[int, ...] | None:
    """The rank of each stage where a rank holds several (jaxpar's placement, which PyTorch's
    schedule of the same name also takes); None: stage s on rank s."""
    if schedules.virtual_stages(schedule) == 1:
        return None
    return tuple(schedules.build(schedule, config.ranks, config.microbatches).placement[0])


def mp_plan(config) -> tuple[list[str], dict[str, str]]:
    """(the keys to run, {key: why skipped}); ConfigError naming the fix for a bad option."""
    from experiments.peers.torch_parallel import TP_PLANS  # imports torch: only once it is there

    bad = [s for s in config.schedules if s not in SCHEDULES]
    if bad:
        raise ConfigError(f"--schedules {','.join(bad)}: choose from {', '.join(SCHEDULES)}")
    if config.mp_model not in TP_PLANS:
        raise ConfigError(f"--mp-model {config.mp_model}: choose a model whose PyTorch twin is cut into "
                          f"stages ({', '.join(TP_PLANS)})")
    if config.batch_size % config.microbatches:
        raise ConfigError(f"--microbatches {config.microbatches} must divide --batch-size {config.batch_size}")
    known = entries(config)
    unknown = [k for k in config.mp_configs or () if k not in known]
    if unknown:
        raise ConfigError(f"--mp-configs {','.join(unknown)}: choose from {', '.join(known)}")
    keys = [k for k in known if k in (config.mp_configs or known)]
    skipped = {}
    try:  # the launcher and mpi4jax: what the rank points need installed
        check_ranks(("mpi-pipeline",), (config.ranks,), (config.mp_model,))
    except ConfigError as e:
        skipped |= {k: str(e) for k in keys if known[k].framework == "jaxpar" and known[k].on_ranks}
    if "jaxpar-tensor-ranks" in keys and not places_model("tensor", config.mp_model):
        skipped["jaxpar-tensor-ranks"] = f"jaxpar's tensor does not split {config.mp_model}"
    return [k for k in keys if k not in skipped], skipped


def mp_point(config, key: str, k: int) -> Point | TorchPoint:
    """Configuration `key` in round k."""
    folder = f"points/{config.mp_model}/mp/{key}/r{k}"
    if key.startswith("torch-"):
        mode = key.removeprefix("torch-")
        cut = stage_plan(config, mode) if mode in SCHEDULES else None  # pipelines only
        return TorchPoint(folder, config.mp_model, mode, config.batch_size, config.iters, config.warmup,
                          config.ranks, config.adam, config.lr, matmul_peak=False,
                          microbatches=config.microbatches if cut else None,
                          stage_starts=cut.starts if cut else None,
                          cut_channels=cut.channels if cut else None,
                          stage_ranks=stage_ranks(config, mode) if cut else None)
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    entry = entries(config)[key]
    return Point(folder, mp_train_config(config, entry), bench, config.ranks if entry.on_ranks else None)


def mp_rows(config, records: dict[str, list[dict]]) -> list[dict]:
    """Table rows, in `entries` order: median of round medians, images/s, ratio to the peer."""
    out = {}
    for key, entry in entries(config).items():
        recs = records.get(key)
        if not recs:
            continue
        ms = statistics.median(rec["ms"] for rec in recs)
        out[key] = {"config": key, "framework": entry.framework, "what": entry.what,
                    "processes": recs[0]["processes"], "threads_per_process": recs[0]["threads"],
                    "rounds_ms": [rec["ms"] for rec in recs], "ms_per_step": ms,
                    "images_per_sec": config.batch_size / (ms / 1000),
                    "first_step_s": statistics.median(rec["first_step_s"] for rec in recs),
                    "stage_starts": recs[0].get("stage_starts"), "peer": None, "ratio_vs_peer": None}
    for key, row in out.items():
        peer = entries(config)[key].peer
        if peer in out:
            row |= {"peer": peer, "ratio_vs_peer": row["images_per_sec"] / out[peer]["images_per_sec"]}
    return list(out.values())


def section(config, records: dict, skipped: dict, failed: dict, load: list[float]) -> dict:
    """What peers.json keeps of the section (metrics.model_parallel)."""
    settings = {k: getattr(config, k) for k in ("mp_model", "ranks", "microbatches", "schedules",
                                                "batch_size", "lr", "adam", "iters", "warmup", "rounds")}
    cut = stage_plan(config)
    return {"config": {**settings, "stage_starts": list(cut.starts), "stage_layers": list(cut.names),
                       "cut_channels": cut.channels},
            "rows": mp_rows(config, records), "skipped": skipped, "failed": failed,
            "load_average_1min": load,
            "torch": next((r["torch"] for recs in records.values() for r in recs if r.get("torch")), None)}
