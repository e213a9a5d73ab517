"""The results tables of README.md and docs/, each a function of the committed JSON (or, for
the strategy list, of the strategy classes), written by `python -m experiments report`.

    TABLES["scaling-devices"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import functools
import math
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from experiments import (faults, machine_rows, network_rows, peers_mp, peers_report, plots, sources, speedup,
                         tables_cost)
from experiments.markdown import DASH, markdown, mb, num
from experiments.rank_scaling import ranks_cell
from experiments.strategies import one_thread_note
from jaxpar import results
from jaxpar.config import TrainConfig, to_dict
from jaxpar.mesh import format_mesh
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.pipeline.gems import Gems

def theory_total(theory: Any) -> int | None:
    """A result's collective-bytes theory as one number (None: no closed form)."""
    if isinstance(theory, dict):
        return theory.get("total")
    return theory


# --- the strategies (from their classes) ---------------------------------------------------
def strategy_list(_: Path) -> str:
    """Every registered strategy: family, what it does, models, default mesh, processes."""
    rows = []
    for name, cls in STRATEGIES.items():
        mesh = format_mesh(cls.default_axes).replace("-1", "all")
        across = "MPI ranks (mpi4jax)" if cls.uses_mpi else "jax.distributed" if cls.multiprocess else DASH
        models = ", ".join(f"`{m}`" for m in cls.models) if cls.models else "any"
        rows.append([f"`{name}`", cls.family, cls.summary, models, f"`{mesh}`", across])
    return markdown(["strategy", "family", "what it does", "models", "default mesh",
                     "across processes"], rows)


# --- the main command ----------------------------------------------------------------------
def _make_args(config: dict) -> str:
    """`make run` with the options that differ from the defaults, as ARGS."""
    default = to_dict(TrainConfig())
    args = []
    for section in ("model", "data", "optim"):
        for k, v in config[section].items():
            if k in default[section] and v != default[section][k] and k not in ("cache_dir", "data_dir"):
                args.append(f"--{k.replace('_', '-')} {v}")
    return "`make run" + (f" ARGS=\"{' '.join(args)}\"`" if args else "`")


def main_results(data_dir: Path) -> str:
    """The default run and its MLP variant: accuracy, time, step, machine."""
    rows = []
    for name in ("train-cnn", "train-mlp"):
        r = sources.load(data_dir, name)
        m, c, env = r["metrics"], r["config"], r["env"]
        rows.append([f"{c['model']['model']}", _make_args(c), f"**{100 * m['test_accuracy']:.2f}%**",
                     num(m["epochs"]), f"{m['wall_s']:,.0f} s", f"{m['step_time_ms_median']:.1f} ms",
                     num(m["images_per_sec"]), machine_words(env)])
    return markdown(["model", "command", "test accuracy", "epochs", "wall time", "median step",
                     "images/s", "machine"], rows)


def cpu_words(env: dict) -> str:
    """'2-core x86_64 CPU' from a result's env: the machine's cores."""
    return machine_rows.cpu_name(env, env["cpu_cores"])


def machine_words(env: dict) -> str:
    return f"{cpu_words(env)}, {env['device_count']} XLA {env['backend']} device(s), jax {env['jax']}"


# --- where each table's numbers were measured ----------------------------------------------
def _revision(env: dict) -> str:
    rev = str(env.get("git_revision", "unknown"))
    dirty = env.get("git_dirty", rev.endswith("+dirty"))
    return rev.removesuffix("+dirty")[:7] + (" (uncommitted changes)" if dirty else "")


def machine_line(name: str, data_dir: Path) -> str:
    """Machine, software, revision(s) and when, over every results file of source `name`."""
    src = sources.path_of(data_dir, name)
    sources.load(data_dir, name)  # missing or damaged: the error names the command
    folder = src if src.is_dir() else src.parent
    envs = []
    for path in sorted(folder.rglob("*.json")):
        try:
            envs.append(results.load(path).env)
        except results.ResultsError:
            continue  # not a results file
    times = sorted(datetime.strptime(e["time"], "%Y-%m-%dT%H:%M:%S%z") for e in envs)
    span = times[0].strftime("%Y-%m-%d %H:%M")
    if times[-1].date() != times[0].date():
        span += times[-1].strftime(" to %Y-%m-%d %H:%M")
    elif times[-1] != times[0]:
        span += times[-1].strftime("-%H:%M")
    revisions = sorted({_revision(e) for e in envs})
    machines = sorted({f"{machine_rows.machine_name(e, 'cpu_cores')} ({e['backend']}), jax {e['jax']}, "
                       f"flax {e.get('flax', '?')}" for e in envs})
    diffs = sorted({e["git_diff_file"] for e in envs if e.get("git_diff_file")})
    diff_note = f"; diffs beside the files: {', '.join(diffs)}" if diffs else (
        "; the diff was not recorded (written before results kept it)"
        if any("uncommitted" in r for r in revisions) else "")
    # Named by the results folder's last two parts (figures/data/...), however it was given.
    shown = Path(*Path(data_dir).resolve().parts[-2:]) / folder.relative_to(data_dir)
    return (f"*Measured on:* {'; '.join(machines)}. *Results:* {len(envs)} file(s) under "
            f"`{shown.as_posix()}/`, written {span} ({times[0].strftime('%z')}) from revision "
            f"{', '.join(revisions)}{diff_note}.")


# --- scaling study ---------------------------------------------------------------------------
def scaling_devices(mode: str, data_dir: Path) -> str:
    """images/s of each data-parallel strategy over 1-8 simulated devices, and bytes at 8."""
    rows = [r for r in speedup.device_rows(sources.load(data_dir, "scaling")["points"]) if r["mode"] == mode]
    counts = sorted({r["devices"] for r in rows if r["devices"] > 1})
    out = []
    for model in sorted({r["model"] for r in rows}, reverse=True):  # mlp before cnn
        here = [r for r in rows if r["model"] == model]
        base = next(r for r in here if r["strategy"] == "single" and r["devices"] == 1)
        for name in [s for s in STRATEGIES if any(r["strategy"] == s and r["devices"] > 1 for r in here)]:
            by_n = {r["devices"]: r for r in here if r["strategy"] == name}
            top = by_n[max(by_n)]
            out.append([model, name, num(base["images_per_sec"]),
                        *[num(by_n[n]["images_per_sec"]) if n in by_n else DASH for n in counts],
                        f"{top['speedup']:.2f}x",
                        f"{top['comm_bytes']:,} ({num(theory_total(top['comm_theory']))})",
                        f"{top['state_bytes']:,}"])
    n = counts[-1] if counts else 1
    return markdown(["model", "strategy", "1 device (`single`)", *[f"{c} devices" for c in counts],
                     f"speed-up at {n}", f"collective B/step at {n} (theory)", f"state B/device at {n}"],
                    out)


def scaling_ranks(data_dir: Path) -> str:
    """MPI ranks (one pinned thread each) against one rank and the best single process."""
    rows = speedup.rank_rows(sources.load(data_dir, "scaling")["points"])
    out = []
    for r in rows:
        best, busiest = r["best"], speedup.busiest_rank_bytes(r["comm_theory"])
        out.append([r["model"], r["mode"], f"`{r['strategy']}`", ranks_cell(r), r["batch"], num(r["ms"], 1),
                    num(r["images_per_sec"]), f"{r['speedup']:.2f}x ({100 * r['efficiency']:.0f}%)",
                    f"{r['speedup_vs_best']:.2f}x" + (f" ({num(best['images_per_sec'])}: {best['strategy']}, "
                                                      f"{best['devices']} dev)" if best else ""),
                    f"{r['comm_bytes']:,} ({num(theory_total(r['comm_theory']))})" if r["ranks"] > 1 else DASH,
                    f"{busiest[0]:,} / {busiest[1]:,}" if busiest and r["ranks"] > 1 else DASH,
                    num(r["comm_ms"], 1) if r["comm_ms"] is not None else DASH,
                    f"{r['state_bytes']:,}"])
    return markdown(["model", "mode", "strategy", "ranks", "global batch", "ms/step", "images/s",
                     "vs 1 rank (efficiency)", "vs best 1 process", "B/step per rank (theory)",
                     "busiest rank sent / received B (theory)", "comm alone, ms/step", "state B/rank"], out)


# --- strategies study ------------------------------------------------------------------------
def _study_mesh(row: dict) -> str:
    if row["processes"] > 1:
        return f"{row['processes']} ranks"
    mesh = format_mesh(row["mesh"]) if row["devices_used"] > 1 else "1 device"
    return mesh + (f", M={row['microbatches']}" if row.get("microbatches") else "")


def strategies_study(name: str, data_dir: Path) -> str:
    """The strategies study of source `name` (stack-mlp, or the CNN): one row per strategy."""
    metrics = sources.load(data_dir, name)["metrics"]
    rows = metrics["rows"]
    table = markdown(
        ["strategy", "family", "mesh", "ms/step", "images/s", "collective MB/step per device or rank (theory)",
         "state MB/device", "temp MB/device"],
        [[r["strategy"], r["family"], _study_mesh(r), num(r["ms_per_step"], 1), num(r["images_per_sec"]),
          f"{mb(r['collective_bytes_per_step'])} ({mb(theory_total(r['collective_bytes_theory']))})",
          mb(r["state_bytes_per_device"]), mb(r["activation_bytes_per_device"])] for r in rows])
    one_thread = metrics.get("one_thread")  # absent from runs without MPI rows, or before it
    return table if not one_thread else f"{table}\n\n{one_thread_note(one_thread)}"


# --- bounds study ----------------------------------------------------------------------------
def bounds(data_dir: Path) -> str:
    """Each model-parallel strategy's step against single's of the same run and device count."""
    rows = sources.load(data_dir, "bounds")["metrics"]["rows"]
    met = lambda r: DASH if r["met"] is None else ("yes" if r["met"] else "**no**")  # noqa: E731
    return markdown(
        ["devices", "strategy", "formulation", "ms/step", "x single", "limit", "within", "schedule's bubble"],
        [[r["devices"], r["label"], r["implementation"] or DASH, num(r["ms_per_step"], 1),
          num(r["ratio"], 2), DASH if r["limit"] is None else f"{r['limit']}x", met(r),
          DASH if r["bubble_fraction"] is None else f"{r['bubble_fraction']:.0%}"] for r in rows])


# --- pipeline study --------------------------------------------------------------------------
def pipeline(data_dir: Path) -> str:
    data = sources.load(data_dir, "pipeline")
    rows = data["metrics"]["rows"]
    by = {(r["schedule"], r["M"]): r for r in rows}
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    gems = [Gems.name] if Gems.name in names else []  # its own bubble (GPipe's and 1F1B's agree)
    bubble = lambda h: f"{h['bubble']:.3f} ({h['theory']:.3f})" if h else DASH  # noqa: E731
    out = []
    for m in sorted({r["M"] for r in rows}):
        here = [by.get((s, m), {}) for s in names]
        out.append([m, bubble(here[0]), *[bubble(by.get((g, m))) for g in gems],
                    *[num(h.get("images_per_sec")) for h in here],
                    *[num(h.get("activation_bytes", h["temp_bytes"]) / 2 ** 20, 1) if h.get("temp_bytes") else DASH
                      for h in here],
                    *[mb(h.get("moved_bytes", h.get("collective_bytes"))) for h in here]])
    table = markdown(["M", "bubble (S-1)/(M+S-1)", *[f"{g} bubble (S-2)/(2M+S-2)" for g in gems],
                      *[f"{s} images/s" for s in names], *[f"{s} activation MiB/device" for s in names],
                      *[f"{s} MB moved/step" for s in names]], out)
    single = data["metrics"].get("single") or {}
    if not single.get("images_per_sec"):
        return table  # measured before the study had its reference, or --no-measure
    return (f"The reference, `single` on one device at the same batch: {num(single['images_per_sec'])} "
            f"images/s ({num(single['step_ms'], 1)} ms/step).\n\n{table}")


# --- batch-size study ------------------------------------------------------------------------
def batch_size(data_dir: Path) -> str:
    r = sources.load(data_dir, "batch-size")
    rows, target = r["metrics"]["rows"], r["metrics"]["target_error"]
    reached = [x for x in rows if x["reached"]]
    regimes = dict(zip([x["batch_size"] for x in reached],
                       plots.scaling_regimes([x["batch_size"] for x in reached], [x["steps"] for x in reached])))
    fewest = min(x["examples"] for x in reached)
    lr = lambda x: f"2^{round(math.log2(x['best_lr']))}"
    return markdown(
        ["batch size", *[x["batch_size"] for x in rows]],
        [[f"steps to {target:g} error", *[num(x["steps"]) if x["reached"] else "not reached" for x in rows]],
         ["examples (k)", *[num(x["examples"] / 1e3) if x["reached"] else DASH for x in rows]],
         ["examples / fewest", *[f"{x['examples'] / fewest:.2f}" if x["reached"] else DASH for x in rows]],
         ["regime", *[regimes.get(x["batch_size"], DASH) for x in rows]],
         ["best lr (momentum)", *[f"{lr(x)} ({x['best_momentum']:g})" if x["reached"] else DASH for x in rows]]])


# --- time-to-accuracy study ------------------------------------------------------------------
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


def time_to_accuracy(data_dir: Path) -> str:
    """One row per strategy, per model its time to target (steps) and its state per device
    beside it: what model parallelism buys in memory and what it costs in time."""
    rows = sources.load(data_dir, "time-to-accuracy")["metrics"]["rows"]
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


# --- hparam study ----------------------------------------------------------------------------
def hparam(data_dir: Path) -> str:
    study = sources.load(data_dir, "hparam")
    trials = study["config"]["trial_list"]  # [seed, lr, momentum] per trial
    out = []
    for g in study["metrics"]["groups"]:
        b, s, q = g["best"], g["best_over_seeds"], g["best_over_seeds_sequential"]
        worst = max(range(len(trials)), key=lambda i: g["loss_diff_per_trial"][i])
        seed, lr, mom = trials[worst]
        out.append([f"width {g['width']}, depth {g['depth']}", f"{g['vmapped_s']:.1f} s",
                    f"{g['sequential_s']:.1f} s", f"{g['speedup']:.2f}x",
                    f"{g['vmapped_compile_s']:.1f} s / {g['sequential_compile_s']:.1f} s",
                    f"lr {b['lr']:g}, m {b['momentum']:g}, seed {b['seed']} ({b['val_accuracy']:.3f})",
                    f"({s['lr']:g}, {s['momentum']:g}): {s['mean_val_accuracy']:.3f}",
                    "yes" if (s["lr"], s["momentum"]) == (q["lr"], q["momentum"]) else "no",
                    f"{g['max_loss_diff']:.2g} (lr {lr:g}, m {mom:g}, seed {seed})"])
    return markdown(["group", "vmapped", "one by one", "speed-up", "compile (vmapped / one by one)",
                     "best trial (val. accuracy)", "best (lr, momentum) over seeds",
                     "same best over seeds one by one", "largest loss difference (trial)"], out)


# --- peers study ---------------------------------------------------------------------------
def peers(data_dir: Path) -> str:
    """jaxpar beside PyTorch: ms/step, images/s, the ratio to its PyTorch peer, FLOP/s and peak."""
    return peers_report.table(sources.load(data_dir, "peers"))


def peers_model_parallel(data_dir: Path) -> str:
    """The peers study's model-parallel section: PyTorch's pipelining and DTensor beside jaxpar's."""
    data = sources.load(data_dir, "peers")
    if "model_parallel" not in data["metrics"]:
        raise results.ResultsError(f"{sources.path_of(data_dir, 'peers')} has no model-parallel rows; "
                                   f"{sources.command(data_dir, 'peers')} with --sections model-parallel "
                                   "writes them")
    return peers_mp.table(data["metrics"]["model_parallel"])


# --- other machines (the machine command's folders) ----------------------------------------
def _scaling_cell(rows: list[dict], part: str) -> str:
    """'8: 5.1x (0.64)': the most workers of a part, speed-up over one and efficiency."""
    here = [r for r in rows if r["part"] == part and r["speedup"] is not None and r["workers"] > 1]
    if not here:
        return DASH
    top = max(here, key=lambda r: r["workers"])
    return f"{top['workers']}: {top['speedup']:.2f}x ({top['efficiency']:.2f})"


def other_machines(data_dir: Path) -> str:
    """Each measured machine's models: one-device step beside PyTorch eager, and the speed-up
    at the most devices and MPI ranks (efficiency in brackets)."""
    out = []
    for m in sources.load(data_dir, "machines")["machines"]:
        env, rows = m["env"], m["metrics"]["rows"]
        where = f"{m['files'][0].parent.name}: {machine_rows.machine_name(env)}"
        for model in dict.fromkeys(r["model"] for r in rows):
            here = [r for r in rows if r["model"] == model]
            one = next((r for r in here if r["part"] == "one-device"), None)
            torch = next((r for r in here if r["part"] == "torch"), None)
            out.append([where, model, DASH if one is None else f"{one['ms']:.2f}",
                        DASH if one is None else num(one["images_per_sec"]),
                        DASH if torch is None else num(torch["images_per_sec"]),
                        DASH if one is None or one["speedup"] is None else f"{one['speedup']:.2f}x",
                        _scaling_cell(here, "devices"), _scaling_cell(here, "ranks"),
                        f"jax {env['jax']}, {env['time'][:10]}, {_revision(env)}; "
                        f"{machine_rows.load_words(m)}"])
    return markdown(["machine", "model", "1 device ms/step", "images/s", "PyTorch eager images/s",
                     "jaxpar / PyTorch", "devices: speed-up (efficiency)",
                     "MPI ranks: speed-up (efficiency)", "software, date, revision; how busy"], out)


# --- network study --------------------------------------------------------------------------
def network(data_dir: Path) -> str:
    """Every strategy across 2 emulated hosts at each link bandwidth, and the crossovers."""
    m = sources.load(data_dir, "network")["metrics"]
    notes = [f"*{model}:* " + "; ".join(network_rows.crossover_words(c)) + "."
             for model, c in m["crossovers"].items()]
    return network_rows.table(m) + "\n" + "\n".join(notes)


# --- fault study ----------------------------------------------------------------------------
def faults_table(data_dir: Path) -> str:
    """Per family: a flap, a cut link, a lost host across 2 emulated hosts."""
    return faults.table(sources.load(data_dir, "faults")["metrics"])


def faults_overhead(data_dir: Path) -> str:
    """mpi-allreduce's step with and without the watchdog."""
    return faults.overhead_table(sources.load(data_dir, "faults")["metrics"])


TABLES: dict[str, Callable[[Path], str]] = {
    "strategy-list": strategy_list,
    "main-results": main_results,
    "scaling-devices": functools.partial(scaling_devices, "strong"),
    "scaling-devices-weak": functools.partial(scaling_devices, "weak"),
    "scaling-ranks": scaling_ranks,
    "strategies-study": functools.partial(strategies_study, "strategies"),
    "strategies-study-cnn": functools.partial(strategies_study, "cnn-strategies"),
    "pipeline": pipeline,
    "bounds": bounds,
    "batch-size": batch_size,
    "time-to-accuracy": time_to_accuracy,
    "hparam": hparam,
    "peers": peers,
    "cost-summary": tables_cost.summary,
    "cost-points": tables_cost.points,
    "cost-assumptions": tables_cost.assumptions,
    "cost-h100": tables_cost.h100,
    "peers-model-parallel": peers_model_parallel,
    "network": network,
    "faults": faults_table,
    "faults-overhead": faults_overhead,
    "other-machines": other_machines,
    # One line per results folder (the two training runs share theirs; each machine's row
    # names its own).
    **{f"machine-{name.removesuffix('-cnn')}": functools.partial(machine_line, name)
       for name in sources.SOURCES if name not in ("train-mlp", "machines")},
}
