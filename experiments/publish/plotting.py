"""Figures of throughput and scaling, drawn only from results files (matplotlib, Agg backend),
and the helpers every figure shares (experiments/studies/pipeline/figures.py draws the others).

    python -m experiments figures --data figures/data --out figures

House style: log axes where values span decades, the hardware ceiling drawn wherever a
speed-up is, legends outside the axes (never over data), one marker and line style per
strategy so that equal values stay visible.
"""

from __future__ import annotations

from pathlib import Path

from experiments.studies.scaling import speedup
from jaxpar import models
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
    import matplotlib.pyplot as plt

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


# --- scaling over devices and ranks ---------------------------------------------------------
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


def scaling_figures(points: list[dict], out: Path) -> list[Path]:
    """scaling_devices.png (simulated devices in one process) and scaling_ranks.png (MPI
    ranks, one thread each), from `experiments.speedup.load_points` of the scaling study's
    folder; a figure whose points are absent is not drawn (its name is not returned)."""
    paths = []
    devices = [r for r in speedup.device_rows(points) if r["speedup"] == r["speedup"]]  # has a base
    if devices:
        env = devices[0]["env"]
        title = (f"Simulated devices in ONE process share {env['cpu_cores']} CPU cores (XLA's "
                 f"default threads: {env.get('threads_per_process', env['cores_available'])} per "
                 f"process); log scales; jax {env['jax']}")
        paths.append(_scaling_panels(devices, "devices", "single", title, out / "scaling_devices.png"))
    ranks = [r for r in speedup.rank_rows(points) if r["speedup"] == r["speedup"]]
    if ranks:
        base = {r["group"]: r["images_per_sec"] for r in ranks if r["ranks"] == 1}
        best = {r["group"]: (r["best"]["images_per_sec"] / base[r["group"]],
                             f"best 1 process: {r['best']['strategy']}, {r['best']['devices']} dev")
                for r in ranks if r["best"]}
        title = (f"MPI ranks, 1 XLA thread each, pinned to core rank % {ranks[0]['cores']} "
                 f"({ranks[0]['cores']} CPU cores); log scales; jax {ranks[0]['env']['jax']}")
        paths.append(_scaling_panels(ranks, "ranks", "single", title, out / "scaling_ranks.png", best))
    return paths


# --- one model under every strategy ---------------------------------------------------------
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


# --- batch-size regimes (shared with the report's table) ------------------------------------
REGIMES = {"perfect scaling": "#d8f3dc", "diminishing returns": "#fff3b0",
           "maximal data parallelism": "#ffd6d6", "unclassified": "#ffffff"}


def scaling_regimes(batch_sizes: list[int], steps: list[int], slack: float = 1.25) -> list[str]:
    """Shallue et al.'s regime of each point, judged against the whole curve (so one noisy
    point does not flip it). Perfect scaling: a point whose examples used (steps x B) are
    within `slack` of the fewest any batch size needed, up to the last such point; a point
    before that needing more is 'unclassified' (not perfect, and no regime of the paper).
    After it, maximal data parallelism once the steps no longer fall below 0.9x the fewest
    of any smaller batch, and diminishing returns before that. The paper names the regimes
    by eye; these thresholds are ours."""
    examples = [s * b for s, b in zip(steps, batch_sizes)]
    within = [e <= slack * min(examples) for e in examples]
    knee = max(i for i, ok in enumerate(within) if ok)
    out = []
    for i, s in enumerate(steps):
        if i <= knee:
            out.append("perfect scaling" if within[i] else "unclassified")
        elif s >= 0.9 * min(steps[:i]):
            out.append("maximal data parallelism")
        else:
            out.append("diminishing returns")
    return out
