"""The strategies study's tables: the docs' (`report`: stack-mlp and the CNN under every
strategy) and its own OUT/summary.md, from its strategies.json.

    TABLES["strategies-study"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import functools
from pathlib import Path

from experiments.points import points
from experiments.publish import sources
from experiments.publish.markdown import DASH, markdown, mb, num, theory_total
from jaxpar.mesh import format_mesh
from jaxpar.models import takes


def _study_mesh(row: dict) -> str:
    if row["processes"] > 1:
        return f"{row['processes']} ranks"
    mesh = format_mesh(row["mesh"]) if row["devices_used"] > 1 else "1 device"
    return mesh + (f", M={row['microbatches']}" if row.get("microbatches") else "")


def strategies_table(name: str, data_dir: Path) -> str:
    """The strategies study of source `name` (stack-mlp, or the CNN): one row per strategy."""
    metrics = sources.load_source(data_dir, name)["metrics"]
    rows = metrics["rows"]
    table = markdown(
        ["strategy", "family", "mesh", "ms/step", "images/s", "collective MB/step per device or rank (theory)",
         "state MB/device", "temp MB/device"],
        [[r["strategy"], r["family"], _study_mesh(r), num(r["ms_per_step"], 1), num(r["images_per_sec"]),
          f"{mb(r['collective_bytes_per_step'])} ({mb(theory_total(r['collective_bytes_theory']))})",
          mb(r["state_bytes_per_device"]), mb(r["activation_bytes_per_device"])] for r in rows])
    one_thread = metrics.get("one_thread")  # absent from runs without MPI rows, or before it
    return table if not one_thread else f"{table}\n\n{one_thread_note(one_thread)}"


def one_thread_note(one_thread: dict) -> str:
    """The line that gives the MPI rows' reference (`single` on one thread)."""
    return (f"The MPI rows' ranks run one thread each; `single` on one thread: "
            f"{one_thread['ms_per_step']:.1f} ms/step ({one_thread['images_per_sec']:,.0f} images/s).")


def _bytes(n: int | None) -> str:
    return DASH if n is None else f"{n:,}"


def strategies_summary(study: dict) -> str:
    """OUT/summary.md: markdown table of a strategies.json dict, with the machine behind the numbers."""
    cfg, env, m = study["config"], study["env"], study["metrics"]
    sizes = "".join(f" {k} {cfg[k]}" for k in ("width", "depth") if k in takes(cfg["model"]))
    lines = [f"{cfg['model']}{sizes}, global batch "
             f"{cfg['batch_size']}, {cfg['devices']} devices per strategy, median of {cfg['iters']} "
             f"steps after {cfg['warmup']}; {points.rounds_note(cfg.get('rounds', 1), 'strategy')}.\n",
             "| strategy | mesh | ms/step | images/s | compile s | collective B/step (theory) | "
             "state B/device | temp/activation B/device |",
             "|---|---|---|---|---|---|---|---|"]
    for r in m["rows"]:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        if r["microbatches"]:
            mesh += f", M={r['microbatches']}"
        lines.append(f"| {r['strategy']} | {mesh} | {r['ms_per_step']:.2f} | {r['images_per_sec']:,.0f} | "
                     f"{r['compile_s']:.2f} | {_bytes(r['collective_bytes_per_step'])} "
                     f"({_bytes(r['collective_bytes_theory'])}) | {_bytes(r['state_bytes_per_device'])} | "
                     f"{_bytes(r['activation_bytes_per_device'])} |")
    lines.append(f"\n{env['device_count']} simulated {env['backend']} devices ({env['device_kind']}) in one "
                 f"process per strategy, sharing {env['cpu_cores']} CPU cores ({env['threads_per_process']} "
                 f"XLA threads); jax {env['jax']}; images/s = global batch / median step. MPI "
                 "strategies: one single-threaded process per rank, one device each, "
                 "collective bytes per rank. Memory is the fullest device's: state = parameters + "
                 "optimizer state; temp/activation = XLA's temporary buffers of the step program "
                 "(layer-split: the residuals each stage's forward program hands to its backward, "
                 "plus that backward's temporaries).")
    if m.get("one_thread"):
        lines.append(f"\n{one_thread_note(m['one_thread'])}")
    for name, why in {**m["skipped"], **m.get("failed", {})}.items():
        status = "skipped" if name in m["skipped"] else "failed"
        lines.append(f"\n{name}: {status} ({why.strip().splitlines()[-1] if why.strip() else ''})")
    return "\n".join(lines) + "\n"


DATA_PARALLEL, MODEL_PARALLEL = "data parallel", "model parallel"


TABLES = {"strategies-study": functools.partial(strategies_table, "strategies"),
          "strategies-study-cnn": functools.partial(strategies_table, "cnn-strategies")}
