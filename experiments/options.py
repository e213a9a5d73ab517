"""Options the commands and studies share: each defined once, with one default and one help.

A study config's field is one line that calls these (`seed: int = options.seed()`), so
`--seed`, `--val-size`, `--iters` or `--out` mean the same thing, with the same default, in
every study; the CLI generates each flag from its field (`experiments/cli.py`).

    iters: int = options.iters()            # --iters, as `bench` and every bench study take it
    val_size: int = options.train_option("val_size")   # TrainConfig's field, default and help
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxpar.config import flat_fields


def option(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field with its CLI help (and e.g. `choices`, a key of cli's choice lists)
    in its metadata; a list default is a tuple (frozen configs)."""
    return field(default=default, metadata={"help": help, **extra})


def train_option(name: str, default: Any = dataclasses.MISSING) -> Any:
    """A study field that is `train`'s option `name` (TrainConfig's field): its help, its
    choices and, unless the study measures something else by design, its default."""
    (f,) = [f for _, f in flat_fields() if f.name == name]
    return option(f.default if default is dataclasses.MISSING else default, f.metadata["help"],
                  **{k: v for k, v in f.metadata.items() if k != "help"})


def out(study: str) -> Any:
    """--out: the study's folder; resuming a stopped study is running it again on it."""
    return option(f"results/{study}", "output folder; a stopped study resumes from the points "
                                      "already in it")


def seed() -> Any:
    return train_option("seed")


def val_size() -> Any:
    return train_option("val_size")


def iters() -> Any:
    return option(20, "timed steps per measured point")


def warmup() -> Any:
    return option(3, "untimed steps before the timed ones (compilation is timed apart)")


def max_epochs() -> Any:
    # Large enough for the batch-size study's smallest batches to reach their target; a
    # budget, not a schedule length where learning rates are constant.
    return option(40, "step budget in epochs of the training split; a point that runs out "
                      "is reported as not reached")


def timeout() -> Any:
    return option(1200, "seconds a point's process may run before it is stopped (a hang must "
                        "not stall the study)")


@dataclass(frozen=True)
class BenchOptions:
    """How `bench` times a step (beside the TrainConfig it times)."""

    iters: int = iters()
    warmup: int = warmup()
    matmul_peak: bool = option(True, "also measure a matmul peak to compare achieved FLOP/s with "
                                     "(seconds on a CPU; studies comparing strategies leave it off)")
    timeline: bool = option(False, "stages as separate programs (layer-split; pipeline and gems "
                                   "with --pipeline-impl mpmd): also record when each device ran "
                                   "which micro-batch's forward and backward in one step, and the "
                                   "measured idle fraction beside the schedule's bubble")
    wire: str | None = option(None, "a network interface (e.g. eth0): also record the bytes and "
                                    "packets it sent and received during the timed steps (its "
                                    "counters; the network study reads them)")
