"""The machine command's tables: the docs' (`report`: every measured machine, one row per model)
and its own OUT/summary.md.

    TABLES["other-machines"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, markdown, num, times
from experiments.publish.measured_on import machine_name, revision_words
from experiments.studies.machine.rows import load_words


def _scaling_cell(rows: list[dict], part: str) -> str:
    """'8: 5.1x (0.64)': the most workers of a part, speed-up over one and efficiency."""
    here = [r for r in rows if r["part"] == part and r["speedup"] is not None and r["workers"] > 1]
    if not here:
        return DASH
    top = max(here, key=lambda r: r["workers"])
    return f"{top['workers']}: {top['speedup']:.2f}x ({top['efficiency']:.2f})"


def other_machines_table(data_dir: Path) -> str:
    """Each measured machine's models: one-device step beside PyTorch eager, and the speed-up
    at the most devices and MPI ranks (efficiency in brackets)."""
    out = []
    for m in sources.load_source(data_dir, "machines")["machines"]:
        env, rows = m["env"], m["metrics"]["rows"]
        where = f"{m['files'][0].parent.name}: {machine_name(env)}"
        for model in dict.fromkeys(r["model"] for r in rows):
            here = [r for r in rows if r["model"] == model]
            one = next((r for r in here if r["part"] == "one-device"), None)
            torch = next((r for r in here if r["part"] == "torch"), None)
            out.append([where, model, DASH if one is None else f"{one['ms']:.2f}",
                        DASH if one is None else num(one["images_per_sec"]),
                        DASH if torch is None else num(torch["images_per_sec"]),
                        DASH if one is None or one["speedup"] is None else f"{one['speedup']:.2f}x",
                        _scaling_cell(here, "devices"), _scaling_cell(here, "ranks"),
                        f"jax {env['jax']}, {env['time'][:10]}, {revision_words(env)}; "
                        f"{load_words(m)}"])
    return markdown(["machine", "model", "1 device ms/step", "images/s", "PyTorch eager images/s",
                     "jaxpar / PyTorch", "devices: speed-up (efficiency)",
                     "MPI ranks: speed-up (efficiency)", "software, date, revision; how busy"], out)


def _cell(x, fmt: str) -> str:
    return DASH if x is None else format(x, fmt)


def machine_summary(data: dict) -> str:
    """Markdown: every row of one machine.json dict, then what was skipped or failed."""
    env = data["env"]
    lines = [f"{machine_name(env)}; {env['backend']} backend, jax {env['jax']}, flax {env['flax']}"
             + (f", torch {env['torch']}" if env.get("torch") else "") + f"; {load_words(data)} "
             "before the points.", "",
             "| model | part | framework | strategy | devices | ranks | threads/process | global batch "
             "| ms/step | images/s | speed-up | efficiency | % of matmul peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["metrics"]["rows"]:
        lines.append(f"| {r['model']} | {r['part']} | {r['framework']} | {r['strategy']} | "
                     f"{r['devices']} | {r['ranks']} | {r['threads_per_process']} | {r['batch']} | "
                     f"{r['ms']:.2f} | {r['images_per_sec']:,.0f} | {_cell(r['speedup'], '.2f')} | "
                     f"{_cell(r['efficiency'], '.2f')} | {_cell(r['percent_of_peak'], '.1f')} |")
    lines.append("\nSpeed-up: one-device rows over PyTorch eager on the same device; devices and "
                 "ranks over one worker (one device, one XLA thread on a CPU), weak scaling.")
    for kind in ("skipped", "failed"):
        for what, why in data["metrics"][kind].items():
            lines.append(f"\n{kind}: {what}: {why.strip().splitlines()[-1] if why.strip() else why}")
    return "\n".join(lines) + "\n"


def machines_findings(data_dir: Path) -> str:
    """Per machine: one device against PyTorch eager, the matmul peak reached, and what running
    every worker at once does to one worker's step."""
    lines = []
    for m in sources.load_source(data_dir, "machines")["machines"]:
        name, rows = m["files"][0].parent.name, m["metrics"]["rows"]
        one = [r for r in rows if r["part"] == "one-device" and r["speedup"] is not None]
        line = f"`{name}`: one device runs " + ", ".join(f"the {r['model']} {times(r['speedup'])}" for r in one) + " PyTorch eager"
        peak = next((r for r in one if r.get("percent_of_peak") is not None), None)
        if peak:
            line += f"; the {peak['model']}'s step reaches {peak['percent_of_peak']:.1f}% of the float32 matmul peak measured beside it"
        crowded = []
        for model in dict.fromkeys(r["model"] for r in rows):
            devices = sorted((r for r in rows if r["model"] == model and r["part"] == "devices"), key=lambda r: r["workers"])
            if len(devices) > 1:
                alone, all_of = devices[0], devices[-1]
                crowded.append(f"the {model} {alone['ms']:.1f} ms alone, {all_of['ms']:.1f} ms as one of {all_of['workers']}")
        if crowded:
            line += "; one single-threaded device's step (weak scaling), " + "; ".join(crowded)
        lines.append(line + ".")
    return bullets(lines)


TABLES = {"other-machines": other_machines_table, "other-machines-findings": machines_findings}
