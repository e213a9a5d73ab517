"""Model registry: `make_model(name, seed=..., depth=..., ...)`, `register_model` and `param_count`.

Every model is an nnx.Module called as `model(x, train=False) -> logits [B, num_classes]` on
normalised float32 images [B, H, W, C] (the dataset's `jaxpar.data.Spec`). Defaults live only
in each constructor's signature; `make_model` passes on the options that were given (not
None) and rejects those a model does not take, so a typo'd sweep fails instead of silently
ignoring a flag.

A registered factory (a model class, or any callable returning an nnx.Module) is called with
the keyword arguments among `rngs`, `num_classes`, `in_features` (pixels per image) and the
given OPTIONS that its signature names:

    register_model("mine", MyNet)        # MyNet(*, num_classes, rngs)
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Callable

import jax
from flax import nnx

from jaxpar.data import BUILTIN_SPEC, Spec

from jaxpar.models import layers
from jaxpar.models.batchnorm import BATCH_NORM, FastBatchNorm
from jaxpar.models.cnn import CNN
from jaxpar.models.layers import CONV_IMPLS
from jaxpar.models.mlp import ACTIVATIONS, MLP
from jaxpar.models.resnet import ResNet
from jaxpar.models.stack_mlp import StackMLP
from jaxpar.models.vit import ViT

MODELS: dict[str, Callable[..., nnx.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet": ResNet,
    "stack-mlp": StackMLP,
    "vit": ViT,
}
BUILTIN = tuple(MODELS)  # never replaced by `register_model`

# The options that make_model forwards; which model takes which is read from signatures.
OPTIONS = ("depth", "width", "activation", "batch_norm", "conv_impl")


def register_model(name: str, factory: Callable[..., nnx.Module]) -> str:
    """Make `factory` the model `name` (`--model name`, `ModelConfig(model=name)`); a
    registered name is replaced, a built-in one refused (ValueError)."""
    if not isinstance(name, str) or not name or name in BUILTIN:
        raise ValueError(f"a registered model needs a name other than the built-in "
                         f"{', '.join(BUILTIN)}; got {name!r}")
    if not callable(factory):
        raise ValueError(f"register_model({name!r}, ...) needs a model class or a function "
                         f"returning an nnx.Module, got {type(factory).__name__}")
    MODELS[name] = factory
    return name


def _parameters(name: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters model `name`'s factory names."""
    factory = MODELS[name]
    # A class's __init__, not the class: NNX's metaclass __call__ reports (*args, **kwargs).
    return dict(inspect.signature(factory.__init__ if isinstance(factory, type) else factory).parameters)


def takes(name: str) -> set[str]:
    """The make_model options (of OPTIONS) that model `name`'s constructor accepts."""
    return set(OPTIONS) & set(_parameters(name))


def option_value(name: str, option: str, given=None):
    """`given`, or else model `name`'s own default for `option` (read from its constructor)."""
    if given is not None:
        return given
    return _parameters(name)[option].default


def make_model(name: str, *, seed: int, depth: int | None = None, width: int | None = None,
               activation: str | None = None, batch_norm: bool | None = None,
               conv_impl: str | None = None, spec: Spec = BUILTIN_SPEC) -> nnx.Module:
    """Build model `name` with parameters from `nnx.Rngs(seed)` for images and classes of
    `spec` (the dataset's); None means the model's default."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choices are: {', '.join(MODELS)}")
    given = {k: v for k, v in dict(depth=depth, width=width, activation=activation,
                                    batch_norm=batch_norm, conv_impl=conv_impl).items()
             if v is not None}
    for option in given.keys() - takes(name):
        users = [m for m in MODELS if option in takes(m)]
        raise ValueError(f"model {name!r} does not take {option}; "
                         f"{option} applies to: {', '.join(users)}")
    offered = {"rngs": nnx.Rngs(seed), "num_classes": spec.num_classes,
               "in_features": math.prod(spec.image_shape)}
    named = _parameters(name)
    return MODELS[name](**given, **{k: v for k, v in offered.items() if k in named})


def from_config(cfg, seed: int, spec: Spec = BUILTIN_SPEC) -> nnx.Module:
    """The model a ModelConfig `cfg` describes (its OPTIONS fields; None: the model's default)
    for a dataset of `spec`."""
    return make_model(cfg.model, seed=seed, spec=spec,
                      **{option: getattr(cfg, option) for option in OPTIONS})


def abstract_model(cfg, spec: Spec = BUILTIN_SPEC) -> nnx.Module:
    """`from_config` with shapes only (`nnx.eval_shape`: nothing is allocated), for checks
    before any work. A new module each call; a built-in model's is traced once per
    configuration (a registered one may be replaced under its name: traced each time)."""
    if cfg.model in BUILTIN:
        return nnx.merge(*_abstract_parts(cfg, spec))
    return nnx.eval_shape(lambda: from_config(cfg, seed=0, spec=spec))


@functools.lru_cache(maxsize=256)
def _abstract_parts(cfg, spec: Spec) -> tuple:
    """The graph and shapes of a built-in model: tracing its constructor costs ~0.1 s, and
    `plan` prices hundreds of configurations of a few models."""
    return nnx.split(nnx.eval_shape(lambda: from_config(cfg, seed=0, spec=spec)))


def has_batch_norm(cfg) -> bool:
    """The model `cfg` builds keeps batch-norm statistics (state besides its parameters)."""
    return bool(jax.tree.leaves(nnx.state(abstract_model(cfg), nnx.Not(nnx.Param))))


def forms(cfg) -> dict[str, str | None]:
    """How the model a ModelConfig `cfg` builds computes, as this backend resolves it (what a
    result records in env.ran): `conv`, its convolutions and pooling ("onednn", "cpu" or "xla",
    `--conv-impl` with "auto" resolved: layers.py; None: a model without the option) and
    `batch_norm` ("fast": batchnorm.FastBatchNorm, "flax": nnx.BatchNorm, "own": a model
    without the option chose; None: no batch norm)."""
    conv = None
    if "conv_impl" in takes(cfg.model):
        conv = layers.resolve_conv_impl(option_value(cfg.model, "conv_impl", cfg.conv_impl))
    norm = None
    if has_batch_norm(cfg):
        norm = "own" if conv is None else "fast" if BATCH_NORM[conv] is FastBatchNorm else "flax"
    return {"conv": conv, "batch_norm": norm}


def param_count(model: nnx.Module) -> int:
    """Number of trainable parameters (nnx.Param leaves; BN running stats excluded)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["ACTIVATIONS", "BUILTIN", "CONV_IMPLS", "MODELS", "OPTIONS", "CNN", "MLP", "ResNet",
           "StackMLP", "ViT", "abstract_model", "forms", "from_config", "has_batch_norm", "make_model",
           "option_value", "param_count", "register_model", "takes"]
