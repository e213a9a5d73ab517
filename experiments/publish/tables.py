"""Every generated table of README.md and docs/ by name, each a function of the committed results
(or, for the strategy list, of the strategy classes), written by `python -m experiments report`:
each study's `TABLES` (its tables module), the cost model's, and those of no one study here
(the strategy list, the main results, the line naming where each study's results were
measured).

    TABLES["scaling-devices"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from experiments.cost import tables as cost_tables
from experiments.peers import tables as peers_tables
from experiments.publish import sources
from experiments.publish.markdown import DASH, markdown, num
from experiments.publish.measured_on import machine_line, machine_words
from experiments.studies import batch_size, bounds
from experiments.studies.hparam import tables as hparam_tables
from experiments.studies.machine import tables as machine_tables
from experiments.studies.network import tables as network_tables
from experiments.studies.pipeline import tables as pipeline_tables
from experiments.studies.scaling import tables as scaling_tables
from experiments.studies.strategies import tables as strategies_tables
from experiments.studies.time_to_accuracy import tables as time_to_accuracy_tables
from jaxpar.config import TrainConfig, to_dict
from jaxpar.mesh import format_mesh
from jaxpar.parallel import STRATEGIES


def strategy_list(_: Path) -> str:
    """Every registered strategy: family, what it does, models, default mesh, processes."""
    rows = []
    for name, cls in STRATEGIES.items():
        mesh = format_mesh(cls.default_axes).replace("-1", "all")
        across = "MPI ranks (mpi4jax)" if cls.uses_mpi else "jax.distributed" if cls.multiprocess else DASH
        models = ", ".join(f"`{m}`" for m in cls.models) if cls.models else "any"
        rows.append([f"`{name}`", cls.family, cls.summary, models, f"`{mesh}`", across])
    return markdown(["strategy", "family", "what it does", "models", "default mesh",
                     "across processes"], rows)


def _make_args(config: dict) -> str:
    """`make run` with the options that differ from the defaults, as ARGS."""
    default = to_dict(TrainConfig())
    args = []
    for section in ("model", "data", "optim"):
        for k, v in config[section].items():
            if k in default[section] and v != default[section][k] and k not in ("cache_dir", "data_dir"):
                args.append(f"--{k.replace('_', '-')} {v}")
    return "`make run" + (f" ARGS=\"{' '.join(args)}\"`" if args else "`")


def main_results(data_dir: Path) -> str:
    """The default run and its MLP variant: accuracy, time, step, machine."""
    rows = []
    for name in ("train-cnn", "train-mlp"):
        r = sources.load_source(data_dir, name)
        m, c, env = r["metrics"], r["config"], r["env"]
        rows.append([f"{c['model']['model']}", _make_args(c), f"**{100 * m['test_accuracy']:.2f}%**",
                     num(m["epochs"]), f"{m['wall_s']:,.0f} s", f"{m['step_time_ms_median']:.1f} ms",
                     num(m["images_per_sec"]), machine_words(env)])
    return markdown(["model", "command", "test accuracy", "epochs", "wall time", "median step",
                     "images/s", "machine"], rows)


TABLES: dict[str, Callable[[Path], str]] = {
    "strategy-list": strategy_list,
    "main-results": main_results,
    **scaling_tables.TABLES,
    **strategies_tables.TABLES,
    **pipeline_tables.TABLES,
    **bounds.TABLES,
    **batch_size.TABLES,
    **time_to_accuracy_tables.TABLES,
    **hparam_tables.TABLES,
    **peers_tables.TABLES,
    **cost_tables.TABLES,
    **network_tables.TABLES,
    **machine_tables.TABLES,
    # One line per results folder (the two training runs share theirs; each machine's row
    # names its own).
    **{f"machine-{name.removesuffix('-cnn')}": functools.partial(machine_line, name)
       for name in sources.SOURCES if name not in ("train-mlp", "machines")},
}
