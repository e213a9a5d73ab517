"""Frozen, typed run configuration: one field per CLI flag, each default written once.

The CLI (`experiments/cli.py`) builds its flags from these fields (`--batch-size` for
`batch_size`), so a new option is one new field with a `help` in its metadata. Sweeps are
`dataclasses.replace(...)`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from jaxpar.errors import ConfigError  # noqa: F401  (re-exported: config errors live with configs)


class Rule(NamedTuple):
    """What a field's value must be (None, for optional fields, always passes)."""
    test: Callable[[Any], bool]
    text: str


AT_LEAST_0 = Rule(lambda v: v >= 0, "a whole number >= 0")
AT_LEAST_1 = Rule(lambda v: v >= 1, "a whole number >= 1")
# `math.isfinite` first: NaN fails every comparison, but an infinite lr would pass `> 0`.
POSITIVE = Rule(lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
MOMENTUM = Rule(lambda v: math.isfinite(v) and 0 <= v < 1, "a number in [0, 1)")
RESUME_AUTO = "auto"
RESUME = Rule(lambda v: v in (True, False, RESUME_AUTO), f"--resume, --no-resume or --resume {RESUME_AUTO}")
FRACTION = Rule(lambda v: math.isfinite(v) and 0 < v <= 1, "a fraction in (0, 1], e.g. 0.85")
SECONDS = Rule(lambda v: math.isfinite(v) and v > 0,
               "a number of seconds > 0, e.g. 30 (--no-watchdog turns the watchdog off)")


def _opt(default: Any, help: str, valid: Rule | None = None, **extra: Any) -> Any:
    """A dataclass field with CLI help and the rule its value must meet in its metadata
    (`jaxpar.validate` checks every rule before any work)."""
    return field(default=default, metadata={"help": help, "valid": valid, **extra})


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _opt("fashion_mnist", "fashion_mnist | mnist | synthetic (synthetic: tests and benchmarks only)")
    data_dir: str | None = _opt(None, "folder holding the four IDX files (default: Debian's dataset-fashion-mnist files, else download)")
    cache_dir: str | None = _opt(None, "where the prepared TFDS dataset lives (default: $JAXPAR_CACHE or ~/.cache/jaxpar)")
    val_size: int = _opt(5000, "examples carved from train (seeded) for validation; 0 disables validation", valid=AT_LEAST_0)
    batch_size: int = _opt(128, "global training batch size (all devices together)", valid=AT_LEAST_1)
    eval_batch_size: int = _opt(1000, "batch size for validation and test evaluation", valid=AT_LEAST_1)
    synthetic_size: int = _opt(12000, "training examples of the synthetic dataset (validation is carved from them)", valid=AT_LEAST_1)


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt("cnn", "mlp | cnn | resnet | stack-mlp | vit")
    # None everywhere below: the model's own default (written once, in its constructor).
    depth: int | None = _opt(None, "hidden layers (mlp), blocks (stack-mlp, vit) or blocks per stage (resnet)", valid=AT_LEAST_1)
    width: int | None = _opt(None, "hidden width (mlp, stack-mlp) or model dimension (vit)", valid=AT_LEAST_1)
    activation: str | None = _opt(None, "relu | sigmoid | tanh (mlp, stack-mlp)")
    batch_norm: bool | None = _opt(None, "batch norm after each conv (cnn)")
    conv_impl: str | None = _opt(None, "auto | xla | cpu | onednn: how convolutions, pooling and batch norm are computed (cnn, resnet; default auto: onednn on a CPU where oneDNN is installed, else cpu there; xla (cuDNN) elsewhere)")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = _opt("adam", "sgd | momentum | adam | adagrad | rmsprop (optax's defaults)")
    # 3e-3: in 6 epochs of cosine decay the default CNN reaches 92.6% test accuracy (seeds 0-2:
    # 92.56/92.60/92.58%; 2e-3: 92.1%; 1e-3 took 15 epochs to 92.55%) and the MLP 89.1%.
    lr: float = _opt(3e-3, "peak learning rate", valid=POSITIVE)
    momentum: float = _opt(0.9, "momentum (optimizer=momentum), b1 for adam is optax's default", valid=MOMENTUM)
    lr_schedule: str = _opt("cosine", "constant | cosine (decay to 0 over the run) | warmup-cosine")
    warmup_steps: int = _opt(0, "linear warm-up steps (lr-schedule=warmup-cosine)", valid=AT_LEAST_0)


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = _opt("single", "how one step is placed on devices (default: single, one device)")
    devices: int | None = _opt(None, "simulate this many XLA CPU devices, per process under mpiexec/srun (default: the devices present)", valid=AT_LEAST_1)
    mesh: str = _opt("", "axis sizes, e.g. data=2,tensor=2 (-1 = the rest); default: every device on the strategy's axis")
    steps_per_dispatch: int = _opt(1, "optimizer steps per program call: K > 1 runs K batches' steps written out in one compiled program, so the host dispatches and waits once per K steps (small models on CPU; single, jit/shard_map data-parallel and tensor strategies)", valid=AT_LEAST_1)
    accumulate: int = _opt(1, "gradient accumulation: split each global batch into K sequential chunks (data-parallel strategies)", valid=AT_LEAST_1)
    sync_every: int = _opt(1, "local-sgd: local steps between parameter averages", valid=AT_LEAST_1)
    microbatches: int = _opt(4, "pipeline: micro-batches per global batch (M)", valid=AT_LEAST_1)
    schedule: str = _opt("gpipe", "pipeline schedule: gpipe (fill-drain) | 1f1b | interleaved-1f1b | looped-bfs | zb-h1 (zero bubble: backward split into input and weight gradients) | zbv | dualpipev")
    virtual_stages: int = _opt(0, "pipeline: stages per device (V chunks: interleaved-1f1b, looped-bfs, zb-h1 take any; zbv and dualpipev 2); 0: the schedule's own (2 for interleaved-1f1b, looped-bfs, zbv, dualpipev, else 1)", valid=AT_LEAST_0)
    remat: bool = _opt(False, "pipeline: recompute stage activations in the backward pass")
    pipeline_impl: str = _opt("auto", "pipeline, gems, hybrid: how stages run: spmd (one program, stages as lax.switch branches in a loop) | mpmd (one program per stage, the schedule driven from the host) | auto (mpmd on a CPU, whose control flow runs convolutions on a slow path; spmd elsewhere)")
    # None: stages balanced by XLA's FLOP count of each layer (jaxpar.parallel.pipeline.partition).
    stage_boundaries: tuple[int, ...] | None = _opt(None, "layer-split, pipeline, gems: the first layer of each stage after the first, e.g. 2,5 (default: balanced by FLOPs)")
    distributed: str = _opt("auto", "join processes with jax.distributed: auto (when launched by mpiexec/srun) | mpi | slurm | none")
    # 30 s: far above a step's usual milliseconds to seconds (the watchdog refuses a bound under
    # 10x the measured step), above a short link flap and TCP's retransmissions after it (a 3 s
    # flap held a step up to ~6 s), and a lost host still ends the job within a minute
    # (PyTorch's NCCL watchdog waits 10 minutes by default).
    collective_timeout: float = _opt(30.0, "multi-process runs: the longest a wait for another process may last (a step's collectives and messages, an evaluation batch, a checkpoint; jax.distributed's heartbeat and the pipelines' sockets get a margin more); past it the job ends with exit status 75 naming the rank and host that went silent (docs/faults.md)", valid=SECONDS)
    watchdog: bool = _opt(True, "multi-process runs: end a job stuck longer than --collective-timeout (a thread per process; --no-watchdog: off, e.g. to measure what it costs)")
    single_thread: bool = _opt(False, "one XLA thread per device, each process pinned to as many cores (rank r of D devices: cores r*D .. r*D+D-1, modulo the cores; honest rank and device scaling); CPU backend only")


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # 6 epochs of cosine-decayed Adam at lr 3e-3 take the default CNN past 92.5% test accuracy
    # (5 epochs: 92.4%, 8 at lr 1e-3: 91.6%), in minutes on a 2-core CPU with the fast layers.
    epochs: int = _opt(6, "passes over the training split", valid=AT_LEAST_1)
    steps: int | None = _opt(None, "stop after this many steps instead of --epochs", valid=AT_LEAST_1)
    seed: int = _opt(0, "seeds parameters, the validation split and the data order", valid=AT_LEAST_0)
    out: str | None = _opt(None, "folder for result.json (default: results/<model>-<strategy>-<time>)")
    eval_every: int | None = _opt(None, "validate every N steps (default: once per epoch)", valid=AT_LEAST_1)
    # None: train the whole budget. Set: --epochs/--steps become the budget (and still span
    # the learning-rate schedule), and the run stops at the first validation that reaches it.
    target_accuracy: float | None = _opt(None, "stop at the first validation whose accuracy reaches this, in (0, 1]; needs --val-size > 0", valid=FRACTION)
    progress: bool = _opt(True, "show a live progress bar")
    checkpoint_dir: str | None = _opt(None, "save orbax checkpoints here (reference layout: resumable under any strategy or mesh)")
    checkpoint_every: int | None = _opt(None, "checkpoint every N steps (default: only at the end, on SIGTERM and on Ctrl-C)", valid=AT_LEAST_1)
    # "auto": one command both starts and continues a run, as a requeued or preempted job needs.
    resume: bool | str = _opt(False, "continue from the latest complete checkpoint in --checkpoint-dir; --resume auto: continue when there is one, else start there", valid=RESUME, words=(RESUME_AUTO,))
    # A file, not stdout: the progress bar and errors stay readable, and a reader (the demo)
    # follows one process's records without parsing terminal output.
    events: str | None = _opt(None, "append one JSON object per line to this file: a start record (compile time, collective bytes, memory per device), one per logged step, one per validation and an end record (result path)")


SECTIONS = ("data", "model", "optim", "parallel")
# The options that name files or folders (section, field): what a point file written by one
# process and read by another must carry as paths of this machine (experiments.points).
PATH_FIELDS = ((None, "out"), (None, "checkpoint_dir"), (None, "events"), ("data", "data_dir"),
               ("data", "cache_dir"))


def to_dict(config: TrainConfig) -> dict:
    """Plain nested dict, for results JSON and checkpoints."""
    return dataclasses.asdict(config)


def from_dict(d: dict) -> TrainConfig:
    """Inverse of `to_dict` (unknown keys are an error, so stale files are caught)."""
    sections = {
        "data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "parallel": ParallelConfig}
    # JSON has no tuples: a list is a tuple field's value (--stage-boundaries).
    untuple = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731
    kwargs = {k: (sections[k](**{f: untuple(x) for f, x in v.items()}) if k in sections else v)
              for k, v in d.items()}
    return TrainConfig(**kwargs)


def flat_fields() -> list[tuple[str | None, dataclasses.Field]]:
    """(section or None, field) for every leaf option, in declaration order."""
    out = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in SECTIONS:
            out += [(f.name, sub) for sub in dataclasses.fields(f.default_factory)]
        else:
            out.append((None, f))
    return out


def with_options(config: TrainConfig, **options: Any) -> TrainConfig:
    """`dataclasses.replace` by flat option name, e.g. `with_options(c, batch_size=256)`."""
    updates: dict[str | None, dict] = {}
    known = {f.name: section for section, f in flat_fields()}
    for name, value in options.items():
        if name not in known:
            raise ValueError(f"unknown option {name!r}; options are: {', '.join(sorted(known))}")
        updates.setdefault(known[name], {})[name] = value
    top = updates.pop(None, {})
    for section, vals in updates.items():
        top[section] = dataclasses.replace(getattr(config, section), **vals)
    return dataclasses.replace(config, **top)
