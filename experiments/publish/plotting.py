"""The helpers every figure shares (matplotlib, Agg backend); each study's figures module draws
its own from its results file alone (`python -m experiments figures`).

House style: log axes where values span decades, the hardware ceiling drawn wherever a
speed-up is, legends outside the axes (never over data), one marker and line style per
strategy so that equal values stay visible.
"""

from __future__ import annotations

from pathlib import Path

from jaxpar.runtime.optional import require
from jaxpar.parallel import FAMILIES, STRATEGIES

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">")
LINES = ("-", "--", "-.", ":")
FAMILY_COLOURS = dict(zip(FAMILIES, ("#6c757d", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")))


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), imported by the functions that
    draw: the commands that draw nothing (`bench`, `train`, `machine`) run without matplotlib."""
    matplotlib = require("matplotlib", "figures (`figures`, and the PNG a study draws)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen before pyplot loads

    return plt


def save(fig, path: Path) -> Path:
    """Write `fig` to `path` as PNG (the one resolution every figure shares) and free it;
    `bbox_inches='tight'` keeps legends placed outside the axes."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def legend_below(fig, handles, labels, ncol: int | None = None, y: float = 0.0) -> None:
    """One legend for the whole figure, under the panels (so it covers no data)."""
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, y), frameon=False,
               ncol=ncol or min(len(labels), 6), fontsize=8)


def strategy_style(names: list[str]) -> dict[str, dict]:
    """Colour, marker and line style per strategy name, in registry order (stable across figures)."""
    order = [n for n in STRATEGIES if n in names] + sorted(set(names) - set(STRATEGIES))
    return {n: {"color": f"C{i % 10}", "marker": MARKERS[i % len(MARKERS)], "ls": LINES[i % len(LINES)]}
            for i, n in enumerate(order)}


def plain_log_axis(axis, base: float = 10, between: bool = True) -> None:
    """Log ticks written as plain numbers (0.25, 1, 4), not powers, with ticks between the
    powers (base 2: 0.75, 1.5, 3; base 10: 2, 5, 20) unless `between` is False, so that a
    short axis still reads."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # pyplot() imported matplotlib

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_formatter(NullFormatter())
    subs = ((1.0, 1.5) if base == 2 else (1.0, 2.0, 5.0)) if between else (1.0,)
    axis.set_major_locator(LogLocator(base=base, subs=subs))
