"""`predict` and `plan`: the cost model (`jaxpar.cost`) carried to machines this one cannot hold.

    python -m experiments predict --model cnn --strategy pipeline --devices 64 --link 10gbit
    python -m experiments plan --model stack-mlp --depth 16 --width 8192 --devices 64 \\
        --memory 80GB --link nvlink

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
from dataclasses import dataclass
from pathlib import Path

from experiments.options import option
from jaxpar import cost
from jaxpar import mesh as meshlib
from jaxpar.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from jaxpar.cost import Problem
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES
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
        return cost.simulated(profile, compute)
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


def predict_one(profile, key, strategy, devices, batch, device=PROFILED, link="measured", memory=None,
                mesh="", **options) -> cost.Prediction:
    m = machine(profile, device, link, memory, ranks=STRATEGIES[strategy].uses_mpi and link == "measured")
    compute = m.compute(key, False)
    axes, note = mesh_axes(strategy, devices, mesh, len(compute.layers))
    if not note:  # the strategy's own mesh: what it would refuse to run, it is not priced
        refused(strategy, model_config(key), axes, batch, mesh, options)
    # pipelines run as `--pipeline-impl auto` runs them: one program per stage on a CPU
    on_cpu = device == PROFILED and profile["env"].get("backend", "cpu") == "cpu"
    options = {"implementation": "mpmd" if on_cpu else "spmd", **options}
    if on_cpu and link == "measured":
        m, one_thread = for_stages(m, profile, strategy, key, options["implementation"], False)
        compute = m.compute(key, one_thread)
    work = STRATEGIES[strategy].cost(problem(key, strategy, axes, batch, compute, **options))
    pred = cost.predict(work, m, batch, max(1, cost_devices(axes)))
    return dataclasses.replace(pred, notes=pred.notes + ((note,) if note else ()))


def refused(strategy: str, model: ModelConfig, axes: dict, batch: int, mesh: str, options: dict) -> None:
    """ConfigError with the strategy's own reasons when it cannot place `model` on `axes`."""
    cls = STRATEGIES[strategy]
    cls.check_model(model)
    config = TrainConfig(data=DataConfig(batch_size=batch), model=model,
                         parallel=ParallelConfig(strategy=strategy, mesh=mesh, **options))
    problems = cls.check(config, axes)
    if problems:
        raise ConfigError(" ".join(problems))


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


@dataclass(frozen=True)
class PredictOptions:
    model: str = option("cnn", "model (as train's --model)")
    depth: int = option(0, "depth, where the model takes it (0: its default)")
    width: int = option(0, "width, where the model takes it (0: its default)")
    strategy: str = option("single", "strategy (as train's --strategy)")
    devices: int = option(1, "devices (ranks for the MPI strategies)")
    mesh: str = option("", "axis sizes, as train's --mesh (default: the strategy's)")
    batch_size: int = option(128, "global batch")
    microbatches: int = option(4, "pipeline micro-batches")
    schedule: str = option("gpipe", "pipeline schedule: gpipe | 1f1b")
    device: str = option(PROFILED, "profiled (the device --profile measured: this machine's CPU by "
                                   "default) | h100 (assumed)")
    link: str = option("measured", "measured (this machine's simulated devices) | 10gbit | 100gbit | nvlink")
    memory: str = option("", "memory per device, e.g. 16GB (default: the device's)")
    profile: str = option(DEFAULT_PROFILE, "the machine profile (`python -m experiments profile`)")


@dataclass(frozen=True)
class PlanOptions(PredictOptions):
    devices: int = option(8, "devices to plan for")


def _check(args) -> tuple[dict, str]:
    if args.strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {args.strategy}: choose one of {', '.join(STRATEGIES)}")
    if args.device not in DEVICE_CHOICES or args.link not in LINK_CHOICES:
        raise ConfigError(f"--device one of {', '.join(DEVICE_CHOICES)}; --link one of {', '.join(LINK_CHOICES)}")
    return load_profile(args.profile), model_key_of(args.model, args.depth or None, args.width or None)


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


def predict_command(args: PredictOptions) -> cost.Prediction:
    """`python -m experiments predict`: one strategy's predicted step, printed."""
    profile, key = _check(args)
    memory = parse_bytes(args.memory) if args.memory else None
    pred = predict_one(profile, key, args.strategy, args.devices, args.batch_size, args.device,
                       args.link, memory, args.mesh, microbatches=args.microbatches, schedule=args.schedule)
    print(f"{key} / {args.strategy} on {args.devices} x {device_name(profile, args.device)} over {args.link}, "
          f"batch {args.batch_size}")
    print("  " + describe(pred, memory))
    for note in pred.notes:
        print(f"  ({note})")
    return pred


def plan_rows(profile, key, devices, batch, device, link, memory, **options) -> list[dict]:
    """Every strategy and mesh shape that can place `key` on `devices`, fastest first, those
    that do not fit in `memory` (per device) marked."""
    rows = []
    for name, cls in STRATEGIES.items():
        if cls.models is not None and model_config(key).model not in cls.models:
            continue
        for spec in mesh_choices(cls, devices):
            try:
                pred = predict_one(profile, key, name, devices if cls.axes or cls.uses_mpi else 1, batch, device, link,
                                   memory, spec, **options)
            except (ConfigError, meshlib.MeshError, NotImplementedError, ZeroDivisionError, ValueError):
                continue
            mem = memory or machine(profile, device, link, None).memory_bytes
            rows.append({"strategy": name, "mesh": spec or "default", "prediction": pred,
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


def plan_command(args: PlanOptions) -> list[dict]:
    """`python -m experiments plan`: every strategy and mesh, fastest first, printed."""
    profile, key = _check(args)
    memory = parse_bytes(args.memory) if args.memory else None
    rows = plan_rows(profile, key, args.devices, args.batch_size, args.device, args.link, memory,
                     microbatches=args.microbatches, schedule=args.schedule)
    print(f"{key} on {args.devices} x {device_name(profile, args.device)} over {args.link}, batch {args.batch_size}, "
          f"memory/device {args.memory or 'the device''s'}: fastest first")
    for r in rows:
        p = r["prediction"]
        print(f"  {'  ' if r['fits'] else 'NO'} {r['strategy']:<17} {r['mesh']:<26} {1000 * p.total_s:10.2f} ms "
              f"{p.images_per_s:12,.0f} img/s  {p.memory_bytes / 1e9:9.3f} GB"
              + ("" if r["fits"] else "  does not fit"))
    return rows
