"""The network study's figure: images/s against link bandwidth, one line per strategy, one panel
per model, one host's single rank as a horizontal line, and the crossovers named (where the
best strategy sending activations and the best sending gradients change places, and where
two hosts overtake one). Drawn from OUT/network.json alone.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from experiments.publish.plotting import legend_below, pyplot, save, strategy_style
from experiments.studies.network.rows import crossing_words, crossover_words


def _mark(ax, crossing: dict, text: str, y: float, color: str) -> None:
    """A vertical line where a crossover lies (where the lines cross on the axis; its rate
    is named unless unlimited bounds it)."""
    x = crossing["x"]
    ax.axvline(x, color=color, ls=":", lw=1.2)
    ax.annotate(f"{text}\n{crossing_words(crossing)}", (x, y), xycoords=("data", "axes fraction"),
                fontsize=7, color=color, ha="center", va="top",
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))


def network_bandwidth(data: dict, out: Path) -> Path:
    """images/s against bandwidth (log), per model; writes out/network.png.

    Args:
        data: network.json as a dict (experiments.publish.sources).
        out: the PNG folder.
    """
    plt = pyplot()
    m = data["metrics"]
    rows, refs = m["rows"], {r["model"]: r for r in m["references"]}
    models = list(m["crossovers"])
    style = strategy_style(sorted({r["strategy"] for r in rows}))
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        c = m["crossovers"][model]
        x_of = dict(zip(c["bandwidths"], c["x"]))
        for name in style:
            line = sorted((r for r in rows if r["model"] == model and r["strategy"] == name),
                          key=lambda r: x_of[r["bandwidth"]])
            if line:
                ls = "-" if line[0]["sends"] == "activations" else "--"
                ax.plot([x_of[r["bandwidth"]] for r in line], [r["images_per_sec"] for r in line],
                        **{**style[name], "ls": ls}, label=f"{name} ({line[0]['sends']})")
        if model in refs:
            ax.axhline(refs[model]["images_per_sec"], color="k", lw=1.5,
                       label="one host, 1 rank (single)")
        # successive crossovers of one kind lie close together: their labels step down the
        # axis so that neither hides the other
        for i, crossing in enumerate(c["activations_overtake_gradients_at"]):
            _mark(ax, crossing, "activations / gradients", 0.62 - 0.1 * i, "tab:purple")
        for i, crossing in enumerate(c["one_host_overtaken_at"]):
            _mark(ax, crossing, "2 hosts / one host", 0.42 - 0.1 * i, "tab:red")
        ax.set_xscale("log")
        ax.set_xticks(c["x"], c["bandwidths"])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth per host (each way)")
        ax.set_ylabel("images/s")
        words = textwrap.fill("; ".join(crossover_words(c)), 80)
        ax.set_title(f"{model}, global batch {data['config']['batch_size']}, "
                     f"{data['config']['hosts']} hosts\n{words}", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    legend = {}
    for ax in axes[0]:
        legend.update({label: handle for handle, label in zip(*ax.get_legend_handles_labels())})
    legend_below(fig, list(legend.values()), list(legend), ncol=3)
    fig.tight_layout()
    return save(fig, out / "network.png")


FIGURES = (("network", (("network.png", network_bandwidth),)),)
