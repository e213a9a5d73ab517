"""Time-to-accuracy study: wall time, steps and images/s to a target *validation* accuracy for
the MLP, the CNN and the ResNet under each strategy, beside each point's state (parameters +
optimizer state) per device: what model parallelism buys in memory per device and what it
costs in time, against data parallelism.

One `train --target-accuracy T` point per (model, strategy) (`experiments.points.points`: its device
or rank count is fixed before JAX starts; jaxpar.train's loop), all with the same global
batch, seed and validation split. By default every strategy that places the model and trains
on single's global batches is a point: the data-parallel ones, fsdp, and the model-parallel
ones (layer-split, pipeline, gems, tensor, tensor-auto; hybrid on the models it takes) on
--devices simulated devices of one process, the MPI ones (mpi-allreduce, mpi-param-server,
mpi-pipeline) on --devices ranks under mpiexec, one device and one pinned XLA thread each (as
rank scaling runs them), so a point uses the same cores either way. Without batch norm they do
the same math, so they follow single's trajectory and differ only in time (local-sgd, which
averages only every k steps, follows its own: name it in --strategies to add it). A strategy
that takes `--schedule` (pipeline, mpi-pipeline, hybrid) runs once per --schedules entry; a
(model, strategy) pair the strategy cannot place (tensor and the MLP; mpi-pipeline and the ResNet,
whose batch norm it does not carry) is skipped and listed.

    python -m experiments time-to-accuracy --max-epochs 12 --timeout 3600 \
        --out figures/data/time_to_accuracy       # the full study (an empty or its own folder)
    python -m experiments time-to-accuracy --models mlp,cnn --out /tmp/tta   # without the ResNet
    python -m experiments time-to-accuracy --quick --out /tmp/tta-quick        # seconds

Writes OUT/<model>-<strategy>/result.json per point (a stopped study resumes: complete points
are not run again), OUT/time_to_accuracy.json (rows, config, env) and OUT/summary.md.
Time to target counts training steps only: compilation (reported apart) and validation are
left out. The learning rate is constant (Adam 1e-3), so the budget (--max-epochs) caps a run
without changing its trajectory (a cosine schedule's length would). Batch norm (the
ResNet's) under a strategy whose step runs per shard or micro-batch
(`Strategy.batch_norm_per_shard`: dp-shard-map, fsdp, pipeline, ...) normalises with those
statistics, so its trajectory can differ from single's.

The targets take most of a real run: `single` reaches them, measured at these settings (real
Fashion-MNIST, batch 128, 5,000 validation examples, seed 0, validation every 100 steps), at
MLP 0.88: step 1,300 (the 4th epoch), CNN 0.91: step 1,300 (steadily above it from step
1,600), ResNet 0.91: step 2,900 (429 steps an epoch, so in its 7th epoch; validation at
0.89-0.909 from step 1,700, so the step a run first shows 0.91 at is partly chance: other
strategies' runs reach it at 2,300-2,900). The ResNet's earlier target, 0.89, `single`
reached at step 1,300, in its 4th epoch.

Duration (a quiet 2-core machine, every convolution on oneDNN): the MLP's 13 points about
4 minutes, the CNN's 15 about 17, the ResNet's 13 to 0.91 about 38 (`single` 54 ms a step,
2-4 minutes a point): an hour in all.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.options import option
from experiments.points import points
from experiments.points.mpi import check_ranks
from experiments.points.points import Point
from experiments.studies.study import Study, at_least
from experiments.studies.time_to_accuracy.tables import time_to_accuracy_summary
from jaxpar import results
from jaxpar.config import TrainConfig, flat_fields, with_options
from jaxpar.errors import ConfigError
from jaxpar.models import has_batch_norm, takes
from jaxpar.parallel import STRATEGIES

RESULTS_FILE = "time_to_accuracy.json"


@dataclass(frozen=True)
class TimeToAccuracyConfig:
    out: str = options.out("time-to-accuracy")
    models: tuple[str, ...] = option(("mlp", "cnn", "resnet"), "models, one group of points each", choices="model")
    # None: every strategy on single's trajectory (`follows_single`) that places the model.
    strategies: tuple[str, ...] | None = option(None, "strategies, one point per model each (default: every strategy that places the model and trains on single's global batches, all but local-sgd)", choices="strategy")
    schedules: tuple[str, ...] = option(("gpipe", "1f1b"), "pipeline schedules: one point each for the strategies that take --schedule", choices="schedule")
    devices: int = option(2, "simulated devices of the points whose strategy spreads over devices (single uses 1), and MPI ranks (one device each) of the multi-process strategies")
    # Validation accuracies that take most of a real run of `single` at lr and val_size below
    # (the steps where it reached them: the module's docstring).
    targets: tuple[str, ...] = option(("mlp=0.88", "cnn=0.91", "resnet=0.91"), "validation accuracy to reach per model, model=accuracy")
    dataset: str = options.train_option("dataset")
    synthetic_size: int = options.train_option("synthetic_size")
    width: int | None = options.train_option("width")
    depth: int | None = options.train_option("depth")
    batch_size: int = options.train_option("batch_size")
    # Constant Adam 1e-3 (not train's 3e-3 cosine default): with a constant rate the budget
    # caps a run without changing its trajectory, and the targets above were measured at it.
    lr: float = options.train_option("lr", 1e-3)
    max_epochs: int = options.max_epochs()
    eval_every: int = options.train_option("eval_every", 100)  # the resolution of steps to target
    val_size: int = options.val_size()
    seed: int = options.seed()
    timeout: int = options.timeout()


# A small MLP on the synthetic set: single, one data-parallel strategy on 2 simulated devices
# and one multi-process strategy on 2 MPI ranks.
QUICK = dataclasses.replace(
    TimeToAccuracyConfig(), models=("mlp",), strategies=("single", "dp-shard-map", "mpi-allreduce"),
    targets=("mlp=0.9",), dataset="synthetic", synthetic_size=3000, width=64, depth=1,
    val_size=500, batch_size=50, eval_every=2, max_epochs=1, timeout=120)


def targets(config: TimeToAccuracyConfig) -> dict[str, float]:
    """{model: validation accuracy} from --targets; every model run needs one."""
    found = {}
    for item in config.targets:
        model, _, value = item.partition("=")
        try:
            found[model.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--targets takes model=accuracy pairs, e.g. mlp=0.84,cnn=0.82; "
                              f"got {item!r}") from None
    bad = {m: a for m, a in found.items() if not 0 < a <= 1}
    if bad:
        raise ConfigError(f"--targets are validation accuracies in (0, 1]; got {bad}")
    missing = [m for m in config.models if m not in found]
    if missing:
        raise ConfigError(f"no target accuracy for {', '.join(missing)}; add it to --targets, "
                          f"e.g. --targets {missing[0]}=0.8")
    return found


def places(strategy: str, model: str) -> bool:
    """`strategy` can place `model` (`Strategy.check_model`: the models it takes, and batch
    norm, as the ResNet has, only where it carries the statistics)."""
    try:
        STRATEGIES[strategy].check_model(model)
    except ConfigError:
        return False
    return True


def follows_single(strategy: str) -> bool:
    """`strategy` trains on single's global batches, so (up to reduction order and batch-norm
    statistics) on single's trajectory; local SGD (--sync-every) averages only every k steps."""
    return "sync_every" not in STRATEGIES[strategy].options


def asked(config: TimeToAccuracyConfig) -> tuple[str, ...]:
    """--strategies, or every strategy on single's trajectory."""
    return config.strategies or tuple(n for n in STRATEGIES if follows_single(n))


def chosen(config: TimeToAccuracyConfig, model: str) -> list[str]:
    """The strategies of `model`'s points: those asked for that place it."""
    return [n for n in asked(config) if places(n, model)]


def _check_strategies(config: TimeToAccuracyConfig) -> None:
    """Each strategy asked for must place at least one of the models; MPI must be installed
    for the multi-process ones."""
    choices = [n for n in STRATEGIES if any(places(n, m) for m in config.models)]
    for name in config.strategies or ():
        if name not in choices:
            raise ConfigError(f"--strategies {name} cannot train --models {','.join(config.models)}; "
                              f"choices: {', '.join(choices)}")
    mpi = tuple({n for m in config.models for n in chosen(config, m) if STRATEGIES[n].uses_mpi})
    if mpi:
        check_ranks(mpi, (config.devices,), config.models)
    for flag in ("width", "depth"):
        users = [m for m in config.models if flag not in takes(m)]
        if getattr(config, flag) is not None and users:
            raise ConfigError(f"--{flag} does not apply to --models {','.join(users)}; run those apart")


def time_to_accuracy_points(config: TimeToAccuracyConfig) -> list[Point]:
    """One train point per (model, strategy[, schedule]); checks every option before any work."""
    goal = targets(config)
    _check_strategies(config)
    at_least(config, 1, "batch_size", "max_epochs", "eval_every", "val_size", "devices")
    found = []
    for model in config.models:
        for strategy in chosen(config, model):
            # MPI strategies: --devices ranks of one device and one pinned XLA thread each (as
            # rank scaling runs them), so the ranks share the cores the simulated devices share.
            ranks = config.devices if STRATEGIES[strategy].uses_mpi else None
            # A strategy whose default mesh is one device (single) runs on one.
            devices = 1 if ranks else math.prod(STRATEGIES[strategy].default_mesh(config.devices).values())
            train = with_options(
                TrainConfig(), dataset=config.dataset, synthetic_size=config.synthetic_size,
                model=model, width=config.width, depth=config.depth, strategy=strategy,
                devices=devices, target_accuracy=goal[model], batch_size=config.batch_size,
                epochs=config.max_epochs, val_size=config.val_size, eval_every=config.eval_every,
                seed=config.seed, lr=config.lr, lr_schedule="constant", progress=False,
                single_thread=ranks is not None)
            if "schedule" not in STRATEGIES[strategy].options:
                found.append(Point(f"{model}-{strategy}", train, ranks=ranks))
                continue
            for schedule in config.schedules:
                found.append(Point(f"{model}-{strategy}-{schedule}", with_options(train, schedule=schedule),
                                   ranks=ranks))
    return found


def skipped(config: TimeToAccuracyConfig) -> list[str]:
    """The (model, strategy) pairs left out: the strategy cannot place the model."""
    return [f"{m}-{s}" for m in config.models for s in asked(config) if not places(s, m)]


def shared_options(configs: list[TrainConfig]) -> dict:
    """The train options (flat names) every point runs with, e.g. lr_schedule, seed."""
    flat = [{f.name: getattr(getattr(c, section) if section else c, f.name)
             for section, f in flat_fields()} for c in configs]
    return {k: v for k, v in flat[0].items() if all(f[k] == v for f in flat)}


def target_row(point: Point, result: results.RunResult, batch_norm: bool) -> dict:
    """One table row from a point's train result; its validation curve for the figure."""
    m, c = result.metrics, point.config
    schedule = c.parallel.schedule if "schedule" in STRATEGIES[c.parallel.strategy].options else None
    return {"model": c.model.model, "strategy": c.parallel.strategy, "schedule": schedule,
            # what tables and figures call the row: the strategy, with its schedule if it has one
            "label": f"{c.parallel.strategy} ({schedule})" if schedule else c.parallel.strategy,
            # MPI points: ranks of one device each
            "devices": c.parallel.devices * (point.ranks or 1), "ranks": point.ranks or 1,
            "target": c.target_accuracy, "reached": m["reached_target"], "steps": m["steps_to_target"],
            "examples": m["examples_to_target"], "time_s": m["time_to_target_s"],
            "images_per_sec": m["images_per_sec_to_target"],
            "images_per_sec_median_step": m["images_per_sec"], "compile_s": m["compile_s"],
            "steps_run": m["steps"], "test_accuracy": m["test_accuracy"],
            "val_accuracy": m["val_accuracy"], "wall_s": m["wall_s"],
            "state_bytes_per_device": m.get("state_bytes_per_device"),
            "temp_bytes_per_device": m.get("memory_per_device", {}).get("temp_bytes"),
            "batch_norm_per_shard": batch_norm and STRATEGIES[c.parallel.strategy].batch_norm_per_shard,
            "curve": [{k: h[k] for k in ("step", "val_accuracy", "train_s")} for h in result.history]}


def run(config: TimeToAccuracyConfig) -> list[Path]:
    """Every point (resuming a stopped study), then OUT/time_to_accuracy.json and OUT/summary.md."""
    planned = time_to_accuracy_points(config)
    outcomes = points.run_points(planned, config.out, config.timeout)
    first = {p.config.model.model: p.config for p in reversed(planned)}  # one per model
    norms = {model: has_batch_norm(c.model) for model, c in first.items()}
    rows = [target_row(p, r, norms[p.config.model.model]) for p, r in zip(planned, outcomes)]
    record = {**dataclasses.asdict(config), "strategies": asked(config), "targets": targets(config),
              "train_options": shared_options([p.config for p in planned])}
    study = results.RunResult(kind="time-to-accuracy", config=record, env=outcomes[0].env,
                              metrics={"rows": rows, "skipped": skipped(config)})
    out = Path(config.out)
    path = results.write_atomic(out / RESULTS_FILE, study.to_json() + "\n")
    table = time_to_accuracy_summary(rows, study.env, record, skipped(config))
    results.write_summary(out / "summary.md", table)
    print(table)
    return [path, out / "summary.md"]


STUDY = Study("time-to-accuracy", "wall time, steps and images/s to a target validation accuracy for "
                                  "MLP, CNN and ResNet per strategy (one train process per point); "
                                  "writes OUT/time_to_accuracy.json and OUT/summary.md",
              TimeToAccuracyConfig, QUICK, run)
