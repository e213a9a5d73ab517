"""The cost model (`jaxpar.cost`) on a machine: a strategy's predicted step for a model, a mesh
and a batch (`predict_one`), and every configuration that can place a model ranked
(`plan_rows`); what `predict` and `plan` print, the check and the figures price.

    pred = predict_one(load_profile(DEFAULT_PROFILE), "cnn", "pipeline", 64, 128, "h100", "10gbit")
    rows = plan_rows(profile, "cnn", 2, 128, PROFILED, "measured", None)

The machine: `--device profiled` is the device `--profile` measured (this machine's CPU by
default; figures/data/cost-h100/profile.json is a measured H100): the profiled models' measured
step and layer times, others from their FLOPs at the profile's achieved rate per layer kind, as
if each device had the machine to itself; `--device h100` is an assumed H100
(jaxpar.cost.DEVICES), computing each layer kind at the fraction of its peak the profiled
machine reaches of its own matmul peak. `--link measured` prices collectives as the profile's
simulated devices measured them; 10gbit, 100gbit, nvlink are assumed links (jaxpar.cost.LINKS).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from jaxpar import cost
from jaxpar import mesh as meshlib
from jaxpar.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from jaxpar.cost import Problem
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.pipeline.schedules import SCHEDULES, ScheduleError
from jaxpar.profiling import machine as profiling

DEFAULT_PROFILE = "figures/data/cost/profile.json"   # the committed profile of this machine
LINK_CHOICES = ("measured", *cost.LINKS)
PROFILED = "profiled"   # the device the profile measured
DEVICE_CHOICES = (PROFILED, *cost.DEVICES)
MPI_AXIS = {"mpi-allreduce": "data", "mpi-param-server": "data", "mpi-pipeline": "stage"}


@functools.lru_cache(maxsize=4)
def load_profile(path: str) -> dict:
    if not Path(path).is_file():
        raise ConfigError(f"no profile at {path}; `python -m experiments profile --out {Path(path).parent}` writes it")
    return cost.load_profile(path)


_SOURCES: dict = {}


def compute_source(profile: dict, device: str = PROFILED):
    """(model key, one thread?) -> Compute: measured for profiled models on the profile's
    device, else from the layers' FLOPs at an achieved rate per layer kind. One per profile
    (`load_profile` keeps one dict per file) and device, so its models are built once."""
    if (id(profile), device) not in _SOURCES:
        _SOURCES[(id(profile), device)] = _compute_source(profile, device)
    return _SOURCES[(id(profile), device)]


def _compute_source(profile: dict, device: str):
    models, kinds, peak = profile["models"], profile["kinds"], profile["matmul_peak_gflops"]
    biggest = max(models.values(), key=lambda e: sum(l["param_bytes"] for l in e["layers"]))
    # The update reads and writes parameters, gradients and Adam moments: 7 passes.
    cpu_bandwidth = 7 * sum(l["param_bytes"] for l in biggest["layers"]) / (biggest["update_ms"] / 1000)

    @functools.lru_cache(maxsize=64)
    def compute(key: str, one_thread: bool = False) -> cost.Compute:
        leaves = profiling.param_leaf_bytes(model_config(key))
        if device == PROFILED and key in models:
            return cost.profiled_compute(models[key], key, one_thread, leaves)
        layers = profiling.abstract_layers(model_config(key))
        if device == PROFILED:
            return cost.flops_compute(key, layers, kinds, cpu_bandwidth, "FLOPs at the profile's achieved rates",
                                      leaves)
        d = cost.DEVICES[device]
        rates = {k: r / peak * d.peak_gflops for k, r in kinds.items()}
        return cost.flops_compute(key, layers, rates, d.memory_bytes_per_s,
                                  f"FLOPs at {d.name}'s peak x this CPU's achieved fraction per layer kind", leaves,
                                  d.layer_overhead_s)

    return compute


def model_config(key: str) -> ModelConfig:
    """Inverse of `profiling.model_key`: 'stack-mlp-d8-w256' -> ModelConfig."""
    m = re.fullmatch(r"(.+?)(?:-d(\d+))?(?:-w(\d+))?", key)
    name, depth, width = m.group(1), m.group(2), m.group(3)
    return ModelConfig(name, depth=int(depth) if depth else None, width=int(width) if width else None)


def machine(profile: dict, device: str, link: str, memory: float | None, ranks: bool = False) -> cost.Machine:
    compute = compute_source(profile, device)
    if ranks:
        return cost.mpi_ranks(profile, compute)
    if device == PROFILED and link == "measured":
        if not profile["collectives"]:
            raise ConfigError(f"--link measured: this profile measured no collectives (one "
                              f"{profile['env'].get('backend', '?')} device); pick an assumed link: "
                              f"{', '.join(cost.LINKS)}")
        return cost.simulated(profile, compute, fixed_hidden=True)
    if link == "measured":
        raise ConfigError(f"--link measured is this machine's simulated devices; with --device {device} "
                          f"pick an assumed link: {', '.join(cost.LINKS)}")
    mem = memory or (cost.DEVICES[device].memory_bytes if device in cost.DEVICES else None)
    return cost.cluster(compute, cost.LINKS[link], mem, f"{device} devices over {link}")


def problem(key: str, strategy: str, axes: dict, batch: int, compute: cost.Compute, **options) -> Problem:
    cfg = model_config(key)
    return Problem(compute, axes, batch, model={"model": cfg.model, "depth": cfg.depth, "width": cfg.width},
                   **options)


PIPELINES = ("pipeline", "gems")


def for_stages(machine: cost.Machine, profile: dict, strategy: str, key: str, implementation: str,
               one_thread: bool) -> tuple[cost.Machine, bool]:
    """(`machine`, one_thread), or on simulated CPU devices (one shared pool) that run this
    strategy's stages at once, a core each, `cost.side_by_side`'s (and one thread's compute):
    a pipeline of one program per stage whose model has convolutions."""
    convolutional = any(layer.kind == "conv" for layer in machine.compute(key, one_thread).layers)
    if machine.slots == 1 and strategy in PIPELINES and implementation == "mpmd" and convolutional:
        return cost.side_by_side(profile, compute_source(profile)), True
    return machine, one_thread


def mesh_axes(strategy: str, devices: int, mesh: str = "", layers: int = 0) -> tuple[dict, str]:
    """The axes a prediction uses, and a note when they are not the strategy's own: a pipeline
    on more devices than the model has layers runs as many stages as fit (the largest divisor
    of `devices` up to `layers`) replicated over the rest (data), as `hybrid` places it."""
    cls = STRATEGIES[strategy]
    if cls.uses_mpi:
        return {MPI_AXIS[strategy]: devices}, ""
    if strategy in PIPELINES and not mesh and layers and devices > layers:
        stages = max(s for s in range(1, layers + 1) if devices % s == 0)
        return ({"stage": stages, "data": devices // stages},
                f"{stages} stages (the model has {layers} layers) x {devices // stages} data replicas")
    return cls.mesh_axes(mesh, devices), ""


def on_this_machine(profile: dict, device: str, link: str) -> bool:
    """The profiled CPU's own devices and processes (its terms and intervals apply)."""
    return device == PROFILED and link == "measured" and profile["env"].get("backend", "cpu") == "cpu"


def processes_machine(profile: dict, strategy: str, fitted=None) -> cost.Machine:
    """One pinned single-threaded process per device on this machine: MPI ranks for the MPI
    strategies, jax.distributed processes for the others; with `fitted` terms, the host's
    time a pinned process pays per step (`terms.Terms.host_s`)."""
    compute = compute_source(profile)
    m = (cost.mpi_ranks if STRATEGIES[strategy].uses_mpi else cost.distributed_ranks)(profile, compute)
    return dataclasses.replace(m, step_host_s=fitted.host_s if fitted else 0.0)


def predict_one(profile, key, strategy, devices, batch, device=PROFILED, link="measured", memory=None,
                mesh="", processes: bool = False, fitted=None, validated: bool = False, **options) -> cost.Prediction:
    """`strategy`'s predicted step for model `key` on `devices` (or, `processes`, as many
    single-threaded processes: MPI's or jax.distributed's) of `device` over `link`; on this
    machine with `fitted` terms (`terms.Terms`) its formulation's measured factor and a
    pinned process's host time. `validated`: the caller has asked `refused` already."""
    cls = STRATEGIES[strategy]
    local = on_this_machine(profile, device, link)
    ranks = (cls.uses_mpi and link == "measured") or (processes and local and strategy != "single")
    m = processes_machine(profile, strategy, fitted) if ranks and local else machine(profile, device, link, memory,
                                                                                    ranks=ranks)
    compute = m.compute(key, False)
    axes, note = mesh_axes(strategy, devices, mesh, len(compute.layers))
    if not note and not validated:  # the strategy's own mesh: what it would refuse to run, it is not priced
        refused(strategy, model_config(key), axes, batch, mesh, options)
    # pipelines run as `--pipeline-impl auto` runs them: one program per stage on a CPU
    on_cpu = device == PROFILED and profile["env"].get("backend", "cpu") == "cpu"
    options = {"implementation": "mpmd" if on_cpu else "spmd", **options}
    if ranks and local and not cls.uses_mpi:   # stages part a layer, the CNN split permutes
        options = {"cut_inside": True, "collective_form": "permute" if key == "cnn" else "native", **options}
    if on_cpu and link == "measured":
        m, one_thread = for_stages(m, profile, strategy, key, options["implementation"], False)
        compute = m.compute(key, one_thread)
    work = cls.cost(problem(key, strategy, axes, batch, compute, **options))
    pred = cost.predict(work, m, batch, max(1, cost_devices(axes)))
    factor = fitted.factor(strategy, ranks) if fitted and local else 1.0
    if factor != 1.0:
        pred = dataclasses.replace(pred, compute_s=pred.compute_s * factor, comm_s=pred.comm_s * factor,
                                   bubble_s=pred.bubble_s * factor,
                                   notes=pred.notes + (f"x{factor:.2f}: {strategy}'s measured cost over "
                                                       f"{fitted.twin(strategy, ranks)}'s on this machine",))
    return dataclasses.replace(pred, notes=pred.notes + ((note,) if note else ()))


def refused(strategy: str, model: ModelConfig, axes: dict, batch: int, mesh: str, options: dict) -> None:
    """ConfigError with the strategy's own reasons when it cannot place `model` on `axes`."""
    problems = _refusal_reasons(strategy, model, tuple(sorted(axes.items())), batch, mesh,
                                tuple(sorted(options.items())))
    if problems:
        raise ConfigError(problems)


@functools.lru_cache(maxsize=1024)
def _refusal_reasons(strategy: str, model: ModelConfig, axes: tuple, batch: int, mesh: str, options: tuple) -> str:
    """`refused`'s reasons, once per question (a strategy's check builds the model's shapes:
    `plan` asks the same of every group of the check)."""
    cls = STRATEGIES[strategy]
    try:
        cls.check_model(model)
    except ConfigError as e:
        return str(e)
    config = TrainConfig(data=DataConfig(batch_size=batch), model=model,
                         parallel=ParallelConfig(strategy=strategy, mesh=mesh, **dict(options)))
    return " ".join(cls.check(config, dict(axes)))


def cost_devices(axes: dict) -> int:
    n = 1
    for v in axes.values():
        n *= v
    return n


def parse_bytes(text: str) -> float:
    """'16GB' -> 16e9 (also KB, MB, TB; GiB-style suffixes are powers of 1024)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.I)
    if not m:
        raise ConfigError(f"--memory {text!r}: write a size like 16GB or 80GiB")
    base = 1024 if m.group(3) else 1000
    return float(m.group(1)) * base ** "_KMGT".index((m.group(2) or "_").upper())


def model_key_of(model: str, depth: int | None, width: int | None) -> str:
    return profiling.model_key(ModelConfig(model, depth=depth, width=width))


def describe(pred: cost.Prediction, memory: float | None) -> str:
    fits = "" if memory is None else ("  fits" if pred.memory_bytes <= memory else "  DOES NOT FIT")
    return (f"step {1000 * pred.total_s:.2f} ms = compute {1000 * pred.compute_s:.2f} + communication "
            f"{1000 * pred.comm_s:.2f} + bubble {1000 * pred.bubble_s:.2f}; {pred.images_per_s:,.0f} images/s; "
            f"memory/device {pred.memory_bytes / 1e9:.3f} GB (state {pred.state_bytes / 1e9:.3f} + "
            f"activations {pred.activation_bytes / 1e9:.3f}){fits}")


def device_name(profile: dict, device: str) -> str:
    """'h100 (assumed)', or what the profile measured: 'NVIDIA H100 80GB HBM3 (profiled)'."""
    if device != PROFILED:
        return f"{device} (assumed)"
    env = profile.get("env", {})
    return f"{env.get('device_kind') or env.get('backend', '?')} (profiled)"


PLAN_MICROBATCHES = (1, 2, 4, 8, 16)   # the micro-batches plan weighs for a pipeline


def pipeline_choices(cls, devices: int, batch: int) -> list[dict]:
    """The micro-batches and schedules `plan` weighs for `cls` ({} for a strategy that takes
    neither): every M of PLAN_MICROBATCHES that divides the batch, under every schedule it
    runs (hybrid: the two that one replica of a stage group runs; gems its own)."""
    takes = set(cls.options)
    if "microbatches" not in takes:
        return [{}]
    schedules = (SCHEDULES if cls.name != "hybrid" else ("gpipe", "1f1b")) if "schedule" in takes else (None,)
    return [{"microbatches": m, **({"schedule": s} if s else {})}
            for m in PLAN_MICROBATCHES if batch % m == 0 for s in schedules]


def plan_rows(profile, key, devices, batch, device, link, memory, processes: bool = False, fitted=None,
              **options) -> list[dict]:
    """Every strategy, mesh shape and (for a pipeline) micro-batches and schedule that can place
    `key` on `devices` (or that many single-threaded `processes` on this machine: MPI ranks
    and jax.distributed processes, beside `single` in one process), fastest first, those that
    do not fit in `memory` (per device) marked. `options` fixes micro-batches or a schedule."""
    rows = []
    for name, cls in STRATEGIES.items():
        if cls.models is not None and model_config(key).model not in cls.models:
            continue
        if processes and not (cls.multiprocess or cls.uses_mpi or name == "single"):
            continue
        for spec in mesh_choices(cls, devices):
            n = devices if cls.axes or cls.uses_mpi else 1
            try:   # the mesh asked once; each schedule's own checks come with its replay (ScheduleError)
                axes, note = mesh_axes(name, n, spec, len(compute_source(profile)(key).layers))
                if note:   # a placement the strategy does not run itself (`hybrid`'s, which plan weighs)
                    continue
                refused(name, model_config(key), axes, batch, spec, {})
            except (ConfigError, meshlib.MeshError, ValueError):
                continue
            for choice in pipeline_choices(cls, devices, batch):
                fixed = {**choice, **{k: v for k, v in options.items() if k in choice}}
                try:
                    pred = predict_one(profile, key, name, n, batch, device, link, memory, spec, processes=processes,
                                       fitted=fitted, validated=True, **fixed)
                except (ConfigError, meshlib.MeshError, NotImplementedError, ZeroDivisionError, ValueError,
                        ScheduleError, KeyError):  # KeyError: more stages than the model has layers
                    continue
                mem = memory or machine(profile, device, link, None).memory_bytes
                rows.append({"strategy": name, "mesh": spec or "default", "prediction": pred, **fixed,
                             "fits": mem is None or pred.memory_bytes <= mem})
    return sorted(rows, key=lambda r: (not r["fits"], r["prediction"].total_s))


def mesh_choices(cls, devices: int) -> list[str]:
    """'' (the default) and, for several axes, every split of `devices` over them (powers of 2)."""
    if len(cls.axes) < 2:
        return [""]
    out, sizes = [], [2 ** i for i in range(devices.bit_length()) if devices % 2 ** i == 0]
    for a in sizes:
        for b in sizes:
            c = devices // (a * b)
            if a * b * c == devices and (len(cls.axes) == 3 or c == 1):
                out.append(",".join(f"{ax}={n}" for ax, n in zip(cls.axes, (a, b, c))))
    return out
