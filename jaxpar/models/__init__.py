"""Model registry: `make_model(name, seed=..., depth=..., ...)` and `param_count`.

Every model is an nnx.Module called as `model(x, train=False) -> logits [B, 10]` on
normalised float32 images [B, 28, 28, 1]. Defaults live only in each constructor's
signature; `make_model` passes on the options that were given (not None) and rejects
those a model does not take, so a typo'd sweep fails instead of silently ignoring a flag.
"""

from __future__ import annotations

import inspect

import jax
from flax import nnx

from jaxpar.models.cnn import CNN
from jaxpar.models.layers import CONV_IMPLS
from jaxpar.models.mlp import ACTIVATIONS, MLP
from jaxpar.models.resnet import ResNet
from jaxpar.models.stack_mlp import StackMLP
from jaxpar.models.vit import ViT

MODELS: dict[str, type[nnx.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet": ResNet,
    "stack-mlp": StackMLP,
    "vit": ViT,
}

# The options that make_model forwards; which model takes which is read from signatures.
OPTIONS = ("depth", "width", "activation", "batch_norm", "conv_impl")


def takes(name: str) -> set[str]:
    """The make_model options (of OPTIONS) that model `name`'s constructor accepts."""
    # __init__, not the class: NNX's metaclass __call__ reports (*args, **kwargs).
    return set(OPTIONS) & set(inspect.signature(MODELS[name].__init__).parameters)


def option_value(name: str, option: str, given=None):
    """`given`, or else model `name`'s own default for `option` (read from its constructor)."""
    if given is not None:
        return given
    return inspect.signature(MODELS[name].__init__).parameters[option].default


def make_model(name: str, *, seed: int, depth: int | None = None, width: int | None = None,
               activation: str | None = None, batch_norm: bool | None = None,
               conv_impl: str | None = None, num_classes: int = 10) -> nnx.Module:
    """Build model `name` with parameters from `nnx.Rngs(seed)`; None means its default."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choices are: {', '.join(MODELS)}")
    given = {k: v for k, v in dict(depth=depth, width=width, activation=activation,
                                    batch_norm=batch_norm, conv_impl=conv_impl).items()
             if v is not None}
    for option in given.keys() - takes(name):
        users = [m for m in MODELS if option in takes(m)]
        raise ValueError(f"model {name!r} does not take {option}; "
                         f"{option} applies to: {', '.join(users)}")
    return MODELS[name](**given, num_classes=num_classes, rngs=nnx.Rngs(seed))


def from_config(cfg, seed: int) -> nnx.Module:
    """The model a ModelConfig `cfg` describes (its OPTIONS fields; None: the model's default)."""
    return make_model(cfg.model, seed=seed, **{option: getattr(cfg, option) for option in OPTIONS})


def abstract_model(cfg) -> nnx.Module:
    """`from_config` with shapes only (`nnx.eval_shape`: nothing is allocated), for checks
    before any work."""
    return nnx.eval_shape(lambda: from_config(cfg, seed=0))


def param_count(model: nnx.Module) -> int:
    """Number of trainable parameters (nnx.Param leaves; BN running stats excluded)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["ACTIVATIONS", "CONV_IMPLS", "MODELS", "OPTIONS", "CNN", "MLP", "ResNet", "StackMLP",
           "ViT", "abstract_model", "from_config", "make_model", "option_value", "param_count", "takes"]
