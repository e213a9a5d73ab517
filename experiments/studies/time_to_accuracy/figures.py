"""The time-to-accuracy study's figure (time_to_accuracy.png): time to the target and state per
device per strategy, and validation accuracy against training time, from its results file.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish.plotting import legend_below, pyplot, save, strategy_style


def _bars_by_model(ax, rows: list[dict], models: list[str], strategies: list[str], style: dict,
                   value: str, scale: float = 1.0) -> None:
    """One bar per (model, strategy) of row[value] / scale, grouped by model; steps to target written
    on the time bars, 'not reached' where a run ran out of budget."""
    label = lambda r: r.get("label", r["strategy"])  # noqa: E731  (strategy, and its schedule)
    width = 0.8 / len(strategies)
    for i, model in enumerate(models):
        for j, name in enumerate(strategies):
            r = next((r for r in rows if r["model"] == model and label(r) == name), None)
            x = i - 0.4 + (j + 0.5) * width
            if r is None or r.get(value) is None:
                continue
            if value == "time_s" and not r["reached"]:
                ax.text(x, 0, "not\nreached", ha="center", va="bottom", fontsize=7, color=style[name]["color"])
                continue
            ax.bar(x, r[value] / scale, width,
                   color=style[name]["color"],
                   hatch="//" if value == "time_s" and r.get("batch_norm_per_shard") else None)
            if value == "time_s":  # upright, one per bar: 13-15 bars a model side by side
                ax.text(x, r["time_s"] * 1.05, f"{r['steps']:,}", ha="center", va="bottom", fontsize=6,
                        rotation=90)
    ax.set_xticks(range(len(models)),
                  [f"{m}\ntarget {next(r['target'] for r in rows if r['model'] == m):.2f}" for m in models])


def time_to_accuracy_figure(data: dict, out: Path) -> Path:
    """Training time to the target validation accuracy and state per device, bars grouped by
    model (one per strategy, steps written on the time bars), and validation accuracy against
    training time per model.

    Args:
        data: the RunResult dict written by experiments/studies/time_to_accuracy/study.py.
        out: folder for time_to_accuracy.png.
    """
    plt = pyplot()
    rows, env, cfg = data["metrics"]["rows"], data["env"], data["config"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    label = lambda r: r.get("label", r["strategy"])  # noqa: E731  (strategy, and its schedule)
    strategies = list(dict.fromkeys(label(r) for r in rows))
    style = strategy_style(strategies)
    widths = [2.2, 1.4] + [1] * len(models)  # the bars' panel widest: a bar per strategy and model
    fig, axes = plt.subplots(1, len(widths), figsize=(4.2 * sum(widths), 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    bars, memory = axes[0][0], axes[0][1]
    _bars_by_model(bars, rows, models, strategies, style, "time_s")
    bars.set_yscale("log")  # the MLP's seconds beside the ResNet's minutes
    low, high = bars.get_ylim()
    bars.set_ylim(low, high * 2)  # room above the tallest bar for its step count
    bars.set_ylabel("training time to target (s)")
    bars.set_title("Time to target (steps to it above each bar)", fontsize=9)
    _bars_by_model(memory, rows, models, strategies, style, "state_bytes_per_device", scale=1e6)
    memory.set_yscale("log")  # the ResNet holds a tenth of the MLP's state
    memory.set_ylabel("parameters + optimizer state per device (MB)")
    memory.set_title("What each device holds", fontsize=9)
    for ax, model in zip(axes[0][2:], models):
        here = [r for r in rows if r["model"] == model]
        for r in here:
            c = r["curve"]
            ax.plot([p["train_s"] for p in c], [p["val_accuracy"] for p in c], color=style[label(r)]["color"],
                    marker=style[label(r)]["marker"], ls=style[label(r)]["ls"], ms=4)
        ax.axhline(here[0]["target"], color="k", ls="--", lw=1)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(f"{model}: validation accuracy while training", fontsize=9)
    handles = [plt.Line2D([], [], color=style[n]["color"], marker=style[n]["marker"], ls=style[n]["ls"])
               for n in strategies] + [plt.Line2D([], [], color="k", ls="--", lw=1)]
    labels = strategies + ["target"]
    if any(r.get("batch_norm_per_shard") for r in rows):
        handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="k", hatch="//"))
        labels.append("per-shard batch norm (trajectory may differ)")
    fig.suptitle(f"Time to a validation-accuracy target (compilation and validation excluded): global "
                 f"batch {cfg['batch_size']}, seed {cfg['seed']}, validation every {cfg['eval_every']} steps; "
                 f"{env.get('cpu_cores', '?')} CPU cores shared by the simulated devices; jax "
                 f"{env.get('jax', '?')}", fontsize=9)
    fig.tight_layout()
    legend_below(fig, handles, labels, ncol=min(len(labels), 9))
    return save(fig, out / "time_to_accuracy.png")


FIGURES = (("time-to-accuracy", (("time_to_accuracy.png", time_to_accuracy_figure),)),)
