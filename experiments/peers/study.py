"""PyTorch as a built-in peer: the same models, optimizer, batch and synthetic data in PyTorch
(eager, torch.compile, DDP over gloo ranks) beside jaxpar (`single`, its best single-process
configuration, `mpi-allreduce` on the same ranks), all in one run, interleaved.

    python -m experiments peers --out figures/data/peers       # full: MLP, CNN, ResNet (tens of minutes)
    python -m experiments peers --quick --out /tmp/peers       # MLP, a few steps (a minute or two)
    python -m experiments peers --sections model-parallel --out figures/data/peers   # that section alone

Needs the `peer` extra (torch==2.13.0, CPU wheel): `pip install '.[peer]'` or `make peer`.
Every configuration runs in its own process: jaxpar points through `experiments.points`
(`python -m experiments.points.run`), PyTorch points through `torch_launch`
(`python -m experiments.peers.torch_bench`); both resume a stopped study and refuse a folder
of other settings. First a screening picks jaxpar's best single-process configuration per
model (`single` on 1 device or a data-parallel strategy on --best-devices simulated devices,
--screen-iters steps each); then --rounds rounds go round-robin over every configuration, the
order rotated each round, so drift on a shared machine hits all alike (each round its own
folder: r0, r1, ...). A configuration's ms/step is the median over rounds of each round's
median of --iters steps; the best single-process row is the faster of the screen's pick and
`single` in the rounds (rows.py). The model-parallel section (model_parallel.py) runs
PyTorch's pipelining and tensor parallelism beside jaxpar's on the same ranks, in rounds of
its own; --sections runs one section and keeps the other's rows from OUT/peers.json. Writes
OUT/peers.json (RunResult: config, env, metrics.rows), OUT/summary.md (tables.py) and
OUT/peers.png (figures.py), atomically.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import BenchOptions, option
from experiments.peers import model_parallel as peers_mp
from experiments.peers.figures import peers_bars
from experiments.peers.jaxpar_side import peer_train_config
from experiments.peers.rows import describe_best, peers_result
from experiments.peers.tables import peers_summary
from experiments.peers.torch_launch import check_folders, run_torch_point
from experiments.peers.torch_point import ADAM_KERNELS, TorchPoint
from experiments.points import points
from experiments.points.mpi import check_ranks
from experiments.points.points import Point, PointError
from experiments.studies.study import Study, at_least, distinct
from jaxpar import results
from jaxpar.errors import ConfigError, ResultsError
from jaxpar.models import abstract_model, param_count
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.base import STEPS_OPTION
from jaxpar.runtime import optional

SECTIONS = ("data-parallel", peers_mp.SECTION)
# The configurations of every model, in table order: (key, framework, what it is).
CONFIGS = (("jaxpar-single", "jaxpar", "single, 1 device"),
           ("jaxpar-best", "jaxpar", "best single-process configuration"),
           ("torch-eager", "pytorch", "eager"),
           ("torch-compile", "pytorch", "torch.compile (model and optimizer step)"),
           ("jaxpar-ranks", "jaxpar", "ranks x 1 thread"),
           ("torch-ddp", "pytorch", "DDP (gloo), ranks x 1 thread"))


@dataclass(frozen=True)
class PeersConfig:
    out: str = options.out("peers")
    models: tuple[str, ...] | None = option(None, "models compared (default: every model with a PyTorch twin in experiments/peers/torch_models.py)", choices="model")
    batch_size: int = options.train_option("batch_size")
    # Adam at a constant rate on both sides: the optimizers match step for step.
    lr: float = options.train_option("lr")
    iters: int = options.iters()
    warmup: int = options.warmup()
    rounds: int = option(3, "round-robin passes over every configuration (each configuration: rounds x iters timed steps)")
    ranks: int = option(2, "processes of PyTorch DDP and of jaxpar's --rank-strategy, 1 thread each")
    rank_strategy: str = option("mpi-allreduce", "jaxpar's answer to DDP on --ranks processes", choices="strategy")
    best_devices: tuple[int, ...] = option((1, 2, 4), "simulated device counts screened for jaxpar's best single-process configuration")
    best_strategies: tuple[str, ...] | None = option(None, "strategies screened on them besides single (default: the data-parallel family)", choices="strategy")
    best_steps_per_dispatch: tuple[int, ...] = option((1, 4), "--steps-per-dispatch values screened with every candidate that takes it")
    screen_iters: int = option(10, "timed steps of each screening point")
    # The fastest Adam PyTorch offers on CPU; its default there is the for-loop kernel (MLP step,
    # 1 thread, interleaved: fused 14-16 ms, foreach 17-25, for-loop 24-30). The peer is PyTorch
    # at its best, not at its defaults.
    adam: str = option("fused", f"PyTorch's Adam kernel: {' | '.join(ADAM_KERNELS)} (for-loop: what PyTorch picks on CPU untold)")
    compile: bool = option(True, "also time torch.compile (a failure is recorded with its reason)")
    sections: tuple[str, ...] = option(SECTIONS, "data-parallel (the configurations above) and/or model-parallel (PyTorch's pipelining and tensor parallelism beside jaxpar's on --ranks ranks); a section not run keeps its rows from OUT/peers.json")
    mp_model: str = option("cnn", "model-parallel section: the model (one whose PyTorch twin is cut into stages)", choices="model")
    microbatches: int = option(8, "model-parallel section: micro-batches per global batch of every pipeline")
    schedules: tuple[str, ...] = option(tuple(peers_mp.SCHEDULES), "model-parallel section: pipeline schedules, each PyTorch's and jaxpar's (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zbv, dualpipev)")
    mp_configs: tuple[str, ...] | None = option(None, "model-parallel section: its configurations to run (default: all; e.g. torch-gpipe,jaxpar-mpi-pipeline-gpipe)")
    timeout: int = options.timeout()


# Every configuration once, for tests: the MLP, one round, a screening of four candidates;
# model parallelism: PyTorch's two pipelines and one jaxpar pipeline.
QUICK = dataclasses.replace(PeersConfig(), models=("mlp",), iters=3, warmup=1, rounds=1,
                            best_devices=(2,), best_strategies=("dp-auto",),
                            best_steps_per_dispatch=(1, 2), screen_iters=2, mp_model="mlp",
                            mp_configs=("torch-gpipe", "torch-1f1b", "jaxpar-mpi-pipeline-gpipe"),
                            timeout=300)


@dataclass(frozen=True)
class Plan:
    """The study's resolved settings."""
    models: tuple[str, ...]
    candidates: tuple[tuple[str, int, int], ...]  # (strategy, devices, steps per dispatch) screened per model
    skipped: dict[str, str]                   # configuration key -> why it is not run


def torch_missing() -> str | None:
    """Why PyTorch cannot run here (the message names the install), or None."""
    return None if optional.available("torch") else optional.install_message("torch", "the peers study")


def data_parallel() -> tuple[str, ...]:
    return tuple(n for n, c in STRATEGIES.items() if c.family == "data parallel")


def resolved_plan(config: PeersConfig) -> Plan:
    """Check every option before any work (ConfigError names the fix)."""
    why = torch_missing()
    if why:
        raise ConfigError(why)
    from experiments.peers.torch_models import TWINS  # imports torch: only once it is there

    unknown_sections = [x for x in config.sections if x not in SECTIONS]
    if unknown_sections or not config.sections:
        raise ConfigError(f"--sections {','.join(unknown_sections)}: choose one or both of {', '.join(SECTIONS)}")
    models = config.models or tuple(TWINS)
    bad = [m for m in models if m not in TWINS]
    if bad:
        raise ConfigError(f"--models {','.join(bad)}: no PyTorch twin; choose from {', '.join(TWINS)}")
    strategies = config.best_strategies or data_parallel()
    unknown = [s for s in strategies if s not in data_parallel()]
    if unknown:
        raise ConfigError(f"--best-strategies {','.join(unknown)}: choose data-parallel strategies "
                          f"({', '.join(data_parallel())})")
    at_least(config, 1, "batch_size", "iters", "rounds", "best_devices", "best_steps_per_dispatch",
             "screen_iters")
    at_least(config, 0, "warmup")
    at_least(config, 2, "ranks")
    distinct(config, *(name for name in ("models", "best_devices", "best_strategies",
                                         "best_steps_per_dispatch")
                       if getattr(config, name) is not None))
    if config.batch_size % config.ranks:
        raise ConfigError(f"--batch-size {config.batch_size} must be a multiple of --ranks {config.ranks} "
                          "(DDP splits the global batch evenly)")
    if config.adam not in ADAM_KERNELS:
        raise ConfigError(f"--adam {config.adam!r}: choose {', '.join(ADAM_KERNELS)}")
    cls = STRATEGIES[config.rank_strategy]
    if not (cls.uses_mpi or cls.multiprocess):
        able = [n for n, c in STRATEGIES.items() if c.uses_mpi or c.multiprocess]
        raise ConfigError(f"--rank-strategy {cls.name} does not run across processes; choose one "
                          f"that does ({', '.join(able)})")
    skipped = {}
    try:  # what is left to fail is the install (mpiexec, mpi4jax): the rest still runs
        check_ranks((config.rank_strategy,), (config.ranks,), models)
    except ConfigError as e:
        skipped["jaxpar-ranks"] = str(e)
    if not config.compile:
        skipped["torch-compile"] = "--no-compile"
    pairs = (("single", 1),) + tuple((s, n) for n in config.best_devices if n > 1 for s in strategies)
    candidates = tuple((s, n, k) for s, n in pairs for k in config.best_steps_per_dispatch
                       if k == 1 or STEPS_OPTION in STRATEGIES[s].options)
    return Plan(tuple(models), candidates, skipped)


def screen_point(config: PeersConfig, model: str, strategy: str, devices: int, k: int) -> Point:
    # --screen-iters calls, each of k steps: as many samples as a one-step candidate has (a
    # median of fewer calls picked the slower candidate on this noisy machine).
    return Point(f"screen/{model}/{strategy}-{devices}" + (f"-k{k}" if k > 1 else ""),
                 peer_train_config(config, model, strategy, devices, steps_per_dispatch=k),
                 BenchOptions(iters=config.screen_iters, warmup=config.warmup, matmul_peak=False))


def round_point(config: PeersConfig, model: str, key: str, k: int,
                best: tuple[str, int, int] | None = None) -> Point | TorchPoint:
    """Configuration `key` of `model` in round k: a jaxpar Point or a TorchPoint. Each
    framework's matmul peak is measured every round, by `single` and by PyTorch eager."""
    folder = f"points/{model}/{key}/r{k}"
    if key.startswith("torch-"):
        mode = key.removeprefix("torch-")
        return TorchPoint(folder, model, mode, config.batch_size, config.iters, config.warmup,
                          config.ranks if mode == "ddp" else 1, config.adam, config.lr,
                          matmul_peak=mode == "eager")
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=key == "jaxpar-single")
    if key == "jaxpar-ranks":
        return Point(folder, peer_train_config(config, model, config.rank_strategy, ranks=True), bench,
                     config.ranks)
    # With K steps per dispatch: --iters calls of K steps each (a median of as many samples).
    strategy, devices, chained = ("single", 1, 1) if key == "jaxpar-single" else best
    return Point(folder, peer_train_config(config, model, strategy, devices, steps_per_dispatch=chained),
                 bench)


def best_key(best: dict) -> tuple[str, int, int]:
    return best["strategy"], best["devices"], best.get("steps_per_dispatch", 1)


def check_param_counts(config: PeersConfig, models: tuple[str, ...]) -> dict[str, int]:
    """{model: parameters}, the same in jaxpar and its PyTorch twin (ConfigError otherwise)."""
    from experiments.peers import torch_models  # imports torch: only once it is there

    counts = {}
    for model in models:
        ours = param_count(abstract_model(peer_train_config(config, model, "single").model))
        twin = torch_models.param_count(torch_models.make_twin(model))
        if ours != twin:
            raise ConfigError(f"{model}: jaxpar has {ours:,} parameters, its PyTorch twin {twin:,}; "
                              "experiments/peers/torch_models.py no longer matches jaxpar/models")
        counts[model] = ours
    return counts


def prepass(config: PeersConfig, found: Plan, out: Path) -> None:
    """Before any work: every jaxpar point known yet can run (`jaxpar.validate`), and no point
    left in OUT was measured with other settings (ConfigError naming its folder)."""
    for model in found.models:
        known = [screen_point(config, model, s, n, k) for s, n, k in found.candidates]
        known += [round_point(config, model, key, k) for k in range(config.rounds)
                  for key, _, _ in CONFIGS if key != "jaxpar-best" and key not in found.skipped]
        check_folders(known, out)


def screen(config: PeersConfig, found: Plan) -> dict[str, dict]:
    """jaxpar's best single-process configuration per model: every candidate, briefly.
    Returns {model: {'strategy', 'devices', 'steps_per_dispatch', 'candidates': [{strategy,
    devices, steps_per_dispatch, images_per_sec}]}}."""
    best = {}
    for model in found.models:
        planned = [screen_point(config, model, s, n, k) for s, n, k in found.candidates]
        outcomes = points.run_points(planned, config.out, config.timeout, keep_going=True)
        tried = [{"strategy": s, "devices": n, "steps_per_dispatch": k,
                  "images_per_sec": r.metrics["images_per_sec"]}
                 for (s, n, k), r in zip(found.candidates, outcomes) if not isinstance(r, PointError)]
        if not tried:
            raise PointError(f"{model}: no jaxpar configuration ran in the screening")
        top = max(tried, key=lambda t: t["images_per_sec"])
        best[model] = {**{key: top[key] for key in ("strategy", "devices", "steps_per_dispatch")},
                       "candidates": tried}
        print(f"best single-process configuration for {model}: {describe_best(top)}",
              flush=True)
    return best


def measure_round(config: PeersConfig, p: Point | TorchPoint) -> dict:
    """One configuration of one model, one round, in its own process(es): its round record.

    Raises:
      PointError: its process failed or ran past --timeout.
    """
    if isinstance(p, TorchPoint):
        r = run_torch_point(p, Path(config.out), config.timeout)
        return {"ms": r["median_ms"], "first_step_s": r["first_step_s"], "threads": r["threads"],
                "processes": r["processes"], "peak_gflops": r["matmul_peak_gflops"],
                "flops_per_step": None, "param_count": r["param_count"], "torch": r["torch"],
                "interop_threads": r["interop_threads"], "stage_starts": r["point"].get("stage_starts")}
    (r,) = points.run_points([p], config.out, config.timeout, keep_going=True)
    if isinstance(r, PointError):
        raise r
    m, env = r.metrics, r.env
    return {"ms": m["step_time_ms_median"], "first_step_s": m["compile_s"],
            "threads": env["threads_per_process"], "processes": env.get("mpi_ranks", 1),
            "peak_gflops": m["matmul_peak_gflops"], "flops_per_step": m["flops_per_step"],
            "strategy": p.config.parallel.strategy, "devices": p.config.parallel.devices, "env": env,
            "stage_starts": (r.strategy or {}).get("stage_starts")}


def interleaved_rounds(config: PeersConfig, planned: dict[str, list[str]],
           point_of: Callable[[str, str, int], Point | TorchPoint]) -> tuple[dict, dict, list[float]]:
    """--rounds passes over every configuration, the order rotated each round.

    Args:
      planned: {model: [configuration keys]}.
      point_of: (model, key, round) -> the point to measure.
    Returns:
      ({model: {key: [round records]}}, {"model key": why it failed}, the 1-minute load
      average before each round and at the end: was the machine quiet?)
    """
    records = {m: {key: [] for key in keys} for m, keys in planned.items()}
    failed: dict[str, str] = {}
    load = []
    for k in range(config.rounds):
        load.append(os.getloadavg()[0])
        for model, keys in planned.items():
            order = keys[k % len(keys):] + keys[:k % len(keys)]  # rotated: no fixed neighbours
            for key in order:
                if f"{model} {key}" in failed:
                    continue  # failed in an earlier round: it would fail again
                print(f"round {k + 1}/{config.rounds} {model} {key}", flush=True)
                try:
                    rec = measure_round(config, point_of(model, key, k))
                except PointError as e:
                    print(f"  failed: {str(e)[-300:]}", flush=True)
                    failed[f"{model} {key}"] = str(e)[-2000:]
                    continue
                records[model][key].append(rec)
                print(f"  {rec['ms']:.2f} ms/step", flush=True)
    load.append(os.getloadavg()[0])
    return records, failed, load


def data_parallel_study(config: PeersConfig, found: Plan, counts: dict, out: Path) -> tuple[dict, dict]:
    """The data-parallel section: screening, interleaved rounds; (the peers.json dict, failures)."""
    best = screen(config, found)
    for model in found.models:  # refuse a stored best point of other settings before the rounds
        top = best_key(best[model])
        for k in range(config.rounds):
            points.stored(out / f"points/{model}/jaxpar-best/r{k}",
                          round_point(config, model, "jaxpar-best", k, top))
    keys = [key for key, _, _ in CONFIGS if key not in found.skipped]
    records, failed, load = interleaved_rounds(config, {m: keys for m in found.models},
                                   lambda m, key, k: round_point(config, m, key, k, best_key(best[m])))
    labels = {key: (framework, what) for key, framework, what in CONFIGS}
    labels["jaxpar-ranks"] = ("jaxpar", f"{config.rank_strategy}, ranks x 1 thread")
    study = peers_result(config, dataclasses.asdict(found), labels, counts, best, records,
                               failed, load)
    return dataclasses.asdict(study), failed


def model_parallel_section(config: PeersConfig, keys: list[str], skipped: dict) -> dict:
    """The model-parallel section's interleaved rounds: metrics.model_parallel of peers.json."""
    model = config.mp_model
    records, failed, load = interleaved_rounds(config, {model: keys} if keys else {},
                                   lambda m, key, k: peers_mp.mp_point(config, key, k))
    return peers_mp.section(config, records.get(model, {}), skipped,
                            {name.split(" ", 1)[1]: why for name, why in failed.items()}, load)


def previous(out: Path) -> dict | None:
    """OUT/peers.json as a dict, if a complete one is there (a section not run keeps its rows)."""
    try:
        return dataclasses.asdict(results.load(out / "peers.json"))
    except ResultsError:
        return None


def run(config: PeersConfig) -> list[Path] | None:
    """The sections asked for (data-parallel: screening, then interleaved rounds; model-parallel:
    its own interleaved rounds), then OUT/peers.json, summary.md and peers.png.
    Returns their paths, or None when a point other than torch.compile failed."""
    found = resolved_plan(config)
    mp = peers_mp.SECTION in config.sections
    keys, skipped = peers_mp.mp_plan(config) if mp else ([], {})
    counts = check_param_counts(config, tuple(dict.fromkeys(found.models + ((config.mp_model,) if mp else ()))))
    out = results.ensure_writable(config.out)
    if SECTIONS[0] in config.sections:
        prepass(config, found, out)
    check_folders([peers_mp.mp_point(config, key, k) for key in keys for k in range(config.rounds)], out)
    before = previous(out)
    failed = {}
    if SECTIONS[0] in config.sections:
        data, failed = data_parallel_study(config, found, counts, out)
    else:  # only model parallelism: the data-parallel rows stay as they were (or none yet)
        data = before or dataclasses.asdict(peers_result(
            config, {"models": [], "candidates": [], "skipped": {}}, {}, {}, {}, {}, {}, []))
    data["metrics"].pop("model_parallel", None)
    if mp:
        mp_section = data["metrics"]["model_parallel"] = model_parallel_section(config, keys, skipped)
        failed |= mp_section["failed"]
        data["env"]["torch"] = data["env"].get("torch") or mp_section["torch"]  # none yet: the section alone
    elif before and "model_parallel" in before["metrics"]:
        data["metrics"]["model_parallel"] = before["metrics"]["model_parallel"]
    paths = [results.write_atomic(out / "peers.json", results.RunResult(**data).to_json() + "\n"),
             results.write_summary(out / "summary.md", peers_summary(data)),
             peers_bars(data, out)]
    print(paths[1].read_text())
    fatal = [name for name in failed if not name.endswith("torch-compile")]
    return None if fatal else paths


STUDY = Study("peers", "PyTorch beside jaxpar: the same models, optimizer and batch (eager, torch.compile, "
                       "DDP) vs jaxpar single, its best single-process configuration and "
                       "mpi-allreduce, interleaved in one run; and model parallelism (PyTorch's "
                       "pipelining and DTensor vs mpi-pipeline, pipeline, tensor; --sections) "
                       "(needs the `peer` extra); writes "
                       "OUT/peers.json, OUT/summary.md and OUT/peers.png", PeersConfig, QUICK, run)
