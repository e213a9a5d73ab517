"""One command that measures the machine it runs on: a GPU node, a 16-core CPU, a laptop.

    python -m experiments machine --out figures/data/machines/<name>     # about 8 minutes
    python -m experiments machine --quick --out /tmp/machine              # well under a minute

Synthetic data; needs jax, flax, optax, numpy and rich only, and uses what else is there:
  - the MLP's, CNN's and ResNet's step on one device (`single`, XLA's default threads);
  - PyTorch's eager step of the same models on the same device, when torch imports;
  - data parallelism (--strategy) over 1, 2, 4, ... devices up to every local device: the
    GPUs, or on a CPU one simulated device per core, each device one XLA thread on a core of
    its own (`--single-thread`), weak scaling (--batch-size per device);
  - MPI ranks 1, 2, 4, ... up to the cores (--rank-strategy, one pinned thread each), when
    mpi4jax and mpiexec are installed and the backend is the CPU;
  - the device, cores and versions (each point's `env`).
Every point runs in its own process (experiments.points, experiments.peers.torch_launch), so a
stopped run resumes; points are run in the order above, each within what is left of
--budget, and those that would start past it are listed as skipped. Writes OUT/machine.json
(RunResult kind "machine": one row per point, speed-ups over each part's 1-device or 1-rank
point) and OUT/summary.md; `report` and `figures` read every figures/data/machines/*/.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import BenchOptions, option
from experiments.peers.torch_launch import check_folders, run_torch_point
from experiments.peers.torch_point import TorchPoint, stored_torch_point
from experiments.points import points
from experiments.points.mpi import check_ranks, places_model
from experiments.points.points import Point, PointError
from experiments.studies.machine import rows as machine_rows
from experiments.studies.machine.tables import machine_summary
from experiments.studies.study import Study, at_least, distinct
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES
from jaxpar.runtime import optional

# A point is started only with at least this much of the budget left (process start, compile).
MIN_POINT_S = 10
PROBE_MODEL = "mlp"  # its one-device point runs first and tells the backend, devices and cores


@dataclass(frozen=True)
class MachineConfig:
    out: str = options.out("machine")
    budget: int = option(480, "seconds the whole run may take: points start in order (one device, "
                              "PyTorch, devices, ranks) while this much time is left, the rest "
                              "are listed as skipped")
    models: tuple[str, ...] = option(("mlp", "cnn", "resnet"), "models measured", choices="model")
    width: int | None = options.train_option("width")
    depth: int | None = options.train_option("depth")
    batch_size: int = option(128, "batch per device or rank (weak scaling: the global batch grows "
                                  "with them); the one-device step's batch")
    strategy: str = option("dp-shard-map", "data-parallel strategy over the local devices "
                                           "(explicit all-reduce: the fastest in the scaling study)",
                           choices="strategy")
    device_counts: tuple[int, ...] | None = option(None, "device counts (default: 1, 2, 4, ... and "
                                                         "every local device: the GPUs, or one "
                                                         "simulated CPU device per core)")
    rank_strategy: str = option("mpi-allreduce", "strategy of the MPI rank points", choices="strategy")
    ranks: tuple[int, ...] | None = option(None, "MPI rank counts (default: 1, 2, 4, ... and the "
                                                 "cores; run when mpi4jax is installed and the "
                                                 "backend is the CPU)")
    torch: bool = option(True, "PyTorch's eager step beside each one-device step, when torch imports")
    matmul_peak: bool = option(True, "time a matmul peak with the MLP's one-device step, to compare "
                                     "achieved FLOP/s with (seconds on a CPU)")
    iters: int = options.iters()
    warmup: int = options.warmup()
    timeout: int = options.timeout()


# The MLP alone, small, on 1 and 2 devices and ranks, a few steps: the suite's check (seconds;
# a budget no loaded machine reaches, so that a slow point is not cut).
QUICK = dataclasses.replace(MachineConfig(), budget=600, models=("mlp",), width=64, depth=1,
                            batch_size=32, device_counts=(1, 2), ranks=(1, 2), iters=3, warmup=1,
                            matmul_peak=False, timeout=300)


def check_options(config: MachineConfig) -> None:
    """Every option, before any work (ConfigError naming the flag)."""
    at_least(config, 1, "batch_size", "iters", "budget", "timeout")
    at_least(config, 0, "warmup")
    distinct(config, "models")
    for name in ("device_counts", "ranks"):
        if getattr(config, name) is not None:
            at_least(config, 1, name)
            distinct(config, name)
    if STRATEGIES[config.strategy].family != "data parallel":
        able = [n for n, c in STRATEGIES.items() if c.family == "data parallel"]
        raise ConfigError(f"--strategy {config.strategy}: choose a data-parallel one ({', '.join(able)})")
    if not STRATEGIES[config.rank_strategy].uses_mpi and not STRATEGIES[config.rank_strategy].multiprocess:
        raise ConfigError(f"--rank-strategy {config.rank_strategy} does not run across processes")


def powers_to(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `n`, then `n` itself: (1, 2, 4, 8, 12) for 12."""
    counts, c = [], 1
    while c < n:
        counts.append(c)
        c *= 2
    return tuple(counts + [n])


def machine_train_config(config: MachineConfig, model: str, strategy: str, devices: int, workers: int,
                 one_thread: bool) -> TrainConfig:
    """What a point runs: synthetic data, --batch-size per worker (device or rank)."""
    return with_options(TrainConfig(), dataset="synthetic", model=model, width=config.width,
                        depth=config.depth, strategy=strategy, devices=devices,
                        batch_size=config.batch_size * workers, single_thread=one_thread)


def one_device(config: MachineConfig, model: str) -> Point:
    # The machine's matmul peak once, with the MLP.
    bench = BenchOptions(config.iters, config.warmup, matmul_peak=config.matmul_peak and model == PROBE_MODEL)
    return Point(f"one-device/{model}", machine_train_config(config, model, "single", 1, 1, False), bench,
                 labels={"part": "one-device"})


def device_point(config: MachineConfig, model: str, n: int, cpu: bool) -> Point:
    """n devices of --strategy (1: `single`); on a CPU each simulated device one thread."""
    strategy = "single" if n == 1 else config.strategy
    bench = BenchOptions(config.iters, config.warmup, matmul_peak=False)
    return Point(f"devices/{model}-{strategy}-{n}", machine_train_config(config, model, strategy, n, n, cpu),
                 bench, labels={"part": "devices"})


def rank_point(config: MachineConfig, model: str, r: int) -> Point:
    """r single-threaded ranks of --rank-strategy (1: one `single` process, no launcher)."""
    strategy = "single" if r == 1 else config.rank_strategy
    bench = BenchOptions(config.iters, config.warmup, matmul_peak=False)
    return Point(f"ranks/{model}-{strategy}-r{r}", machine_train_config(config, model, strategy, 1, r, True),
                 bench, r, labels={"part": "ranks"})


def torch_eager(config: MachineConfig, model: str, device: str) -> TorchPoint:
    return TorchPoint(f"torch/{model}", model, "eager", config.batch_size, config.iters,
                      config.warmup, 1, "fused", TrainConfig().optim.lr, matmul_peak=False,
                      device=device)


def ranks_or_why(config: MachineConfig, cpu: bool, cores: int) -> tuple[tuple[int, ...], str | None]:
    """The rank counts to run, or () and why none are."""
    if not cpu:
        return (), "the backend is not the CPU (a rank per core measures CPU cores)"
    ranks = config.ranks or powers_to(cores)
    try:
        check_ranks((config.rank_strategy,), ranks, config.models)
    except ConfigError as e:  # mpi4jax or mpiexec missing: the rest still runs
        return (), str(e)
    return ranks, None


def machine_points(config: MachineConfig, probe: results.RunResult) -> tuple[list[Point | TorchPoint], dict]:
    """Every point after the probe, in the order they run, and {part: why it is skipped}."""
    env = probe.env
    cpu = env["backend"] == "cpu"
    cores = env["cores_available"]
    counts = config.device_counts or (powers_to(cores) if cpu else (1, env["local_device_count"]))
    counts = tuple(sorted(set(counts) | ({1} if cpu else set())))  # 1: the CPU's baseline
    if not cpu and any(n not in (1, env["local_device_count"]) for n in counts):
        raise ConfigError(f"--device-counts {counts}: on {env['backend']} the counts are 1 and every "
                          f"local device ({env['local_device_count']})")
    skipped: dict[str, str] = {}
    planned: list[Point | TorchPoint] = [one_device(config, m) for m in config.models if m != PROBE_MODEL]
    if config.torch and optional.available("torch"):
        planned += [torch_eager(config, m, "cpu" if cpu else "cuda") for m in config.models]
    elif config.torch:
        skipped["torch"] = optional.install_message("torch", "PyTorch's eager step")
    if counts != (1,):
        planned += [device_point(config, m, n, cpu) for n in counts for m in config.models
                    if n > 1 or cpu]  # 1 GPU: the one-device point is the baseline
    else:
        skipped["devices"] = f"one {env['backend']} device"
    ranks, why = ranks_or_why(config, cpu, cores)
    if why:
        skipped["ranks"] = why
    planned += [rank_point(config, m, r) for r in ranks if r > 1 for m in config.models
                if places_model(config.rank_strategy, m)]
    return planned, skipped


def measure_points(config: MachineConfig, planned: list, deadline: float) -> tuple[list[dict], dict, dict]:
    """Run each point while the budget lasts. Returns (records, {folder: why it failed},
    {folder: why not measured} for those not started or stopped by the budget)."""
    records, failed, unstarted = [], {}, {}
    out = Path(config.out)
    for p in planned:
        left = deadline - time.monotonic()
        done = (stored_torch_point if isinstance(p, TorchPoint) else points.stored)(out / p.folder, p)
        if left < MIN_POINT_S and done is None:  # a point measured before costs nothing
            unstarted[p.folder] = f"not started: {config.budget} s budget spent"
            continue
        limit = min(config.timeout, left)
        load = os.getloadavg()[0]  # was the machine quiet? (a point reused from OUT: now)
        try:
            if isinstance(p, TorchPoint):
                print(f"{p.folder}: PyTorch {p.mode} on {p.device}", flush=True)
                records.append(machine_rows.torch_record(p, run_torch_point(p, out, limit), load))
                print(f"  {records[-1]['ms']:.2f} ms/step", flush=True)
            else:
                (r,) = points.run_points([p], out, limit)
                records.append(machine_rows.jaxpar_record(p, r, load))
        except PointError as e:
            if time.monotonic() >= deadline:  # stopped by the budget, not broken
                unstarted[p.folder] = f"stopped: {config.budget} s budget spent"
                print(f"  {unstarted[p.folder]}", flush=True)
                continue
            print(f"  failed: {str(e)[-300:]}", flush=True)
            failed[p.folder] = str(e)[-2000:]
    return records, failed, unstarted


def run(config: MachineConfig) -> list[Path] | None:
    """The probe, every planned point within --budget, then OUT/machine.json and summary.md.
    Returns their paths, or None when a point failed."""
    check_options(config)
    deadline = time.monotonic() + config.budget
    out = results.ensure_writable(config.out)
    load = os.getloadavg()[0]
    (probe,) = points.run_points([one_device(config, PROBE_MODEL)], out, min(config.timeout, config.budget))
    planned, skipped = machine_points(config, probe)
    check_folders(planned, out)  # a folder of other settings is refused before any more work
    records, failed, unstarted = measure_points(config, planned, deadline)
    records.insert(0, machine_rows.jaxpar_record(one_device(config, PROBE_MODEL), probe, load))
    study = machine_rows.machine_result(config, records, probe.env, {**skipped, **unstarted}, failed)
    paths = [results.write_atomic(out / "machine.json", study.to_json() + "\n"),
             results.write_summary(out / "summary.md", machine_summary(dataclasses.asdict(study)))]
    print(paths[1].read_text())
    return None if failed else paths


STUDY = Study("machine", "measure this machine in minutes (synthetic data; PyTorch and MPI when "
                         "installed): each model's step on one device, data parallelism over every "
                         "local device (GPUs, or one simulated CPU device per core), MPI ranks up to "
                         "the cores, PyTorch's eager step; writes OUT/machine.json and "
                         "OUT/summary.md", MachineConfig, QUICK, run)
