"""The machine command's figure (machines.png): speed-up over one worker against devices and MPI
ranks on every measured machine, from every figures/data/machines/*/machine.json.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish.measured_on import machine_name
from experiments.publish.plotting import legend_below, plain_log_axis, pyplot, save


def machines_speedup(data: dict, out: Path) -> Path:
    """One panel per model: speed-up over one worker against devices (solid) and MPI ranks
    (dashed) on every measured machine, weak scaling, with the ideal.

    Args:
        data: {'machines': [machine.json dicts, each with 'files']} (experiments.publish.sources).
        out: folder for machines.png.
    """
    plt = pyplot()
    machines = data["machines"]
    models = list(dict.fromkeys(r["model"] for m in machines for r in m["metrics"]["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.4), squeeze=False)
    top = 1
    for ax, model in zip(axes[0], models):
        for i, m in enumerate(machines):
            name = f"{m['files'][0].parent.name} ({machine_name(m['env'])})"
            for part, ls, marker in (("devices", "-", "o"), ("ranks", "--", "s")):
                line = sorted((r for r in m["metrics"]["rows"] if r["model"] == model
                               and r["speedup"] is not None
                               and (r["part"] == part or (part == "ranks" and r["part"] == "devices"
                                                          and r["workers"] == 1))),
                              key=lambda r: r["workers"])
                if len(line) > 1:
                    top = max(top, *(r["workers"] for r in line))
                    ax.plot([r["workers"] for r in line], [r["speedup"] for r in line], ls=ls,
                            marker=marker, color=f"C{i % 10}", mfc="none", label=f"{name}: {part}")
        ax.plot([1, top], [1, top], color="k", lw=1, label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        plain_log_axis(ax.xaxis, base=2, between=False)
        plain_log_axis(ax.yaxis, base=2)
        ax.set_xlabel("devices or MPI ranks (one XLA thread each on a CPU)")
        ax.set_ylabel("speed-up in images/s over one")
        ax.set_title(f"{model}, weak scaling", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    legend = {}  # every line of every panel once (a panel may lack a part another has)
    for ax in axes[0]:
        legend.update({label: handle for handle, label in zip(*ax.get_legend_handles_labels())})
    legend_below(fig, list(legend.values()), list(legend), ncol=2)
    fig.tight_layout()
    return save(fig, out / "machines.png")


FIGURES = (("machines", (("machines.png", machines_speedup),)),)
