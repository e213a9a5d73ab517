"""Redraw every figure from committed results alone.

    python -m experiments figures --data figures/data --out figures

Each study's results are read first (a damaged or wrong file exits 2 naming it, before any
PNG is written); then every figure whose results are present is drawn, and every figure
whose results are absent is named with the command that writes them. A data folder that is
missing, or holds no study's results, exits 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.cost import figures as cost_figures
from experiments.options import option
from experiments.peers import figures as peers_figures
from experiments.publish import sources
from experiments.studies import batch_size
from experiments.studies.hparam import figures as hparam_figures
from experiments.studies.machine import figures as machine_figures
from experiments.studies.network import figures as network_figures
from experiments.studies.pipeline import figures as pipeline_figures
from experiments.studies.scaling import figures as scaling_figures
from experiments.studies.strategies import figures as strategies_figures
from experiments.studies.time_to_accuracy import figures as time_to_accuracy_figures
from jaxpar.errors import ResultsError

# Every study's FIGURES: (source in experiments.publish.sources, its figures: (PNG name, draw)),
# drawn in this order; a draw returns the PNG's path, or None when the file lacks its points.
FIGURES = (*pipeline_figures.FIGURES, *batch_size.FIGURES, *hparam_figures.FIGURES,
           *strategies_figures.FIGURES, *time_to_accuracy_figures.FIGURES, *peers_figures.FIGURES,
           *cost_figures.FIGURES, *machine_figures.FIGURES, *network_figures.FIGURES,
           *scaling_figures.FIGURES)


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
        lines = "\n  ".join(sources.missing_line(data_dir, name) for name in absent)
        raise ResultsError(f"no results to draw from in {data_dir} (pass --data with the folder the "
                           f"studies wrote to); expected:\n  {lines}")
    loaded = {name: sources.load_source(data_dir, name) for name, _ in FIGURES if name not in absent}
    out.mkdir(parents=True, exist_ok=True)
    paths, notes = [], []
    for name, figures in FIGURES:
        if name in absent:
            notes.append(f"not drawn: {', '.join(png for png, _ in figures)} "
                         f"({sources.missing_line(data_dir, name)})")
            continue
        for png, draw in figures:
            path = draw(loaded[name], out)
            if path is None:
                notes.append(f"not drawn: {png} (no such points under {sources.path_of(data_dir, name)})")
            else:
                paths.append(path)
    return paths, notes


def run(args: FiguresOptions) -> list[Path]:
    paths, notes = redraw(args.data, args.out)
    for p in paths:
        print(f"wrote {p}")
    for line in notes:
        print(line, file=sys.stderr)
    return paths
