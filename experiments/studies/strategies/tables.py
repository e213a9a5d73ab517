"""The strategies study's tables: the docs' (`report`: stack-mlp and the CNN under every
strategy) and its own OUT/summary.md, from its strategies.json.

    TABLES["strategies-study"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import functools
from pathlib import Path

from experiments.points import points
from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, markdown, mb, num, percent, span, theory_total, times
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


def _megabytes(x: float) -> str:
    return f"{x / 1e6:.1f} MB"


def strategies_findings(name: str, data_dir: Path) -> str:
    """Bytes, memory and step of every strategy against `single`, in numbers from the
    strategies study of source `name`."""
    metrics = sources.load_source(data_dir, name)["metrics"]
    by = {r["strategy"]: r for r in metrics["rows"]}
    single = by.pop("single")
    family = lambda f: [r for r in by.values() if r["family"] == f]  # noqa: E731
    dp, mp = family(DATA_PARALLEL), family(MODEL_PARALLEL)
    sent = by["dp-shard-map"]["collective_bytes_per_step"]
    exact = all(by[s]["collective_bytes_per_step"] == by[s]["collective_bytes_theory"]
                for s in ("dp-shard-map", "fsdp"))  # explicit collectives: bytes exactly theory's
    activations = by["tensor"]["collective_bytes_per_step"] / sent
    lines = [f"Data parallelism moves all {_megabytes(sent)} of gradients a step"
             + (" (`dp-shard-map`'s and `fsdp`'s measured from the compiled programs, equal to theory)" if exact else "")
             + f", `fsdp` {percent(by['fsdp']['collective_bytes_per_step'] / sent - 1)} more; `tensor` "
             f"moves {_megabytes(by['tensor']['collective_bytes_per_step'])} of activations, "
             + (f"{times(activations)} the gradients' bytes" if activations >= 1 else
                f"{1 / activations:.0f} times fewer bytes than the gradients")
             + (f", `mpi-pipeline` {_megabytes(by['mpi-pipeline']['collective_bytes_per_step'])} per rank"
                if "mpi-pipeline" in by else "") + "."]
    staged = [r["state_bytes_per_device"] for r in mp if r["strategy"] != "gems"]
    lines.append(f"State per device (parameters and Adam's moments): `single` {_megabytes(single['state_bytes_per_device'])}, "
                 f"`fsdp` {_megabytes(by['fsdp']['state_bytes_per_device'])}, the model-parallel strategies "
                 f"{span([s / 1e6 for s in staged], '.1f', ' MB')}"
                 + (f" (`gems` holds two stages: {_megabytes(by['gems']['state_bytes_per_device'])})" if "gems" in by else "")
                 + f"; temporary memory per device: `single` {_megabytes(single['activation_bytes_per_device'])}, the "
                 f"data-parallel strategies {span([r['activation_bytes_per_device'] / 1e6 for r in dp], '.1f', ' MB')}, "
                 f"the model-parallel ones {span([r['activation_bytes_per_device'] / 1e6 for r in mp], '.1f', ' MB')}.")
    one_process = sorted((r for r in by.values() if r["processes"] == 1), key=lambda r: r["ms_per_step"])
    slower = all(r["ms_per_step"] > single["ms_per_step"] for r in one_process)
    lines.append(f"`single` takes {single['ms_per_step']:.1f} ms a step (its rounds "
                 f"{span(single['ms_per_step_rounds'], '.1f', ' ms')}); "
                 + ("every other strategy in one process takes longer: " if slower else "the others in one process: ")
                 + ", ".join(f"`{r['strategy']}` {times(r['ms_per_step'] / single['ms_per_step'])}"
                                              for r in one_process) + " its step.")
    one_thread = metrics.get("one_thread")
    ranks = [r for r in by.values() if r["processes"] > 1]
    if one_thread and ranks:
        lines.append(f"The MPI strategies' ranks, one thread each, against `single` on one thread "
                     f"({one_thread['ms_per_step']:.1f} ms): " + ", ".join(
                         f"`{r['strategy']}` {times(r['ms_per_step'] / one_thread['ms_per_step'])}" for r in ranks)
                     + " its step.")
    spread = {r["strategy"]: max(r["ms_per_step_rounds"]) / min(r["ms_per_step_rounds"]) - 1
              for r in metrics["rows"] if len(r.get("ms_per_step_rounds", ())) > 1}
    if spread:
        widest = max(spread, key=spread.get)
        rounds = [r for r in metrics["rows"] if r["strategy"] == widest][0]["ms_per_step_rounds"]
        lines.append(f"One strategy's rounds spread by {span([100 * s for s in spread.values()], '.0f', '%')} "
                     f"(the widest, `{widest}`: {span(rounds, '.1f', ' ms')}).")
    return bullets(lines)


def strategies_headline(data_dir: Path) -> str:
    """The README's sentence: what model parallelism and fsdp buy in memory and bytes."""
    by = {r["strategy"]: r for r in sources.load_source(data_dir, "strategies")["metrics"]["rows"]}
    split = [by[s]["state_bytes_per_device"] / 1e6 for s in ("fsdp", "tensor", "pipeline", "layer-split") if s in by]
    grads, acts = by["dp-shard-map"]["collective_bytes_per_step"], by["tensor"]["collective_bytes_per_step"]
    return (f"State per device falls from {_megabytes(by['single']['state_bytes_per_device'])} under `single` to "
            f"{span(split, '.0f', ' MB')} under fsdp and model parallelism, and `tensor` moves "
            f"{grads / acts:.0f} times fewer bytes a step than data parallelism's all-reduce "
            f"({_megabytes(acts)} against {_megabytes(grads)}).")


TABLES = {"strategies-study": functools.partial(strategies_table, "strategies"),
          "strategies-study-cnn": functools.partial(strategies_table, "cnn-strategies"),
          "strategies-findings": functools.partial(strategies_findings, "strategies"),
          "strategies-headline": strategies_headline,
          "strategies-cnn-findings": functools.partial(strategies_findings, "cnn-strategies")}
