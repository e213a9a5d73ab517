"""Command-line parsing: every flag generated from a frozen dataclass field, one flag per field.

A field `batch_size` is the flag `--batch-size`; its default, help and choices come from the
field, so none is written twice. Two kinds of dataclass have flags:
  - `TrainConfig` (sections data/model/optim/parallel flattened): `train`, `bench`, ...;
  - flat option dataclasses (`BenchOptions`, each study's config): only the flags given on
    the command line are applied, over the defaults or, with `--quick`, the study's preset.

    python -m experiments scaling --help     # the scaling study's flags, from ScalingConfig
"""

from __future__ import annotations

import argparse
import pathlib
import dataclasses
from typing import Any

from experiments.options import BenchOptions
from jaxpar import config as configlib
from jaxpar.errors import ConfigError
# Fields whose values come from a fixed list (jaxpar.validate checks them for every run too).
# A field names its list by its own name, or by `choices` in its metadata (study fields
# listing models).
from jaxpar.validate import CHOICES, flag

_SCALARS = {"int": int, "float": float, "str": str}

# The exit status of an error the user can fix (the CLI prints its message alone, no traceback).
EXIT_USAGE = 2


def _kind(f: dataclasses.Field) -> tuple[str, type | None]:
    """('bool' | 'scalar' | 'list', element type) of a field, from its annotation."""
    kind = str(f.type).replace(" ", "").replace("|None", "").replace("bool|str", "bool")
    if kind.startswith("tuple["):  # tuple[int, ...]: comma-separated on the command line
        return "list", _SCALARS[kind[len("tuple["):].split(",")[0]]
    return ("bool", None) if kind == "bool" else ("scalar", _SCALARS[kind])


def _choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    return CHOICES.get(f.metadata.get("choices", f.name))


def flag_value(value: Any) -> str:
    """A value as its flag takes it: a list comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _add(group, f: dataclasses.Field, default: Any, suppress: bool) -> None:
    """One flag for field `f`. suppress: leave it out of the namespace unless given."""
    kind, element = _kind(f)
    help_text = f.metadata.get("help", "")
    if "default" not in help_text:
        help_text = f"{help_text} (default: {flag_value(default)})"
    help_text = help_text.replace("%", "%%")
    stored = argparse.SUPPRESS if suppress else default
    if kind == "bool":
        words = f.metadata.get("words")
        group.add_argument(flag(f.name), default=stored, help=help_text,
                           **({"action": FlagOrWord, "words": words} if words else
                              {"action": argparse.BooleanOptionalAction}))
        return
    choices = _choices(f) if kind == "scalar" else None
    group.add_argument(flag(f.name), default=stored, type=str if kind == "list" else element,
                       choices=choices, help=help_text,
                       metavar=("A,B,..." if kind == "list" else None if choices else f.name.upper()))


class FlagOrWord(argparse.BooleanOptionalAction):
    """--x (True), --no-x (False), or --x WORD for one of the field's `words` (--resume auto)."""

    def __init__(self, *args, words: tuple[str, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.nargs, self.words = "?", words
        self.metavar = "|".join(words)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            return super().__call__(parser, namespace, values, option_string)
        if option_string.startswith("--no-"):
            parser.error(f"{option_string} takes no value (got {values!r})")
        if values not in self.words:
            parser.error(f"{option_string} takes no value or one of: {', '.join(self.words)} "
                         f"(got {values!r})")
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag or value reported in one line (not the whole usage text)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def add_config_flags(parser: argparse.ArgumentParser, only: set[str] | None = None,
                     defaults: dict | None = None) -> None:
    """Add one flag per TrainConfig field (or per field in `only`), grouped by section.

    Args:
      defaults: overrides of the dataclass defaults for this command (e.g. bench's dataset).
    """
    defaults = defaults or {}
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for section, f in configlib.flat_fields():
        if only is not None and f.name not in only:
            continue
        if section not in groups:
            groups[section] = parser.add_argument_group(section or "run")
        _add(groups[section], f, defaults.get(f.name, f.default), suppress=False)


def config_from_args(args: argparse.Namespace) -> configlib.TrainConfig:
    """The TrainConfig whose fields the parsed flags name (others keep their defaults)."""
    options = {f.name: _value(f, getattr(args, f.name)) for _, f in configlib.flat_fields()
               if hasattr(args, f.name)}
    return configlib.with_options(configlib.TrainConfig(), **options)


def add_option_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field of the flat frozen dataclass `cls` (a study config, BenchOptions);
    the flags given are applied by `options_from_args`."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        _add(group, f, f.default, suppress=True)


def options_from_args(args: argparse.Namespace, base: Any) -> Any:
    """`base` (a defaults or preset instance) with the fields whose flags were given replaced;
    list values parsed and every named choice checked (ConfigError naming the flag)."""
    given = {}
    for f in dataclasses.fields(base):
        if hasattr(args, f.name):
            given[f.name] = _value(f, getattr(args, f.name))
    return dataclasses.replace(base, **given)


def _value(f: dataclasses.Field, text: Any) -> Any:
    kind, element = _kind(f)
    if kind != "list" or not isinstance(text, str):  # a scalar, or a list field's default
        return text
    try:
        values = tuple(element(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag(f.name)} takes comma-separated {element.__name__}s, e.g. "
                          f"{flag_value(f.default) if f.default else '1,2'}; got {text!r}") from None
    choices = _choices(f)
    unknown = [v for v in values if choices is not None and v not in choices]
    if unknown or not values:
        raise ConfigError(f"{flag(f.name)} {text!r}: unknown {', '.join(unknown) or '(none given)'}; "
                          f"choices: {', '.join(choices or ())}")
    return values


def preset(config: Any) -> str:
    """The flags a preset sets (those differing from the defaults), as a command line."""
    defaults = type(config)()
    return " ".join(f"{flag(f.name)} {flag_value(getattr(config, f.name))}" for f in dataclasses.fields(config)
                    if getattr(config, f.name) != getattr(defaults, f.name)).replace("%", "%%")


def build_parser(commands: dict[str, dict]) -> argparse.ArgumentParser:
    """Top-level parser with one sub-command per entry of `commands`.

    Args:
      commands: name -> {'help', 'config' (set of TrainConfig field names, None for all,
        False for none), 'defaults', 'options' (a flat dataclass whose fields become flags),
        'quick' (add --quick), 'extra' (callable adding other flags)}.
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
        if "options" in spec:
            add_option_flags(p, spec["options"], f"{name} options")
        if spec.get("quick"):
            p.add_argument("--quick", action="store_true",
                           help=f"the quick preset (seconds to minutes): {preset(spec['quick'])}; "
                                "flags given beside it override it")
        if "extra" in spec:
            spec["extra"](p)
    return parser


# The `bench` command: TrainConfig's flags (synthetic data by default) and BenchOptions'.
BENCH = {"help": "time one strategy's training step (synthetic batches); prints and "
                 "optionally writes OUT/result.json",
         "defaults": {"dataset": "synthetic"}, "options": BenchOptions}


CLUSTER_ACTIONS = ("up", "down", "status", "exec", "mpiexec")
DEFAULT_HOSTS, DEFAULT_BANDWIDTH = 2, "1gbit"  # the smallest cluster, a common cluster link


def cluster_arguments(parser) -> None:
    """The `cluster` command's arguments: an action, and a command after -- that passes through
    untouched, which the flags generated from dataclasses cannot express."""
    parser.add_argument("action", choices=CLUSTER_ACTIONS, help="up: make the hosts; down: remove them "
                        "and every process in them; status; exec: run a command on --host; "
                        "mpiexec: launch -n ranks of a command over the hosts (exec and mpiexec: "
                        "the command follows --)")
    parser.add_argument("--hosts", type=int, default=DEFAULT_HOSTS,
                        help=f"up: how many hosts (default: {DEFAULT_HOSTS})")
    parser.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH,
                        help="up: each host's link rate, e.g. 100mbit, 1gbit, 10gbit, unlimited "
                             f"(default: {DEFAULT_BANDWIDTH})")
    parser.add_argument("--host", type=int, default=0, help="exec: which host (default: 0)")
    parser.add_argument("-n", type=int, default=DEFAULT_HOSTS, dest="ranks",
                        help=f"mpiexec: how many ranks, in equal blocks over the hosts (default: {DEFAULT_HOSTS})")


NODE_CARRY_ACTIONS = ("prepare", "size", "install", "check")


def node_carry_arguments(parser, carry: str) -> None:
    """`python -m experiments.infra.node_carry`'s arguments: an action and the carried folder
    (a lent node runs it before `python -m experiments` can: it installs what that needs)."""
    parser.add_argument("command", choices=NODE_CARRY_ACTIONS)
    parser.add_argument("--carry", default=carry, help=f"the carried folder (default {carry})")
    parser.add_argument("--no-mpi", action="store_true", help="prepare: carry oneDNN alone")


def revisions_arguments(parser: argparse.ArgumentParser, benches: dict) -> None:
    """The flags of `python -m experiments.infra.revisions` (two checkouts alternated)."""
    parser.add_argument("--old", type=pathlib.Path, required=True, help="the checkout before the change")
    parser.add_argument("--new", type=pathlib.Path, required=True, help="the checkout after it")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default=",".join(benches), help=f"of {', '.join(benches)}")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--timeout", type=float, default=900, help="seconds a bench process may run")
