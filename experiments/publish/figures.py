"""Redraw every figure from committed results alone.

    python -m experiments figures --data figures/data --out figures

Each study's results are read first (a damaged or wrong file exits 2 naming it, before any
PNG is written); then every figure whose results are present is drawn, and every figure
whose results are absent is named with the command that writes them. A data folder that is
missing, or holds no study's results, exits 2.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.publish import plotting as plots
from experiments.cost import figures as plots_cost
from experiments.studies.network import figures as plots_network
from experiments.studies.pipeline import figures as plots_studies
from experiments.publish import sources
from experiments.options import option
from jaxpar.errors import ResultsError

# (source in experiments.publish.sources, the figures drawn from it: (PNG name, draw function))
FIGURES = (
    ("pipeline", (("pipeline_bubble.png", plots_studies.pipeline_bubble),
                  ("pipeline_schedule.png", plots_studies.pipeline_schedule),
                  ("pipeline_timeline.png", plots_studies.pipeline_timeline))),
    ("batch-size", (("batch_size.png", plots_studies.batch_size),)),
    ("hparam", (("hparam_speedup.png", plots_studies.hparam_speedup),)),
    ("strategies", (("strategies.png", plots.strategies_bars),)),
    ("cnn-strategies", (("strategies_cnn.png",
                         functools.partial(plots.strategies_bars, png="strategies_cnn.png")),)),
    ("time-to-accuracy", (("time_to_accuracy.png", plots_studies.time_to_accuracy),)),
    ("peers", (("peers.png", plots_studies.peers_bars),)),
    ("cost", (("cost_predicted.png", plots_cost.predicted_vs_measured),
              ("cost_scaling.png", plots_cost.scaling_extrapolated))),
    ("machines", (("machines.png", plots_studies.machines_speedup),)),
    ("network", (("network.png", plots_network.network_bandwidth),)),
    ("scaling", (("scaling_devices.png", None), ("scaling_ranks.png", None))),  # one call draws both
)


@dataclass(frozen=True)
class FiguresOptions:
    data: str = option("figures/data", "results folder")
    out: str = option("figures", "PNG folder")


def redraw(data_dir: str | Path, out_dir: str | Path) -> tuple[list[Path], list[str]]:
    """Draw every figure whose results are under `data_dir` into `out_dir`.

    Returns:
      (the PNGs written, one line per figure not drawn naming the results it lacks).
    Raises:
      ResultsError: `data_dir` is missing or holds no study's results, or a file is damaged.
    """
    data_dir, out = Path(data_dir), Path(out_dir)
    absent = [name for name, _ in FIGURES if not sources.present(data_dir, name)]
    if len(absent) == len(FIGURES):
        lines = "\n  ".join(sources.missing(data_dir, name) for name in absent)
        raise ResultsError(f"no results to draw from in {data_dir} (pass --data with the folder the "
                           f"studies wrote to); expected:\n  {lines}")
    loaded = {name: sources.load(data_dir, name) for name, _ in FIGURES if name not in absent}
    out.mkdir(parents=True, exist_ok=True)
    paths, notes = [], []
    for name, figures in FIGURES:
        if name in absent:
            notes.append(f"not drawn: {', '.join(png for png, _ in figures)} ({sources.missing(data_dir, name)})")
        elif name == "scaling":
            drawn = plots.scaling_figures(loaded[name]["points"], out)
            paths += drawn
            notes += [f"not drawn: {png} (no such points under {sources.path_of(data_dir, name)})"
                      for png, _ in figures if out / png not in drawn]
        else:
            paths += [draw(loaded[name], out) for _, draw in figures]
    return paths, notes


def run(args: FiguresOptions) -> list[Path]:
    paths, notes = redraw(args.data, args.out)
    for p in paths:
        print(f"wrote {p}")
    for line in notes:
        print(line, file=sys.stderr)
    return paths
