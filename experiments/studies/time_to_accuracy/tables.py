"""The time-to-accuracy study's tables: the docs' (`report`: per strategy its time to each
model's target and its state per device) and its own OUT/summary.md.

    TABLES["time-to-accuracy"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, markdown, num, span, times


def _time_cell(r: dict | None) -> str:
    """Time to target with its steps, † where batch norm used per-shard statistics (the
    trajectory may differ); a dash where the strategy does not place the model."""
    if r is None:
        return DASH
    cell = f"{r['time_s']:.1f} s ({r['steps']})" if r["reached"] else f"not reached ({r['steps_run']})"
    return cell + (" †" if r.get("batch_norm_per_shard") else "")


def _state_cell(r: dict | None) -> str:
    """Parameters + optimizer state per device in MB; blank where a row does not record it."""
    state = None if r is None else r.get("state_bytes_per_device")
    return "" if state is None else f"{state / 1e6:.2f}"


def time_to_accuracy_table(data_dir: Path) -> str:
    """One row per strategy, per model its time to target (steps) and its state per device
    beside it: what model parallelism buys in memory and what it costs in time."""
    rows = sources.load_source(data_dir, "time-to-accuracy")["metrics"]["rows"]
    label = lambda r: r.get("label", r["strategy"])  # noqa: E731  (strategy, and its schedule)
    models = list(dict.fromkeys(r["model"] for r in rows))
    found = {(r["model"], label(r)): r for r in rows}
    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(label(r), r)
    out = []
    for name, r in first.items():
        # Multi-process rows: ranks of one device each (rows written before ranks were recorded: 1).
        where = f"{r['ranks']} ranks" if r.get("ranks", 1) > 1 else str(r["devices"])
        out.append([name, where, *[c for m in models for c in (_time_cell(found.get((m, name))),
                                                                _state_cell(found.get((m, name))))]])
    accuracy = [f"{min(a):.3f}-{max(a):.3f}" for a in
                ([r["test_accuracy"] for r in rows if r["model"] == m] for m in models)]
    out.append(["test accuracy (all rows)", "", *[c for a in accuracy for c in (a, "")]])
    target = {r["model"]: r["target"] for r in rows}
    return markdown(["strategy", "devices", *[h for m in models for h in (
        f"{m} to {target[m]:.2f}: time (steps)", f"{m}: state MB/device")]], out)


def where(row: dict) -> str:
    """'2', or '2 ranks' for a multi-process row (rows written before ranks were recorded: devices)."""
    ranks = row.get("ranks", 1)
    return f"{ranks} ranks" if ranks > 1 else str(row["devices"])


def time_to_accuracy_summary(rows: list[dict], env: dict, config: dict, left_out: list[str] = ()) -> str:
    """OUT/summary.md: markdown table of the study's rows and what stands behind the times."""
    lines = ["| model | strategy | devices | target (val) | reached | steps | examples | time s | "
             "images/s | compile s | test accuracy | state MB/device |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " †" if r["batch_norm_per_shard"] else ""
        state = r.get("state_bytes_per_device")
        if r["reached"]:
            cells = f"yes | {r['steps']} | {r['examples']:,} | {r['time_s']:.1f} | {r['images_per_sec']:,.0f}"
        else:
            cells = f"no ({r['steps_run']} steps) | – | – | – | –"
        lines.append(f"| {r['model']} | {r['label']}{mark} | {where(r)} | {r['target']:.2f} | "
                     f"{cells} | {r['compile_s']:.1f} | {r['test_accuracy']:.4f} | "
                     f"{'–' if state is None else f'{state / 1e6:.2f}'} |")
    notes = [
        f"Global batch {config['batch_size']}, seed {config['seed']}, Adam at a constant learning rate, "
        f"validation on {config['val_size']} examples every {config['eval_every']} steps (steps to target "
        f"are multiples of it), budget {config['max_epochs']} epochs per point; one process per point.",
        "time s: training steps up to the validation that reached the target, compilation (compile s) "
        "and validation excluded; images/s = examples / time s.",
        f"{env.get('cpu_cores', '?')} CPU cores ({env.get('cores_available', '?')} available) shared by all "
        f"simulated devices of a point; XLA threads: {env.get('threads', '?')}; jax {env.get('jax', '?')}, "
        f"{env.get('device_kind', '?')}.",
    ]
    if any(r.get("ranks", 1) > 1 for r in rows):
        notes.append("N ranks: N processes under mpiexec, one device and one XLA thread each, pinned "
                     "to core rank % cores; state MB/device is the fullest rank's.")
    if any(r["batch_norm_per_shard"] for r in rows):
        notes.append("† batch norm normalises with per-shard batch statistics under this strategy "
                     "(pipeline, gems: per micro-batch; single and one-program strategies such as "
                     "dp-auto use the whole global batch), so its trajectory can differ from single's.")
    if left_out:
        notes.append(f"Not run (the strategy cannot place the model): {', '.join(left_out)}.")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def time_to_accuracy_findings(data_dir: Path) -> str:
    """Steps, accuracy, time and state of every row against `single`'s, per model."""
    rows = sources.load_source(data_dir, "time-to-accuracy")["metrics"]["rows"]
    label = lambda r: r.get("label", r["strategy"])  # noqa: E731
    missed = [f"{r['model']} {label(r)}" for r in rows if not r["reached"]]
    lines = [f"{len(rows)} points; " + ("every one reached its target." if not missed else
                                        f"{listing(missed)} did not reach its target.")]
    for model in dict.fromkeys(r["model"] for r in rows):
        here = [r for r in rows if r["model"] == model and r["reached"]]
        single = next(r for r in here if r["strategy"] == "single")
        counts = {}
        for r in here:
            counts.setdefault(r["steps"], []).append(label(r))
        steps = "; ".join(f"{num(s)} for " + ("`single` and " if single["steps"] == s else "")
                          + (f"{len(names) - (single['steps'] == s)} other rows" if len(names) > 3 else
                             listing([f"`{n}`" for n in names if n != "single"]))
                          for s, names in sorted(counts.items()))
        faster = sorted((r for r in here if r["time_s"] < single["time_s"]), key=lambda r: r["time_s"])
        slowest = max(here, key=lambda r: r["time_s"])
        lines.append(
            f"{model} to {single['target']:.2f}: steps {steps}; test accuracy {span([r['test_accuracy'] for r in here], '.3f')} "
            f"(`single` {single['test_accuracy']:.3f}). `single` took {single['time_s']:.1f} s; "
            + (("sooner: " + ", ".join(f"`{label(r)}` {r['time_s']:.1f} s ({num(r['steps'])} steps)" for r in faster))
               if faster else "no other row reached the target sooner")
            + f"; the slowest, `{label(slowest)}`, {slowest['time_s']:.1f} s ({times(slowest['time_s'] / single['time_s'])}).")
        state = {label(r): r.get("state_bytes_per_device") for r in here if r.get("state_bytes_per_device")}
        if state.get("single"):
            lines.append(f"{model}: state per device {state['single'] / 1e6:.2f} MB under `single`; " + ", ".join(
                f"`{n}` {state[n] / 1e6:.2f}" for n in ("fsdp", "tensor", "layer-split", "pipeline (gpipe)", "gems")
                if n in state) + " MB.")
    return bullets(lines)


TABLES = {"time-to-accuracy": time_to_accuracy_table, "time-to-accuracy-findings": time_to_accuracy_findings}
