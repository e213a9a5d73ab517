"""The strategies study's figure: one model under every strategy (images/s, collective bytes,
state and temporary memory per device), drawn from its strategies.json alone; one PNG per
model studied (the stack-mlp's and the CNN's).

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

import functools
from pathlib import Path

from experiments.publish.plotting import FAMILY_COLOURS, legend_below, plain_log_axis, pyplot, save
from jaxpar import models

PANELS = (  # key, title, axis label, scale, log axis
    ("images_per_sec", "Throughput", "images/s (higher is better)", 1, False),
    ("collective_bytes_per_step", "Communication per step",
     "collective MB/step per device or rank (log)", 1e6, True),
    ("state_bytes_per_device", "Parameters + optimizer state", "state MB on the fullest device", 1e6, False),
    ("activation_bytes_per_device", "Temporary (activation) memory",
     "temp MB on the fullest device (log)", 1e6, True),
)


def _bars(ax, rows, key, scale, log, colours) -> None:
    """One panel of strategies_bars; zero values on a log axis are written, not drawn."""
    x = range(len(rows))
    values = [r[key] / scale for r in rows]
    if key == "collective_bytes_per_step":  # measured beside theory
        theory = [r["collective_bytes_theory"] for r in rows]
        theory = [t.get("total") if isinstance(t, dict) else t for t in theory]
        ax.bar([i - 0.2 for i in x], values, 0.4, color=colours)
        ax.bar([i + 0.2 for i in x], [0 if t is None else t / scale for t in theory], 0.4,
               color=colours, alpha=0.35, hatch="//")
        for i, t in zip(x, theory):
            if t is None:
                ax.text(i + 0.2, 0.02, "no\ntheory", ha="center", va="bottom", fontsize=6,
                        transform=ax.get_xaxis_transform())
    else:
        ax.bar(list(x), values, 0.7, color=colours)
    if log:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        ax.set_ylim(min(v for v in values if v > 0) / 2.5, max(values) * 3)  # bars and labels fit
        for i, v in zip(x, values):
            ax.text(i - (0.2 if key == "collective_bytes_per_step" else 0), v if v else 0.02,
                    f"{v:.3g}", ha="center", va="bottom", fontsize=7, rotation=90 if v else 0,
                    transform=ax.transData if v else ax.get_xaxis_transform())


def strategies_bars(data: dict, out: Path, png: str = "strategies.png") -> Path:
    """One model under every strategy: images/s, collective bytes per step (measured beside
    theory, log), state and temporary memory per device (log), bars coloured by family.

    Args:
        data: the strategies.json dict written by experiments/studies/strategies/study.py.
        out: folder for the PNG.
        png: its file name (one per model studied).
    Returns:
        the PNG path.
    """
    plt = pyplot()
    rows, cfg, env = data["metrics"]["rows"], data["config"], data["env"]
    colours = [FAMILY_COLOURS.get(r["family"], "#333333") for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(max(10, 0.8 * len(rows) + 4), 8.5))
    for ax, (key, title, label, scale, log) in zip(axes.flat, PANELS):
        _bars(ax, rows, key, scale, log, colours)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(label)
        ax.set_xticks(range(len(rows)), [r["strategy"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.grid(True, axis="y", which="major", alpha=0.3)
    families = list(dict.fromkeys(r["family"] for r in rows))
    handles = [plt.Rectangle((0, 0), 1, 1, color=FAMILY_COLOURS.get(f, "#333333")) for f in families]
    handles += [plt.Rectangle((0, 0), 1, 1, fc="white", ec="k"),
                plt.Rectangle((0, 0), 1, 1, fc="white", ec="k", alpha=0.5, hatch="//")]
    labels = families + ["measured (compiled program)", "theory"]
    one_thread = data["metrics"].get("one_thread")  # the MPI rows' reference, when measured
    if one_thread:
        handles.append(axes.flat[0].axhline(one_thread["images_per_sec"], color="0.3", ls="-.", lw=1))
        labels.append("single on one thread (each MPI rank's)")
    skipped = sorted({**data["metrics"].get("skipped", {}), **data["metrics"].get("failed", {})})
    note = f"; not run: {', '.join(skipped)}" if skipped else ""
    shape = "".join(f" {k} {cfg[k]}" for k in ("width", "depth")
                    if cfg.get(k) is not None and k in models.takes(cfg["model"]))
    fig.suptitle(f"{cfg['model']}{shape}, global batch "
                 f"{cfg['batch_size']}, {cfg['devices']} devices (MPI: ranks) per strategy{note}\n"
                 f"{env.get('cpu_cores', '?')} CPU cores shared by the simulated devices of each "
                 f"point ({env.get('threads_per_process', '?')} XLA threads; MPI ranks: 1 each); "
                 f"jax {env.get('jax', '?')}", fontsize=9)
    fig.tight_layout()
    legend_below(fig, handles, labels, ncol=4 if one_thread else 7)
    return save(fig, out / png)


FIGURES = (("strategies", (("strategies.png", strategies_bars),)),
           ("cnn-strategies", (("strategies_cnn.png",
                                functools.partial(strategies_bars, png="strategies_cnn.png")),)))
