"""Figures drawn only from results files (matplotlib, Agg backend).

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path, tight_layout: bool = True) -> Path:
    """Write `fig` to `path` as PNG (the one resolution every figure shares) and free it."""
    if tight_layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def pipeline_bubble(result: dict, out: Path) -> Path:
    """2x2 panels vs micro-batches M, GPipe vs 1F1B: bubble fraction from the schedule with the
    (S-1)/(M+S-1) line; measured images/s; peak micro-batches in flight; measured temporary
    memory per device (XLA's memory analysis of the compiled step).

    Args:
        result: the RunResult dict written by experiments/pipeline_study.py (pipeline.json).
        out: folder for pipeline_bubble.png.
    Returns:
        the PNG path.
    """
    data, cfg = result["metrics"], result["config"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    (bub, tput), (flight, mem) = axes
    for name, mark in (("gpipe", "o"), ("1f1b", "x")):
        rows = [r for r in data["rows"] if r["schedule"] == name]
        ms = [r["M"] for r in rows]
        bub.plot(ms, [r["bubble"] for r in rows], mark, ms=8, label=f"{name} (schedule)")
        flight.plot(ms, [r["peak_in_flight"] for r in rows], mark + "-", label=name)
        timed = [r for r in rows if r.get("images_per_sec")]
        tput.plot([r["M"] for r in timed], [r["images_per_sec"] for r in timed], mark + "-", label=name)
        mem.plot([r["M"] for r in timed], [r["temp_bytes"] / 2 ** 20 for r in timed], mark + "-", label=name)
    theory = [r for r in data["rows"] if r["schedule"] == "gpipe"]
    bub.plot([r["M"] for r in theory], [r["theory"] for r in theory], "k--", label="(S-1)/(M+S-1)")
    bub.set_ylabel("bubble fraction (idle stage-slots)")
    tput.set_ylabel("images/s (measured)")
    flight.set_ylabel("peak micro-batches in flight per stage")
    mem.set_ylabel("temp memory per device (MiB, measured)")
    ms_all = sorted({r["M"] for r in data["rows"]})
    for a in axes.flat:
        a.set_xscale("log", base=2)
        a.set_xticks(ms_all, [str(m) for m in ms_all])
        a.set_xlim(ms_all[0] / 1.3, ms_all[-1] * 1.3)
        a.set_xlabel("micro-batches M")
        a.legend(fontsize=8)
    for a in (tput, mem):
        if not any(r.get("images_per_sec") for r in data["rows"]):
            a.text(0.5, 0.5, "not measured (--no-measure)", ha="center", transform=a.transAxes)
    env = data.get("point_env") or result.get("env", {})
    fig.suptitle(f"Pipeline, S={data['stages']} stages on {data['stages']} simulated CPU devices sharing "
                 f"{env.get('cpu_cores', '?')} cores; stack-mlp width {cfg.get('width')} x "
                 f"{cfg.get('depth')} blocks, batch {cfg.get('batch_size')}", fontsize=10)
    return _save(fig, out / "pipeline_bubble.png")


def pipeline_schedule(result: dict, out: Path) -> Path:
    """GPipe-paper-style picture: devices as rows, F/B micro-batch blocks over time."""
    data = result["metrics"]
    names = list(data["tables"])
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.2 + 0.5 * data["stages"] * len(names)))
    for ax, name in zip(axes, names):
        table = data["tables"][name]["table"]
        for t, row in enumerate(table):
            for s, slot in enumerate(row):
                if slot:
                    kind, m = slot
                    ax.add_patch(plt.Rectangle((t, s), 1, 1, ec="k",
                                               fc="#8ecae6" if kind == "F" else "#ffb703"))
                    ax.text(t + 0.5, s + 0.5, f"{kind}{m}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(table))
        ax.set_ylim(data["stages"], 0)
        ax.set_yticks([s + 0.5 for s in range(data["stages"])])
        ax.set_yticklabels([f"device {s}" for s in range(data["stages"])])
        ax.set_title(f"{name}, M={data['tables'][name]['M']} (blank = bubble)")
    axes[-1].set_xlabel("time slot")
    return _save(fig, out / "pipeline_schedule.png")


def hparam_speedup(result: dict, out: Path) -> Path:
    """Left: training wall time of the search (compilation excluded, drawn on top, hatched),
    one trial after another vs vmapped trials, per (width, depth) group, with the speed-up.
    Right: every trial's validation accuracy per group, the best one starred.

    Args:
        result: the RunResult dict written by experiments/hparam.py (hparam.json).
        out: folder for hparam_speedup.png.
    """
    cfg, env, groups = result["config"], result["env"], result["metrics"]["groups"]
    x = list(range(len(groups)))
    names = [f"width {g['width']}\ndepth {g['depth']}" for g in groups]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dx, kind, label, color in ((-0.2, "sequential", "one by one", "C0"), (0.2, "vmapped", "vmapped trials", "C1")):
        run = [g[f"{kind}_s"] for g in groups]
        comp = [g[f"{kind}_compile_s"] for g in groups]
        ax.bar([i + dx for i in x], run, 0.4, color=color, label=f"{label} (training)")
        ax.bar([i + dx for i in x], comp, 0.4, bottom=run, color=color, alpha=0.35, hatch="//",
               label=f"{label} (compilation)")
    for i, g in zip(x, groups):
        top = max(g["sequential_s"] + g["sequential_compile_s"], g["vmapped_s"] + g["vmapped_compile_s"])
        ax.text(i, top, f"{g['speedup']:.1f}x\n(training)", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel("wall time (s)")
    ax.margins(y=0.15)
    ax.set_title(f"{groups[0]['trials']} trials per group (lr x momentum x seed), {cfg['steps']} steps "
                 f"of batch {cfg['batch_size']}", fontsize=9)
    ax.legend(fontsize=7)
    for i, g in zip(x, groups):
        acc = g["val_accuracy"]
        xs = [i + 0.25 * (k / max(len(acc) - 1, 1) - 0.5) for k in range(len(acc))]
        ax2.plot(xs, acc, "o", color="C2", alpha=0.6, label="trial (vmapped)" if i == 0 else None)
        ax2.plot(xs, g["val_accuracy_sequential"], "o", mfc="none", color="k", ms=8, mew=0.6,
                 label="same trial, one by one" if i == 0 else None)
        b = g["best"]
        ax2.plot(i, b["val_accuracy"], "*", ms=14, color="C3", label="best of group" if i == 0 else None)
        ax2.annotate(f"lr {b['lr']:g}, mom {b['momentum']:g}\nseed {b['seed']}: {b['val_accuracy']:.3f}",
                     (i, b["val_accuracy"]), textcoords="offset points", xytext=(12, -6), ha="left", va="top",
                     fontsize=7)
    ax2.set_xticks(x, names)
    ax2.set_xlim(-0.6, len(groups) - 0.4)
    ax2.set_ylabel("validation accuracy after training")
    ax2.set_title(f"{cfg['dataset']}, {cfg['val_size']} validation examples", fontsize=9)
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"hparam search: vmapped trial axis over {cfg.get('devices_used', env.get('device_count', '?'))} "
                 f"{env.get('device_kind', '?')} device(s), {env.get('cpu_cores', '?')} CPU cores; jax "
                 f"{env.get('jax', '?')}", fontsize=10)
    return _save(fig, out / "hparam_speedup.png")


FAMILY_COLOURS = {"reference": "#6c757d", "data parallel": "#1f77b4", "model parallel": "#ff7f0e",
                  "hybrid": "#2ca02c", "multi-process": "#9467bd"}


def strategies_bars(data: dict, out: Path) -> Path:
    """One model under every strategy: images/s, collective bytes per step (measured beside
    theory), state and temporary memory per device, one bar per strategy coloured by family.

    Args:
        data: the strategies.json dict written by experiments/strategies.py.
        out: folder for strategies.png.
    Returns:
        the PNG path.
    """
    rows, cfg, env = data["metrics"]["rows"], data["config"], data["env"]
    names = [r["strategy"] for r in rows]
    x = list(range(len(rows)))
    colours = [FAMILY_COLOURS.get(r["family"], "#333333") for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(max(10, 0.8 * len(rows) + 4), 8))
    panels = [(axes[0][0], "images_per_sec", "images/s (higher is better)", 1),
              (axes[0][1], "collective_bytes_per_step", "collective MB/step (per device or rank)", 1e6),
              (axes[1][0], "state_bytes_per_device", "state MB/device (params + optimizer)", 1e6),
              (axes[1][1], "activation_bytes_per_device", "temp/activation MB/device", 1e6)]
    for ax, key, label, scale in panels:
        values = [r[key] / scale for r in rows]
        if key == "collective_bytes_per_step":  # grouped: measured beside theory
            theory = [r["collective_bytes_theory"] for r in rows]
            ax.bar([i - 0.2 for i in x], values, 0.4, color=colours, label="measured (compiled HLO)")
            ax.bar([i + 0.2 for i in x], [0 if t is None else t / scale for t in theory], 0.4,
                   color=colours, alpha=0.35, hatch="//", label="theory")
            for i, t in zip(x, theory):
                if t is None:
                    ax.text(i + 0.2, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
            ax.legend(fontsize=7)
        else:
            ax.bar(x, values, 0.7, color=colours)
        ax.set_ylabel(label)
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    families = list(dict.fromkeys(r["family"] for r in rows))
    axes[0][0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=FAMILY_COLOURS.get(f, "#333333"))
                               for f in families], labels=families, fontsize=7)
    skipped = sorted({**data["metrics"].get("skipped", {}), **data["metrics"].get("failed", {})})
    note = f"; not run: {', '.join(skipped)}" if skipped else ""
    fig.suptitle(f"{cfg['model']} width {cfg['width']} depth {cfg['depth']}, global batch "
                 f"{cfg['batch_size']}, {cfg['devices']} devices (MPI: ranks) per strategy{note}\n"
                 f"{env.get('cpu_cores', '?')} CPU cores shared by the simulated devices of each "
                 f"point ({env.get('threads_per_process', '?')} XLA threads; MPI ranks: 1 each); "
                 f"jax {env.get('jax', '?')}", fontsize=9)
    return _save(fig, out / "strategies.png")


def _study_result(path: Path, kind: str) -> dict:
    """A study's RunResult as a dict; a file from before the study wrote RunResults (no
    schema_version) is refused with the command that replaces it."""
    from jaxpar.results import ResultsError, load

    try:
        result = load(path)
    except ResultsError as e:
        raise ResultsError(f"{path}: {e} (`python -m experiments {kind} --out {path.parent}`)") from None
    if result.kind != kind:
        raise ResultsError(f"{path} holds a {result.kind!r} result, not {kind!r}")
    return {"config": result.config, "env": result.env, "metrics": result.metrics}


def redraw(data_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Redraw every figure whose results are under data_dir; return the PNG paths."""
    data_dir, out = Path(data_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    # (results file under data_dir, its study, the figures drawn from it)
    studies = (("pipeline/pipeline.json", "pipeline", (pipeline_bubble, pipeline_schedule)),
               ("batch_size/result.json", "batch-size", (batch_size,)),
               ("hparam/hparam.json", "hparam", (hparam_speedup,)),
               ("strategies/strategies.json", "strategies", (strategies_bars,)),
               ("time_to_accuracy/time_to_accuracy.json", "time-to-accuracy", (time_to_accuracy,)))
    for file, kind, draws in studies:
        if (data_dir / file).exists():
            data = _study_result(data_dir / file, kind)
            paths += [draw(data, out) for draw in draws]
    if (data_dir / "scaling").is_dir():
        from experiments.speedup import load_points

        paths += scaling_figures(load_points(data_dir / "scaling"), out)
    return paths


def _scaling_panels(rows: list[dict], x: str, base: str, title: str, path: Path,
                    best: dict | None = None) -> Path:
    """Speed-up (top) and efficiency (bottom) vs `x`, one column per (mode, model config)
    group, a line per strategy starting at its baseline `base` (speed-up 1), the ideal line.

    Args:
      rows: speedup.device_rows or speedup.rank_rows.
      best: group -> (speed-up of the best single-process point, label), a level line.
    """
    models = {r["group"]: r["model"] for r in rows}
    panels = sorted(models, key=lambda g: (models[g], g))  # by model, then mode
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    for col, group in enumerate(panels):
        here = [r for r in rows if r["group"] == group]
        model, mode = here[0]["model"], here[0]["mode"]
        start = [r for r in here if r["strategy"] == base and r[x] == 1]
        xs = sorted({r[x] for r in here})
        top, bottom = axes[0][col], axes[1][col]
        for name in sorted({r["strategy"] for r in here} - {base}):
            line = start + sorted((r for r in here if r["strategy"] == name), key=lambda r: r[x])
            top.plot([r[x] for r in line], [r["speedup"] for r in line], "o-", label=name)
            bottom.plot([r[x] for r in line], [r["efficiency"] for r in line], "o-", label=name)
        top.plot(xs, xs, "k--", label="ideal")
        bottom.plot(xs, [1] * len(xs), "k--", label="ideal")
        if best and group in best:
            level, label = best[group]
            top.axhline(level, color="grey", ls=":", label=label)
        top.set_title(f"{model}, {mode} scaling")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(v) for v in xs])
            ax.set_xlabel(x)
        top.set_ylabel(f"speed-up (images/s over {base} at 1)")
        bottom.set_ylabel("efficiency (speed-up / " + x + ")")
        top.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def scaling_figures(points: list[dict], out: Path) -> list[Path]:
    """scaling_devices.png (simulated devices in one process) and scaling_ranks.png (MPI
    ranks, one thread each), from `experiments.speedup.load_points` of the scaling study's folder."""
    from experiments import speedup

    paths = []
    devices = [r for r in speedup.device_rows(points) if r["speedup"] == r["speedup"]]  # has a base
    if devices:
        env = devices[0]["env"]
        title = (f"Simulated devices in ONE process share {env['cpu_cores']} CPU cores "
                 f"(XLA's default threads: {env.get('threads_per_process', env['cores_available'])} "
                 f"per process); jax {env['jax']}")
        paths.append(_scaling_panels(devices, "devices", "single", title, out / "scaling_devices.png"))
    ranks = [r for r in speedup.rank_rows(points) if r["speedup"] == r["speedup"]]
    if ranks:
        base = {r["group"]: r["images_per_sec"] for r in ranks if r["ranks"] == 1}
        best = {r["group"]: (r["best"]["images_per_sec"] / base[r["group"]],
                                          f"best 1 process ({r['best']['strategy']}, "
                                          f"{r['best']['devices']} dev, all cores)")
                for r in ranks if r["best"]}
        title = (f"MPI ranks, 1 XLA thread each, pinned to core rank % {ranks[0]['cores']} "
                 f"({ranks[0]['cores']} CPU cores); jax {ranks[0]['env']['jax']}")
        paths.append(_scaling_panels(ranks, "ranks", "single", title, out / "scaling_ranks.png", best))
    return paths


REGIMES = {"perfect scaling": "#d8f3dc", "diminishing returns": "#fff3b0",
           "maximal data parallelism": "#ffd6d6"}


def scaling_regimes(batch_sizes: list[int], steps: list[int], slack: float = 1.25) -> list[str]:
    """Shallue et al.'s regime of each point, judged against the whole curve (so one noisy
    point does not flip it): perfect scaling up to the largest batch whose examples used
    (steps x B) stay within `slack` of the fewest any batch size needed; after it, maximal data
    parallelism once the steps no longer fall below 0.9x the fewest of any smaller batch, and
    diminishing returns before that. The paper names the regimes by eye; these thresholds
    are ours."""
    examples = [s * b for s, b in zip(steps, batch_sizes)]
    knee = max(i for i, e in enumerate(examples) if e <= slack * min(examples))
    out = []
    for i, s in enumerate(steps):
        if i <= knee:
            out.append("perfect scaling")
        elif s >= 0.9 * min(steps[:i]):
            out.append("maximal data parallelism")
        else:
            out.append("diminishing returns")
    return out


def batch_size(result: dict, out: Path) -> Path:
    """Steps and examples to the target validation error vs batch size (log-log), with the
    perfect-scaling line through the smallest batch and each segment shaded by its regime."""
    import math

    rows = [r for r in result["metrics"]["rows"] if r["reached"]]
    cfg, env = result["config"], result["env"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if rows:
        bs = [r["batch_size"] for r in rows]
        steps = [r["steps"] for r in rows]
        regimes = scaling_regimes(bs, steps)
        edges = [bs[0] / 2 ** 0.5] + [(a * b) ** 0.5 for a, b in zip(bs, bs[1:])] + [bs[-1] * 2 ** 0.5]
        seen = set()
        for lo, hi, name in zip(edges, edges[1:], regimes):
            ax.axvspan(lo, hi, color=REGIMES[name], label=None if name in seen else name, zorder=0)
            seen.add(name)
        fewest = min(s * b for s, b in zip(steps, bs))
        ax.plot(bs, [fewest / b for b in bs], "k--", label="perfect scaling (fewest examples / B)")
        ax.plot(bs, steps, "o-", color="C0", label="measured (best trial of the grid)")
        ax2.plot(bs, [r["examples"] for r in rows], "o-", color="C1", label="measured")
        ax2.axhline(fewest, color="k", ls="--", label="perfect scaling")
    missed = [r["batch_size"] for r in result["metrics"]["rows"] if not r["reached"]]
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("batch size")
        a.legend(fontsize=8)
    ax.set_ylabel(f"steps to {result['metrics']['target_error']:.2f} validation error")
    ax2.set_ylabel("examples to result (steps x batch size)")
    model = f"{cfg['model']} {cfg.get('width', '')}x{cfg.get('depth', '')}" if cfg["model"] == "mlp" else cfg["model"]
    note = f"; not reached within budget: {missed}" if missed else ""
    fig.suptitle(f"{cfg['dataset']}, {model}, momentum SGD, {len(cfg['trials'])} (lr, momentum) trials per "
                 f"batch size; {env.get('cpu_cores', '?')} CPU cores{note}", fontsize=10)
    return _save(fig, out / "batch_size.png", tight_layout=False)


def time_to_accuracy(data: dict, out: Path) -> Path:
    """Training time to the target validation accuracy, bars grouped by model (one per
    strategy, steps written on each), and validation accuracy against training time per model.

    Args:
        data: the RunResult dict written by experiments/time_to_accuracy.py.
        out: folder for time_to_accuracy.png.
    Returns:
        the PNG path.
    """
    rows, env = data["metrics"]["rows"], data["env"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    colour = {s: f"C{i}" for i, s in enumerate(strategies)}
    fig, axes = plt.subplots(1, 1 + len(models), figsize=(4.2 * (1 + len(models)), 4), squeeze=False)
    bars = axes[0][0]
    width = 0.8 / len(strategies)
    for i, model in enumerate(models):
        for j, name in enumerate(strategies):
            r = next((r for r in rows if r["model"] == model and r["strategy"] == name), None)
            if r is None:
                continue
            x = i - 0.4 + (j + 0.5) * width
            if r["reached"]:
                bars.bar(x, r["time_s"], width, color=colour[name], label=name if i == 0 else None,
                         hatch="//" if r.get("batch_norm_per_shard") else None)
                bars.text(x, r["time_s"], f"{r['steps']}", ha="center", va="bottom", fontsize=7)
            else:
                bars.text(x, 0, "not\nreached", ha="center", va="bottom", fontsize=7, color=colour[name])
    bars.set_xticks(range(len(models)))
    bars.set_xticklabels([f"{m}\nval acc {next(r['target'] for r in rows if r['model'] == m):.2f}"
                          for m in models])
    bars.set_ylabel("training time to target (s, compile excluded)")
    hatched = "; hatched: per-shard batch norm" if any(r.get("batch_norm_per_shard") for r in rows) else ""
    bars.set_title(f"time to target (steps on the bars{hatched})", fontsize=9)
    bars.legend(fontsize=7)
    for ax, model in zip(axes[0][1:], models):
        here = [r for r in rows if r["model"] == model]
        for r in here:
            curve = r["curve"]
            ax.plot([c["train_s"] for c in curve], [c["val_accuracy"] for c in curve], ".-",
                    color=colour[r["strategy"]], label=r["strategy"] + (" (per-shard BN)" if
                                                                        r.get("batch_norm_per_shard") else ""))
        ax.axhline(here[0]["target"], color="k", ls="--", lw=1, label="target")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=7)
    cfg = data["config"]
    fig.suptitle(f"Time to a validation-accuracy target: global batch {cfg['batch_size']}, seed "
                 f"{cfg['seed']}, validation every {cfg['eval_every']} steps; {env.get('cpu_cores', '?')} "
                 f"CPU cores shared by the simulated devices; jax {env.get('jax', '?')}", fontsize=9)
    return _save(fig, out / "time_to_accuracy.png")
