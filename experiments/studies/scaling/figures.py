"""The scaling study's figures: speed-up and efficiency against simulated devices
(scaling_devices.png) and MPI ranks (scaling_ranks.png), drawn from its points alone.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish.plotting import legend_below, plain_log_axis, pyplot, save, strategy_style
from experiments.studies.scaling import speedup


def _scaling_panels(rows: list[dict], x: str, base: str, title: str, path: Path,
                    best: dict | None = None) -> Path:
    """Speed-up (top) and efficiency (bottom) against `x`, one column per (model, mode), a
    line per strategy from its baseline `base` at x = 1, the ideal, and the CPU ceiling.

    Args:
      rows: speedup.device_rows or speedup.rank_rows.
      best: group -> (speed-up of the best single-process point, label), a level line.
    """
    plt = pyplot()
    models = {r["group"]: r["model"] for r in rows}
    panels = sorted(models, key=lambda g: (models[g], g))  # by model, then mode
    names = [n for n in strategy_style([r["strategy"] for r in rows]) if n != base]
    style = strategy_style(names)
    cores = max(r["cores"] for r in rows)
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, group in enumerate(panels):
        here = [r for r in rows if r["group"] == group]
        start = [r for r in here if r["strategy"] == base and r[x] == 1]
        xs = sorted({r[x] for r in here})
        top, bottom = axes[0][col], axes[1][col]
        for k, name in enumerate(names):
            line = start + sorted((r for r in here if r["strategy"] == name), key=lambda r: r[x])
            # A small sideways shift per strategy, so that equal values do not hide each other.
            shift = 1 + 0.025 * (k - (len(names) - 1) / 2)
            px = [r[x] * (shift if r[x] > 1 else 1) for r in line]
            kw = dict(color=style[name]["color"], marker=style[name]["marker"], ls=style[name]["ls"],
                      ms=6, mfc="none", mew=1.4, label=name)
            top.plot(px, [r["speedup"] for r in line], **kw)
            bottom.plot(px, [r["efficiency"] for r in line], **kw)
        top.plot(xs, xs, color="k", lw=1, label=f"ideal (speed-up = {x})")
        top.plot(xs, [min(v, cores) for v in xs], color="firebrick", lw=2, alpha=0.5,
                 label=f"ceiling: {cores} CPU cores")
        bottom.plot(xs, [1] * len(xs), color="k", lw=1)
        bottom.plot(xs, [min(v, cores) / v for v in xs], color="firebrick", lw=2, alpha=0.5)
        heading = f"{here[0]['model']}, {here[0]['mode']} scaling"
        if best and group in best:
            level, label = best[group]
            top.axhline(level, color="grey", ls=":", lw=1.5, label="best single process (all cores)")
            heading += f"\n(dotted: {label}, {level:.2f}x)"
        top.set_title(heading, fontsize=10)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            plain_log_axis(ax.yaxis, base=2)
            ax.set_xticks(xs, [str(v) for v in xs])
            ax.set_xlim(xs[0] / 1.25, xs[-1] * 1.25)
            ax.set_xlabel(x)
            ax.grid(True, which="major", alpha=0.3)
        top.set_ylabel(f"speed-up (images/s over {base} at 1)")
        bottom.set_ylabel(f"efficiency (speed-up / {x})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    legend_below(fig, handles, labels, ncol=len(labels))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def devices_figure(loaded: dict, out: Path) -> Path | None:
    """scaling_devices.png: simulated devices in one process, from the scaling study's points
    (`experiments.publish.sources`: {'points': speedup.load_points(...)}); None when none."""
    devices = [r for r in speedup.device_rows(loaded["points"]) if r["speedup"] == r["speedup"]]  # has a base
    if not devices:
        return None
    env = devices[0]["env"]
    title = (f"Simulated devices in ONE process share {env['cpu_cores']} CPU cores (XLA's "
             f"default threads: {env.get('threads_per_process', env['cores_available'])} per "
             f"process); log scales; jax {env['jax']}")
    return _scaling_panels(devices, "devices", "single", title, out / "scaling_devices.png")


def ranks_figure(loaded: dict, out: Path) -> Path | None:
    """scaling_ranks.png: MPI ranks, one thread each, with the best single process as a level
    line; None when the study has no rank points."""
    ranks = [r for r in speedup.rank_rows(loaded["points"]) if r["speedup"] == r["speedup"]]
    if not ranks:
        return None
    base = {r["group"]: r["images_per_sec"] for r in ranks if r["ranks"] == 1}
    best = {r["group"]: (r["best"]["images_per_sec"] / base[r["group"]],
                         f"best 1 process: {r['best']['strategy']}, {r['best']['devices']} dev")
            for r in ranks if r["best"]}
    title = (f"MPI ranks, 1 XLA thread each, pinned to core rank % {ranks[0]['cores']} "
             f"({ranks[0]['cores']} CPU cores); log scales; jax {ranks[0]['env']['jax']}")
    return _scaling_panels(ranks, "ranks", "single", title, out / "scaling_ranks.png", best)


# (source, its figures: (PNG, draw)); a draw returns None when its points are absent
FIGURES = (("scaling", (("scaling_devices.png", devices_figure), ("scaling_ranks.png", ranks_figure))),)
