"""One validation of a whole run's configuration, before any work, for every command.

`train`, `bench` and the studies call `validate(config)` once JAX knows its devices. It checks
every option against the rule written beside its default (`jaxpar.config`: lr > 0 and finite,
momentum in [0, 1), counts >= 1, ...), the choices, the options that do not apply (a model
option the model does not take, another strategy's option, momentum without the momentum
optimizer, warm-up without the warm-up schedule: refused, never silently ignored), then the
combinations: the strategy takes the model, the mesh fits the devices, and the strategy's own
`check` (blocks per stage, micro-batches per shard, width per tensor shard, ...).

    validate(config)   # ConfigError: one paragraph naming each flag as typed and its value
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import config as configlib
from jaxpar import data as datalib
from jaxpar.config import TrainConfig
from jaxpar.runtime.distributed import MODES
from jaxpar.errors import ConfigError, MeshError
from jaxpar.profiling import measure
from jaxpar.mesh import STAGE
from jaxpar.models import ACTIVATIONS, BUILTIN, CONV_IMPLS, MODELS, OPTIONS, abstract_model, takes
from jaxpar.models.sequence import Layer, apply
from jaxpar.optim import LR_SCHEDULES, OPTIMIZERS
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.pipeline.strategy import PIPELINE_IMPLS
from jaxpar.parallel.pipeline.schedules import SCHEDULES as PIPELINE_SCHEDULES


class Live(Sequence):
    """A list of choices read when it is used: registries grow after import (a model or
    dataset registered through `jaxpar.api`)."""

    def __init__(self, read: Callable[[], tuple[str, ...]]):
        self.read = read

    def __getitem__(self, i):
        return self.read()[i]

    def __len__(self) -> int:
        return len(self.read())


# Fields whose values come from a fixed list; each list lives with the code that uses it.
CHOICES: dict[str, Sequence[str]] = {
    "dataset": Live(datalib.dataset_names), "model": Live(lambda: tuple(MODELS)),
    "strategy": tuple(STRATEGIES),
    "optimizer": OPTIMIZERS, "lr_schedule": LR_SCHEDULES, "activation": tuple(ACTIVATIONS),
    "schedule": tuple(PIPELINE_SCHEDULES), "distributed": MODES, "conv_impl": CONV_IMPLS,
    "pipeline_impl": PIPELINE_IMPLS,
}


def flag(name: str) -> str:
    """The command-line spelling of a config field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def validate(config: TrainConfig, devices: int | None = None) -> None:
    """Raise ConfigError listing everything in `config` that cannot work (nothing else runs).

    Args:
      devices: how many devices the run will have (default: `len(jax.devices())`, or
        `--devices` when set in one process), for the mesh checks; a study passes its
        points' counts.
    """
    validate_options(config)  # combinations only make sense once every value is in range
    if devices is None:  # (--devices counts one process's; a global mesh has them all)
        devices = len(jax.devices()) if jax.distributed.is_initialized() else \
            config.parallel.devices or len(jax.devices())
    _raise(combination_problems(config, devices))


def validate_options(config: TrainConfig) -> None:
    """Raise ConfigError for the options each on its own (no device needed). Called before
    processes join, too: a bad value then ends a job before any rank starts its backend (a
    rank still starting when another ended the job printed the broken connection)."""
    _raise(option_problems(config))


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(" ".join(problems) + " Nothing was run or written.")


def option_problems(config: TrainConfig) -> list[str]:
    """Each option on its own: its rule, its choices, and whether it applies to this run."""
    problems = []
    for section, f in configlib.flat_fields():
        value = getattr(getattr(config, section) if section else config, f.name)
        rule = f.metadata.get("valid")
        if value is not None and rule is not None and not rule.test(value):
            problems.append(f"{flag(f.name)} {value} is not valid: it must be {rule.text}.")
        if f.name in CHOICES and value is not None and value not in CHOICES[f.name]:
            problems.append(f"{flag(f.name)} {value!r} is not one of: {', '.join(CHOICES[f.name])}.")
    return problems or not_applying(config)


def not_applying(config: TrainConfig) -> list[str]:
    """Options given a value the chosen model, optimizer, schedule or strategy does not read."""
    problems = []
    model, strategy = config.model.model, STRATEGIES[config.parallel.strategy]
    for option in OPTIONS:
        if getattr(config.model, option) is not None and option not in takes(model):
            users = [m for m in MODELS if option in takes(m)]
            problems.append(f"--model {model} does not take {flag(option)} (it applies to: "
                            f"{', '.join(users)}).")
    defaults = configlib.TrainConfig()
    if config.optim.momentum != defaults.optim.momentum and config.optim.optimizer != "momentum":
        problems.append(f"--momentum applies to --optimizer momentum, not {config.optim.optimizer}.")
    if config.optim.warmup_steps and config.optim.lr_schedule != "warmup-cosine":
        problems.append("--warmup-steps applies to --lr-schedule warmup-cosine, not "
                        f"{config.optim.lr_schedule}.")
    for option in sorted({o for cls in STRATEGIES.values() for o in cls.options}):
        value = getattr(config.parallel, option)
        if value != getattr(defaults.parallel, option) and option not in strategy.options:
            users = [n for n, cls in STRATEGIES.items() if option in cls.options]
            problems.append(f"{flag(option)} {value} applies to --strategy {' or '.join(users)}; "
                            f"--strategy {strategy.name} does not use it (drop it).")
    return problems


def combination_problems(config: TrainConfig, devices: int) -> list[str]:
    """Options together: run length, target, checkpoints, model x strategy x mesh x batch."""
    problems = []
    opt, steps = config.optim, config.steps
    if opt.lr_schedule == "warmup-cosine" and steps is not None and opt.warmup_steps >= steps:
        problems.append(f"--warmup-steps {opt.warmup_steps} must be fewer than --steps {steps}.")
    if config.target_accuracy is not None and config.data.val_size == 0:
        problems.append("--target-accuracy is checked on the validation split; set --val-size > 0.")
    if (config.resume or config.checkpoint_every) and not config.checkpoint_dir:
        what = "--resume" if config.resume else "--checkpoint-every"
        problems.append(f"{what} needs --checkpoint-dir (the folder checkpoints go to).")
    strategy = STRATEGIES[config.parallel.strategy]
    try:
        strategy.check_model(config.model)
        axes = strategy.mesh_axes(config.parallel.mesh, devices)
    except (ConfigError, MeshError) as e:
        return problems + [str(e).rstrip(".") + "."]
    fit = model_problems(config)  # a strategy's own check traces the model: it must fit first
    return problems + (fit or strategy.check(config, axes) + memory_problems(config))


def needs_layers(strategy: str) -> bool:
    """Whether `strategy` cuts the model into stages of consecutive layers (`model.layers()`)."""
    cls = STRATEGIES[strategy]
    return STAGE in (*cls.axes, *cls.default_axes)


def model_problems(config: TrainConfig) -> list[str]:
    """A registered model or dataset checked against each other, shapes only: the model takes
    the dataset's images and gives one logit per class, and lists its layers when the
    strategy cuts it into stages. (The built-in models fit the built-in datasets.)"""
    m, spec = config.model.model, datalib.spec(config.data)
    if m in BUILTIN and config.data.dataset not in datalib.REGISTERED:
        return []
    try:
        model = abstract_model(config.model, spec)
    except Exception as e:  # the user's constructor: any error, reported with what it was given
        return [f"building --model {m} for {spec.num_classes} classes failed "
                f"({type(e).__name__}: {e})."]
    x = jax.ShapeDtypeStruct((2, *spec.image_shape), jnp.float32)
    graphdef, state = nnx.split(model)
    contract = (f"a model is called as model(images, train=bool) on float32 images "
                f"[B, {', '.join(map(str, spec.image_shape))}] and returns logits [B, {spec.num_classes}]")
    try:
        out = jax.eval_shape(lambda s, h: nnx.merge(graphdef, s)(h, train=False), state, x)
    except Exception as e:  # the user's __call__: its own error says what did not fit
        return [f"--model {m} cannot take --dataset {config.data.dataset}'s images: {contract}; "
                f"calling it failed ({type(e).__name__}: {str(e).splitlines()[0][:300]})."]
    if getattr(out, "shape", None) != (2, spec.num_classes):
        return [f"--model {m} returned {getattr(out, 'shape', type(out).__name__)} for 2 images "
                f"of --dataset {config.data.dataset}: {contract}."]
    if needs_layers(config.parallel.strategy):
        return layer_problems(config, model, x, out.shape)
    return []


def layer_problems(config: TrainConfig, model, x, logits_shape) -> list[str]:
    """What stops a model-parallel strategy from cutting the model into stages: a missing or
    wrong `layers()` (docs/library.md, "Model-parallel strategies")."""
    m, strategy = config.model.model, config.parallel.strategy
    need = (f"--strategy {strategy} cuts the model into stages, so --model {m} needs a method "
            f"layers() returning a list of jaxpar.models.sequence.Layer(name, keys, fn) whose fns, "
            f"applied in order as fn(h, train), equal its __call__ and whose keys (paths such as "
            f"('fc1',) or ('blocks', 0)) cover all its state (parameters, batch-norm statistics; docs/library.md)")
    if not callable(getattr(model, "layers", None)):
        return [f"{need}; it has no layers() method (data-parallel strategies need none)."]
    layers = model.layers()
    if not layers or not all(isinstance(layer, Layer) for layer in layers):
        return [f"{need}; its layers() returned {type(layers).__name__} of "
                f"{sorted({type(layer).__name__ for layer in layers or []})}."]
    # The state as stages see it: nested dicts whose keys are attribute names and list indices.
    paths = [tuple(k.key for k in path) for path, _ in
             jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))]
    owned = [tuple(key) for layer in layers for key in layer.keys]
    orphans = [p for p in paths if not any(p[:len(k)] == k for k in owned)]
    if orphans:
        return [f"{need}; no layer's keys hold {', '.join(map(str, orphans[:3]))}."]
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s, h: apply(nnx.merge(graphdef, s).layers(), h), state, x)
    if out.shape != logits_shape:
        return [f"{need}; applied in order they give {out.shape}, not the logits' {logits_shape}."]
    return []


def memory_problems(config: TrainConfig) -> list[str]:
    """A model whose parameters alone (shapes traced, nothing allocated) outgrow the memory of
    one device: refused here rather than failing deep inside XLA's allocator."""
    m = config.model
    need = measure.tree_bytes(nnx.state(abstract_model(m, datalib.spec(config.data)), nnx.Param))
    have = device_memory_bytes()
    if need > have:
        given = "".join(f" {flag(o)} {getattr(m, o)}" for o in ("width", "depth") if getattr(m, o))
        return [f"--model {m.model}{given} has {need / 2**30:,.0f} GiB of parameters, more than "
                f"one device's {have / 2**30:,.1f} GiB; lower --width or --depth."]
    return []


def device_memory_bytes() -> int:
    """What one device can hold: the accelerator's own limit, or the host's RAM on a CPU."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except jax.errors.JaxRuntimeError:  # a backend that keeps no statistics
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_schedule(config: TrainConfig, total_steps: int) -> None:
    """The checks that need the run's length in steps (known once the data is loaded)."""
    warmup = config.optim.warmup_steps
    if config.optim.lr_schedule == "warmup-cosine" and warmup >= total_steps:
        raise ConfigError(f"--warmup-steps {warmup} must be fewer than the run's {total_steps} "
                          "steps; lower it or train longer (--epochs, --steps).")
