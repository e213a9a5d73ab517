"""The hparam study's figure (hparam_speedup.png): search time vmapped against one by one, and
every trial's validation accuracy, drawn from its hparam.json alone.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish.plotting import pyplot, save


def hparam_speedup(result: dict, out: Path) -> Path:
    """Left: training wall time of the search (compilation hatched on top), one trial after
    another vs vmapped trials, per (width, depth) group, with the speed-up. Right: every
    trial's validation accuracy per group, the same trial one by one, the best one starred
    (its configuration under the axis).

    Args:
        result: the RunResult dict written by experiments/studies/hparam/study.py (hparam.json).
        out: folder for hparam_speedup.png.
    """
    plt = pyplot()
    cfg, env, groups = result["config"], result["env"], result["metrics"]["groups"]
    x = list(range(len(groups)))
    names = [f"width {g['width']}\ndepth {g['depth']}" for g in groups]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for dx, kind, label, color in ((-0.2, "sequential", "one by one", "C0"),
                                   (0.2, "vmapped", "vmapped trials", "C1")):
        run = [g[f"{kind}_s"] for g in groups]
        comp = [g[f"{kind}_compile_s"] for g in groups]
        ax.bar([i + dx for i in x], run, 0.4, color=color, label=f"{label}: training")
        ax.bar([i + dx for i in x], comp, 0.4, bottom=run, color=color, alpha=0.35, hatch="//",
               label=f"{label}: compilation")
    for i, g in zip(x, groups):
        top = max(g["sequential_s"] + g["sequential_compile_s"], g["vmapped_s"] + g["vmapped_compile_s"])
        ax.text(i, top, f"{g['speedup']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, names)
    ax.set_ylabel("wall time (s)")
    ax.margins(y=0.12)
    ax.set_title(f"Search time; speed-up of training above the bars ({groups[0]['trials']} trials "
                 f"per group, {cfg['steps']} steps of batch {cfg['batch_size']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    for i, g in zip(x, groups):
        acc = g["val_accuracy"]
        xs = [i + 0.3 * (k / max(len(acc) - 1, 1) - 0.5) for k in range(len(acc))]
        ax2.plot(xs, acc, "o", color="C2", alpha=0.6, label="trial (vmapped)" if i == 0 else None)
        ax2.plot(xs, g["val_accuracy_sequential"], "o", mfc="none", color="k", ms=8, mew=0.6,
                 label="same trial, one by one" if i == 0 else None)
        ax2.plot(i, g["best"]["val_accuracy"], "*", ms=14, color="C3", label="best of group" if i == 0 else None)
    best = [f"{n}\nbest: lr {g['best']['lr']:g}, m {g['best']['momentum']:g},\nseed {g['best']['seed']}: "
            f"{g['best']['val_accuracy']:.3f}" for n, g in zip(names, groups)]
    ax2.set_xticks(x, best, fontsize=8)
    ax2.set_xlim(-0.6, len(groups) - 0.4)
    ax2.set_ylabel("validation accuracy after training")
    ax2.set_title(f"Every trial ({cfg['dataset']}, {cfg['val_size']} validation examples)", fontsize=9)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    fig.suptitle(f"hparam search: vmapped trial axis over {cfg.get('devices_used', env.get('device_count', '?'))} "
                 f"{env.get('device_kind', '?')} device(s), {env.get('cpu_cores', '?')} CPU cores; jax "
                 f"{env.get('jax', '?')}", fontsize=10)
    fig.tight_layout()
    return save(fig, out / "hparam_speedup.png")


FIGURES = (("hparam", (("hparam_speedup.png", hparam_speedup),)),)
