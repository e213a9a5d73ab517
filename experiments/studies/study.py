"""What a study is to the CLI: a frozen config dataclass, its quick preset and a run function.

How a new study plugs in (e.g. experiments/studies/bounds.py, or a package like
experiments/studies/pipeline/):
  1. A frozen dataclass config, one field one line, help in each field's metadata
     (`options.option(default, help)`); options other studies have too come from
     `experiments.options` (`out`, `seed`, `val_size`, `iters`, `warmup`, `max_epochs`,
     `timeout`, or any `train` option through `options.train_option(name)`), so they share
     one definition and one default. Lists are `tuple[int, ...]` fields (comma-separated flags).
  2. `QUICK = dataclasses.replace(Config(), ...)`: the seconds-long preset `--quick` selects.
  3. `run(config) -> list[Path] | None` (None: some point failed). Runs in subprocesses are
     `experiments.points.points.Point`s run by `points.run_points(planned, config.out,
     config.timeout)` (or `points.run_rounds`), which resumes a stopped study and refuses a
     folder measured with other settings. Training in-process goes through `jaxpar.train`
     or, for vmapped trials, `experiments.studies.trials`.
  4. `STUDY = Study("name", "help line", Config, QUICK, run)`, and one line in
     `experiments/__main__.py`'s STUDIES. The flags are generated from the fields.
  5. Its results file in `experiments.publish.sources.SOURCES`; its tables as `TABLES`
     (name -> function of the data folder) and its figures as `FIGURES` ((source, ((PNG,
     draw), ...)),), each added in one line to experiments/publish/tables.py and figures.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from experiments.cli import flag_value
from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class Study:
    name: str                                  # the sub-command: python -m experiments NAME
    help: str                                  # what it measures and writes, one paragraph
    config: type                               # its frozen config dataclass
    quick: Any                                 # the --quick preset, a replace of the defaults
    run: Callable[[Any], list[Path] | None]    # None when a point failed


def at_least(config: Any, minimum: int | float, *names: str) -> None:
    """ConfigError naming the flag unless each of `names` (config fields) is >= minimum."""
    for name in names:
        value = getattr(config, name)
        values = value if isinstance(value, tuple) else (value,)
        if any(v < minimum for v in values):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {minimum}, got {flag_value(value)}")


def distinct(config: Any, *names: str) -> None:
    """ConfigError unless each list field of `names` names each value once."""
    for name in names:
        value = getattr(config, name)
        if len(set(value)) != len(value):
            raise ConfigError(f"--{name.replace('_', '-')} lists a value twice: {flag_value(value)}")
