"""Figures of the pipeline, batch-size, hparam, time-to-accuracy, peers and machine studies, drawn only
from their results files (helpers and house style: experiments/publish/plotting.py).

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.studies.machine.rows import machine_name
from experiments.publish.plotting import (REGIMES, legend_below, plain_log_axis, pyplot, save, scaling_regimes,
                               strategy_style)
from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.gems import Gems

GEMS = Gems.name  # its schedule table has the strategy's name (schedules.TABLES)

SCHEDULE_STYLE = {"gpipe": dict(color="C0", marker="o"), "1f1b": dict(color="C1", marker="s"),
                  GEMS: dict(color="C2", marker="^")}


def pipeline_bubble(result: dict, out: Path) -> Path:
    """2x2 panels against micro-batches M, GPipe vs 1F1B (vs GEMS, when the file has it): the
    bubble of the schedule tables with (S-1)/(M+S-1) (GEMS: (S-2)/(2M+S-2)); measured
    images/s, with `single`'s at the same batch (dash-dot) when the file has it; micro-batches
    held at once on the fullest device, with every device's count at the M whose tables the
    file stores; temporary memory per device (XLA's memory analysis of the compiled step) and,
    dotted, parameters + optimizer state per device.

    Args:
        result: the RunResult dict written by experiments/studies/pipeline/study.py (pipeline.json).
        out: folder for pipeline_bubble.png.
    """
    plt = pyplot()
    data, cfg = result["metrics"], result["config"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 8))
    (bub, tput), (flight, mem) = axes
    _schedule_lines(axes, data)
    single = (data.get("single") or {}).get("images_per_sec")
    reference = [tput.axhline(single, color="0.4", ls="-.", lw=1)] if single else []
    per_stage = []
    for name, table in data.get("tables", {}).items():  # every stage, from the stored tables
        counts = schedules.peak_in_flight(table["table"])
        per_stage.append(f"{name}, M={table['M']}: " + ", ".join(map(str, counts)))
    if per_stage:
        flight.text(0.03, 0.97, "per device 0..S-1\n" + "\n".join(per_stage), transform=flight.transAxes,
                    va="top", fontsize=8, bbox=dict(fc="white", ec="0.8"))
    _pipeline_axes(axes, data)
    env = data.get("point_env") or result.get("env", {})
    fig.suptitle(f"Pipeline, S={data['stages']} stages on {data['stages']} simulated CPU devices sharing "
                 f"{env.get('cpu_cores', '?')} cores; stack-mlp width {cfg.get('width')} x "
                 f"{cfg.get('depth')} blocks, batch {cfg.get('batch_size')}", fontsize=10)
    fig.tight_layout()
    handles, labels = bub.get_legend_handles_labels()
    legend_below(fig, handles + reference, labels + ["single, 1 device"] * len(reference))
    return save(fig, out / "pipeline_bubble.png")


def _schedule_lines(axes, data: dict) -> None:
    """Each schedule's bubble, throughput, micro-batches in flight and memory against M, and
    the bubble formulas beside the tables' bubbles."""
    (bub, tput), (flight, mem) = axes
    for name, style in SCHEDULE_STYLE.items():
        rows = [r for r in data["rows"] if r["schedule"] == name]
        if not rows:
            continue
        ms = [r["M"] for r in rows]
        kw = dict(label=name, mfc="none", mew=1.5, ms=8 if name == "gpipe" else 6, **style)
        bub.plot(ms, [r["bubble"] for r in rows], ls="none", **kw)
        flight.plot(ms, [r["peak_in_flight"] for r in rows], ls="-", **kw)
        timed = [r for r in rows if r.get("images_per_sec")]
        tput.plot([r["M"] for r in timed], [r["images_per_sec"] for r in timed], ls="-", **kw)
        mem.plot([r["M"] for r in timed], [r.get("activation_bytes", r["temp_bytes"]) / 2 ** 20 for r in timed], ls="-", **kw)
        if any(r.get("state_bytes") for r in timed):
            mem.plot([r["M"] for r in timed], [r["state_bytes"] / 2 ** 20 for r in timed], ls=":",
                     color=style["color"])
    for names, line, label in ((schedules.SCHEDULES, "k--", "(S-1)/(M+S-1)"),
                               ((GEMS,), "g:", "(S-2)/(2M+S-2)")):
        theory = sorted({(r["M"], r["theory"]) for r in data["rows"] if r["schedule"] in names})
        if theory:
            bub.plot(*zip(*theory), line, lw=1, label=label)


def _pipeline_axes(axes, data: dict) -> None:
    """Titles, labels and the shared log2 M axis of pipeline_bubble's panels."""
    (bub, tput), (flight, mem) = axes
    for ax, title, label in ((bub, "Bubble (from the schedule tables)", "idle share of stage-slots"),
                             (tput, "Throughput (measured)", "images/s"),
                             (flight, "Micro-batches held at once, fullest device", "micro-batches"),
                             (mem, "Activations per device (measured; dotted: parameters + optimizer)", "MiB")):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(label)
    flight.set_yscale("log", base=2)
    plain_log_axis(flight.yaxis, base=2, between=False)
    ms_all = sorted({r["M"] for r in data["rows"]})
    for a in axes.flat:
        a.set_xscale("log", base=2)
        a.set_xticks(ms_all, [str(m) for m in ms_all])
        a.set_xlim(ms_all[0] / 1.3, ms_all[-1] * 1.3)
        a.set_xlabel("micro-batches M")
        a.grid(True, alpha=0.3)
    for a in (tput, mem):
        if not any(r.get("images_per_sec") for r in data["rows"]):
            a.text(0.5, 0.5, "not measured (--no-measure)", ha="center", transform=a.transAxes)


def pipeline_schedule(result: dict, out: Path) -> Path:
    """GPipe-paper-style picture: devices as rows, one F/B micro-batch block per slot (GEMS:
    its second replica's blocks hatched, that replica running the stages in reverse device
    order)."""
    plt = pyplot()
    data = result["metrics"]
    names, S = list(data["tables"]), data["stages"]
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.4 + 0.55 * S * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        table = data["tables"][name]["table"]
        for t, row in enumerate(table):
            for d, slot in enumerate(row):
                if slot:
                    kind, m, r = schedules.op(slot)
                    ax.add_patch(plt.Rectangle((t, d), 1, 1, ec="k", fc="#8ecae6" if kind == "F" else "#ffb703",
                                               hatch="//" if r else None))
                    ax.text(t + 0.5, d + 0.5, f"{kind}{m}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(table))
        ax.set_ylim(S, 0)
        ax.set_xticks([t + 0.5 for t in range(len(table))], [str(t) for t in range(len(table))], fontsize=7)
        labels = ([f"device {d}: stages {d}, {schedules.stage_of(d, 1, S)}'" for d in range(S)]
                  if name == GEMS else [f"stage {d} (device {d})" for d in range(S)])
        ax.set_yticks([d + 0.5 for d in range(S)], labels)
        idle = schedules.bubble_fraction(table)
        ax.set_title(f"{name}, S={S}, M={data['tables'][name]['M']}: {len(table)} slots, "
                     f"{idle:.0%} of device-slots idle (blank = bubble)"
                     + ("; hatched: replica 1 (stage s' on device S-1-s)" if name == GEMS else ""),
                     fontsize=10)
    axes[-1, 0].set_xlabel("time slot (one forward F or backward B of one micro-batch on one stage)")
    fig.tight_layout()
    return save(fig, out / "pipeline_schedule.png")


KIND_COLORS = {"F": "#8ecae6", "B": "#ffb703", "F+B": "#90be6d"}


def pipeline_timeline(result: dict, out: Path) -> Path:
    """The measured timelines beside the tables: devices as rows, one box per stage program
    from when the device began it to when it finished (stamped on the device), labelled with
    its micro-batch; the measured idle fraction beside the schedule's bubble."""
    plt = pyplot()
    timelines = result["metrics"]["timelines"]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 + 1.3 * len(timelines)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        work = [e for e in tl["events"] if e["kind"] in KIND_COLORS]
        begin = min(e["start_ms"] for e in work)
        devices = sorted({e["device"] for e in work})
        for e in work:
            width = e["end_ms"] - e["start_ms"]
            ax.add_patch(plt.Rectangle((e["start_ms"] - begin, e["device"] + 0.1), width, 0.8, ec="k", lw=0.5,
                                       fc=KIND_COLORS[e["kind"]], hatch="//" if e["replica"] else None))
            ax.text(e["start_ms"] - begin + width / 2, e["device"] + 0.5, str(e["microbatch"]),
                    ha="center", va="center", fontsize=6)
        span = max(e["end_ms"] for e in work) - begin
        ax.set_xlim(0, span * 1.01)
        ax.set_ylim(len(devices), 0)
        ax.set_yticks([d + 0.5 for d in devices], [f"device {d}" for d in devices])
        ax.set_title(f"{name}, {tl['model']}, {len(devices)} devices: measured idle {tl['idle_fraction']:.0%} "
                     f"of devices x span; schedule's bubble {tl['bubble_fraction']:.0%} (theory "
                     f"{tl['bubble_theory']:.0%}); the timed step {tl['step_ms']:.1f} ms", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="k") for c in KIND_COLORS.values()]
    labels = ["forward", "backward", "last stage: forward, loss and backward"]
    axes[-1, 0].set_xlabel("ms from the step's first stage program (one stamped step; "
                           "numbers: micro-batch; hatched: GEMS replica 1)")
    fig.tight_layout()
    legend_below(fig, handles, labels)
    return save(fig, out / "pipeline_timeline.png")


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


def batch_size(result: dict, out: Path) -> Path:
    """Steps and examples to the target validation error against batch size (log-log), with
    the perfect-scaling line through the fewest examples, the 1.25x band that defines the
    perfect regime, and each point's regime shaded (`scaling_regimes`)."""
    plt = pyplot()
    rows = [r for r in result["metrics"]["rows"] if r["reached"]]
    cfg, env = result["config"], result["env"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    if rows:
        bs, steps = [r["batch_size"] for r in rows], [r["steps"] for r in rows]
        regimes = scaling_regimes(bs, steps)
        edges = [bs[0] / 2 ** 0.5] + [(a * b) ** 0.5 for a, b in zip(bs, bs[1:])] + [bs[-1] * 2 ** 0.5]
        for a in (ax, ax2):
            for lo, hi, name in zip(edges, edges[1:], regimes):
                a.axvspan(lo, hi, color=REGIMES[name], zorder=0)
        fewest = min(s * b for s, b in zip(steps, bs))
        ax.plot(bs, [fewest / b for b in bs], "k--", lw=1)
        ax.plot(bs, steps, "o-", color="C0")
        ax2.plot(bs, [r["examples"] for r in rows], "o-", color="C0")
        ax2.axhline(fewest, color="k", ls="--", lw=1)
        ax2.axhline(1.25 * fewest, color="k", ls=":", lw=1)
        for b, e in zip(bs, (r["examples"] for r in rows)):
            ax2.annotate(f"{e / fewest:.2f}x", (b, e), textcoords="offset points", xytext=(0, 6),
                         ha="center", fontsize=7)
    missed = [r["batch_size"] for r in result["metrics"]["rows"] if not r["reached"]]
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("batch size")
    ax.set_title("Steps to the target", fontsize=10)
    ax.set_ylabel(f"steps to {result['metrics']['target_error']:.2f} validation error")
    ax2.set_title("Examples to the target (x the fewest)", fontsize=10)
    ax2.set_ylabel("examples (steps x batch size)")
    handles = [plt.Line2D([], [], color="C0", marker="o", label="measured (best trial of the grid)"),
               plt.Line2D([], [], color="k", ls="--", label="perfect scaling (fewest examples)"),
               plt.Line2D([], [], color="k", ls=":", label="1.25x the fewest: perfect-regime cut-off")]
    used = list(dict.fromkeys(regimes)) if rows else []
    handles += [plt.Rectangle((0, 0), 1, 1, fc=REGIMES[n], ec="0.7", label=n) for n in used]
    model = cfg["model"]
    if model == "mlp":
        model += f" {cfg.get('width', '')}x{cfg.get('depth', '')}"
    note = f"; not reached within budget: {missed}" if missed else ""
    fig.suptitle(f"{cfg['dataset']}, {model}, momentum SGD, {len(cfg['trials'])} (lr, momentum) trials per "
                 f"batch size; {env.get('cpu_cores', '?')} CPU cores{note}", fontsize=10)
    fig.tight_layout()
    legend_below(fig, handles, [h.get_label() for h in handles], ncol=4)
    return save(fig, out / "batch_size.png")


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


def time_to_accuracy(data: dict, out: Path) -> Path:
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


PEER_COLOURS = {"jaxpar": "tab:blue", "pytorch": "tab:orange"}


def peers_bars(data: dict, out: Path) -> Path:
    """One panel per model: images/s of every configuration, jaxpar beside PyTorch, each
    jaxpar bar labelled with its ratio to its PyTorch peer.

    Args:
        data: the peers.json dict written by experiments/peers/study.py.
        out: folder for peers.png.
    Returns:
        the PNG path.
    """
    plt = pyplot()
    rows, env, cfg = data["metrics"]["rows"], data["env"], data["config"]
    panels = {model: [r for r in rows if r["model"] == model] for model in dict.fromkeys(r["model"] for r in rows)}
    rounds = dict.fromkeys(panels, cfg["rounds"])  # each section runs rounds of its own
    mp = data["metrics"].get("model_parallel")
    if mp and mp["rows"]:  # the model-parallel section, a panel of its own
        title = f"{mp['config']['mp_model']}, model parallelism"
        panels[title], rounds[title] = mp["rows"], mp["config"]["rounds"]
    tallest = max((len(p) for p in panels.values()), default=1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.0 + 0.45 * tallest * len(panels)), squeeze=False)
    for ax, (model, panel) in zip(axes[:, 0], panels.items()):
        mine = panel[::-1]  # first configuration on top
        ips = [r["images_per_sec"] for r in mine]
        ax.barh(range(len(mine)), ips, color=[PEER_COLOURS[r["framework"]] for r in mine])
        ax.set_yticks(range(len(mine)), [
            f"{r['framework']}: {r['what']} ({r['processes']} proc x {r['threads_per_process']} thr)"
            for r in mine], fontsize=8)
        for i, r in enumerate(mine):
            note = f"{r['images_per_sec']:,.0f}"
            if r["ratio_vs_peer"] is not None:
                note += f"  ({r['ratio_vs_peer']:.2f}x {r['peer'].removeprefix('torch-')})"
            ax.text(r["images_per_sec"], i, " " + note, va="center", fontsize=8)
        ax.set_xlim(0, max(ips) * 1.45)
        ax.set_title(f"{model}: images/s, median of {rounds[model]} interleaved rounds "
                     "(jaxpar / PyTorch peer in brackets)", fontsize=10)
    axes[-1, 0].set_xlabel(f"images/s, global batch {cfg['batch_size']}; {env['cpu_cores']} CPU cores, "
                           f"jax {env['jax']}, torch {env.get('torch')}")
    fig.tight_layout()
    return save(fig, out / "peers.png")


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
