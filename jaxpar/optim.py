"""Optimizers (optax) and learning-rate schedules, built from an `OptimConfig`."""

from __future__ import annotations

import optax

from jaxpar.config import OptimConfig

OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "rmsprop")
LR_SCHEDULES = ("constant", "cosine", "warmup-cosine")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate per step. Cosine decays to 0 at `total_steps` (the end of the run)."""
    total_steps = max(int(total_steps), 1)
    if cfg.lr_schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    if cfg.lr_schedule == "cosine":
        return optax.cosine_decay_schedule(cfg.lr, total_steps)
    if cfg.lr_schedule == "warmup-cosine":
        warmup = min(cfg.warmup_steps, total_steps - 1)
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, total_steps)
    raise ValueError(f"unknown --lr-schedule {cfg.lr_schedule!r}; choices: {', '.join(LR_SCHEDULES)}")


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation for `--optimizer` with `--lr-schedule` over `total_steps`."""
    lr = make_schedule(cfg, total_steps)
    if cfg.optimizer == "sgd":
        return optax.sgd(lr)
    if cfg.optimizer == "momentum":
        return optax.sgd(lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return optax.adam(lr)
    # AdaGrad and RMSProp with optax's defaults (AdaGrad's accumulator starts at 0.1, RMSProp
    # decays at 0.9): the seeds compare SGD, Adam and AdaGrad as the libraries ship them.
    if cfg.optimizer == "adagrad":
        return optax.adagrad(lr)
    if cfg.optimizer == "rmsprop":
        return optax.rmsprop(lr)
    raise ValueError(f"unknown --optimizer {cfg.optimizer!r}; choices: {', '.join(OPTIMIZERS)}")
