"""Command-line parsing: flags built from the config dataclasses, one flag per field.

A field `batch_size` in `DataConfig` is the flag `--batch-size`; its default and help come
from the field, so neither is written twice.
"""

from __future__ import annotations

import argparse

from jaxpar import config as configlib

def _choices() -> dict[str, tuple[str, ...]]:
    """Fields whose values come from a fixed list; each list lives with the code using it."""
    from jaxpar.data import DATASETS
    from jaxpar.models import ACTIVATIONS, MODELS
    from jaxpar.optim import OPTIMIZERS, SCHEDULES
    from jaxpar.parallel import STRATEGIES

    return {"dataset": DATASETS, "model": tuple(MODELS), "strategy": tuple(STRATEGIES),
            "optimizer": OPTIMIZERS, "lr_schedule": SCHEDULES, "activation": ACTIVATIONS,
            "schedule": ("gpipe", "1f1b")}


_TYPES = {"int": int, "float": float, "str": str}


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag or value reported in one line (not the whole usage text)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def add_config_flags(parser: argparse.ArgumentParser, only: set[str] | None = None,
                     defaults: dict | None = None) -> None:
    """Add one flag per config field (or per field in `only`), grouped by section.

    Args:
      defaults: overrides of the dataclass defaults for this command (e.g. bench's dataset).
    """
    choices = _choices()
    defaults = defaults or {}
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for section, f in configlib.flat_fields():
        if only is not None and f.name not in only:
            continue
        if section not in groups:
            groups[section] = parser.add_argument_group(section or "run")
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" ", "").replace("|None", "")
        default = defaults.get(f.name, f.default)
        help_text = f.metadata.get("help", "")
        if kind == "bool":
            groups[section].add_argument(flag, default=default, help=help_text,
                                         action=argparse.BooleanOptionalAction)
            continue
        if "default" not in help_text:
            help_text = f"{help_text} (default: {default})"
        groups[section].add_argument(
            flag, type=_TYPES[kind], default=default, choices=choices.get(f.name),
            help=help_text, metavar=None if f.name in choices else f.name.upper())


def config_from_args(args: argparse.Namespace) -> configlib.TrainConfig:
    """The TrainConfig whose fields the parsed flags name (others keep their defaults)."""
    options = {f.name: getattr(args, f.name) for _, f in configlib.flat_fields()
               if hasattr(args, f.name)}
    return configlib.with_options(configlib.TrainConfig(), **options)


def build_parser(commands: dict[str, dict]) -> argparse.ArgumentParser:
    """Top-level parser with one sub-command per entry of `commands`.

    Args:
      commands: name -> {'help', 'config' (set of field names or None for all, or False),
        'defaults', 'extra' (callable adding command-specific flags)}.
    """
    parser = Parser(
        prog="python -m experiments",
        description="Train image classifiers in parallel with JAX and measure what each kind "
                    "of parallelism buys.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, spec in commands.items():
        p = sub.add_parser(name, help=spec["help"], description=spec["help"])
        if spec.get("config", None) is not False:
            add_config_flags(p, spec.get("config"), spec.get("defaults"))
        if "extra" in spec:
            spec["extra"](p)
    return parser



def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """`bench`'s own flags, beside the config's."""
    p.add_argument("--iters", type=int, default=20, help="timed steps (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--matmul-peak", default=True, action=argparse.BooleanOptionalAction,
                   help="also measure a matmul peak to compare achieved FLOP/s with (seconds on a "
                        "CPU; studies comparing strategies pass --no-matmul-peak) (default: on)")


# The `bench` command, here rather than in __main__ so that study points can parse a bench
# command line without importing the studies.
BENCH = {"help": "time one strategy's training step (synthetic batches); prints and "
                 "optionally writes OUT/result.json",
         "defaults": {"dataset": "synthetic"}, "extra": add_bench_flags}
