"""The pipeline study's figures, drawn from its pipeline.json alone: the bubble, throughput,
micro-batches in flight and memory against M (pipeline_bubble.png), the schedule tables as a
picture (pipeline_schedule.png), the measured timelines beside them (pipeline_timeline.png),
and the steps across ranks as their programs stamped them (pipeline_rank_timeline.png).

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish.plotting import legend_below, plain_log_axis, pyplot, save
from experiments.studies.pipeline.study import GEMS
from jaxpar.parallel.pipeline import schedules
from jaxpar.parallel.pipeline.schedules.generators import mirrored


SCHEDULE_STYLE = {"gpipe": dict(color="C0", marker="o"), "1f1b": dict(color="C1", marker="s"),
                  GEMS: dict(color="C2", marker="^"), "interleaved-1f1b": dict(color="C3", marker="v"),
                  "looped-bfs": dict(color="C4", marker="<"), "zb-h1": dict(color="C5", marker="D"),
                  "zbv": dict(color="C6", marker="P"), "dualpipev": dict(color="C7", marker="X")}
# A block's colour by what it runs: a forward, a whole backward, or its two halves (input and
# weight gradients: zero-bubble schedules).
BLOCK_COLORS = {"F": "#8ecae6", "B": "#ffb703", "I": "#fb8500", "W": "#b5838d"}


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
    for names, line, label in ((("gpipe", "1f1b"), "k--", "(S-1)/(M+S-1)"),  # the others: their own lists
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
                    ax.add_patch(plt.Rectangle((t, d), 1, 1, ec="k", fc=BLOCK_COLORS[kind],
                                               hatch="//" if r else None))
                    # several stages per device: the stage beside the micro-batch
                    where = f"\n{slot[3]}" if len(slot) > 3 else ""
                    ax.text(t + 0.5, d + 0.5, f"{kind}{m}{where}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(table))
        ax.set_ylim(S, 0)
        ax.set_xticks([t + 0.5 for t in range(len(table))], [str(t) for t in range(len(table))], fontsize=7)
        labels = ([f"device {d}: stages {d}, {mirrored(S)[1][d]}'" for d in range(S)]
                  if name == GEMS else [f"stage {d} (device {d})" for d in range(S)]
                  if all(len(slot) < 4 for row in table for slot in row if slot) else
                  [f"device {d}" for d in range(S)])
        ax.set_yticks([d + 0.5 for d in range(S)], labels)
        idle = schedules.bubble_fraction(table)
        ax.set_title(f"{name}, S={S}, M={data['tables'][name]['M']}: {len(table)} slots, "
                     f"{idle:.0%} of device-slots idle (blank = bubble)"
                     + ("; hatched: replica 1 (stage s' on device S-1-s)" if name == GEMS else ""),
                     fontsize=10)
    axes[-1, 0].set_xlabel("time slot (one forward F or backward B of one micro-batch on one stage)")
    fig.tight_layout()
    return save(fig, out / "pipeline_schedule.png")


KIND_COLORS = {"F": "#8ecae6", "B": "#ffb703", "F+B": "#90be6d", "I": "#fb8500", "W": "#b5838d",
               "F+I": "#52b788"}
KIND_LABELS = {"F": "forward", "B": "backward", "F+B": "last stage: forward, loss and backward",
               "I": "input gradient", "W": "weight gradient", "F+I": "last stage: forward, loss and input gradient"}


def pipeline_timeline(result: dict, out: Path) -> Path | None:
    """The measured timelines beside the tables: devices as rows, one box per stage program
    from when the device began it to when it finished (stamped on the device), labelled with
    its micro-batch; the measured idle fraction beside the schedule's bubble."""
    return _timelines(result["metrics"].get("timelines"), out / "pipeline_timeline.png",
                      "ms from the step's first stage program (one stamped step; numbers: micro-batch; "
                      "hatched: GEMS replica 1)")


def pipeline_rank_timeline(result: dict, out: Path) -> Path | None:
    """The steps across ranks as their programs stamped them (the median round's middle
    timed step of each schedule at the fewest micro-batches): ranks as rows, a box per action;
    the idle time lived beside the step's table replayed with its own times."""
    return _timelines(result["metrics"].get("rank_timelines"), out / "pipeline_rank_timeline.png",
                      "ms from the step's first action (a timed step, stamped inside the ranks' programs; "
                      "numbers: micro-batch)")


def _timelines(timelines: dict | None, path: Path, xlabel: str) -> Path | None:
    if not timelines:  # --no-measure, or no ranks
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 + 1.3 * len(timelines)), squeeze=False)
    drawn = {name: _drawn(tl["events"]) for name, tl in timelines.items()}
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        work = drawn[name]
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
        ax.set_title(f"{name}, {tl['model']}, {len(devices)} devices: {_bubbles(tl)}", fontsize=9)
    shown = [k for k in KIND_COLORS if any(e["kind"] == k for work in drawn.values() for e in work)]
    handles = [plt.Rectangle((0, 0), 1, 1, fc=KIND_COLORS[k], ec="k") for k in shown]
    labels = [KIND_LABELS[k] for k in shown]
    axes[-1, 0].set_xlabel(xlabel)
    fig.tight_layout()
    legend_below(fig, handles, labels)
    return save(fig, path)


def _drawn(events: list[dict]) -> list[dict]:
    """The boxes to draw: the stage programs; from programs stamped inside a rank's step
    (kinds by action), the last stage's forward as what it runs (its loss and its backward
    or input gradient too) and its empty backward slots left out."""
    work = [e for e in events if e["kind"] in KIND_COLORS]
    if any(e["kind"] in ("F+B", "F+I") for e in work) or not work:
        return work  # the walk's programs, named by what they run
    last = max(e["stage"] for e in work)
    fused = "F+I" if any(e["kind"] == "I" for e in work) else "F+B"
    return [{**e, "kind": fused} if e["stage"] == last and e["kind"] == "F" else e for e in work
            if not (e["stage"] == last and e["kind"] in ("B", "I"))]


def _bubbles(tl: dict) -> str:
    """The title's bubbles: the stamped rank step's lived beside its table's replayed, the
    walked step's beside its table's with the same action times (older files: the stamped
    idle share beside the schedule's)."""
    if tl.get("stamped"):
        return (f"the step {tl['step_ms']:.1f} ms idles {tl['idle_ms']:.1f} ms a device; its table with "
                f"the step's own action times and latency {tl['idle_ms_timed']:.1f} ms")
    if tl.get("walk_ms") is not None:
        return (f"walked, idles {tl['bubble_measured']:.0%} of devices x walk; its table with the same "
                f"action times {tl['bubble_timed']:.0%} (unit times {tl['bubble_fraction']:.0%})")
    return (f"measured idle {tl['idle_fraction']:.0%} of devices x span; schedule's bubble "
            f"{tl['bubble_fraction']:.0%}; the timed step {tl['step_ms']:.1f} ms")


FIGURES = (("pipeline", (("pipeline_bubble.png", pipeline_bubble),
                         ("pipeline_schedule.png", pipeline_schedule),
                         ("pipeline_timeline.png", pipeline_timeline),
                         ("pipeline_rank_timeline.png", pipeline_rank_timeline))),)
