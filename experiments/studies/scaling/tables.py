"""The scaling study's tables: the docs' (`report`: devices strong and weak, ranks) and its own
OUT/summary.md, from its points' bench results (`speedup`).

    TABLES["scaling-devices"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import functools
from pathlib import Path

from experiments.points import points
from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, markdown, num, percent, span, theory_total, times
from experiments.studies.scaling import speedup
from jaxpar.parallel import STRATEGIES


def devices_table(mode: str, data_dir: Path) -> str:
    """images/s of each data-parallel strategy over 1-8 simulated devices, and bytes at 8."""
    rows = [r for r in speedup.device_rows(sources.load_source(data_dir, "scaling")["points"])
            if r["mode"] == mode]
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


def ranks_table(data_dir: Path) -> str:
    """MPI ranks (one pinned thread each) against one rank and the best single process."""
    rows = speedup.rank_rows(sources.load_source(data_dir, "scaling")["points"])
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


def ranks_cell(row: dict) -> str:
    """'4', or '4 (oversubscribed: 2 cores)' when the ranks outnumber the machine's cores."""
    if row["oversubscribed"]:
        return f"{row['ranks']} (oversubscribed: {row['cores']} cores)"
    return str(row["ranks"])


def scaling_summary(folder: Path) -> str:
    """OUT/summary.md: markdown tables of every bench result under `folder`: device points with
    speed-up over 1 device, then rank points (if any) with speed-up over 1 rank and over the
    best 1-process."""
    found = speedup.load_points(folder)
    rows = speedup.device_rows(found)
    lines = ["| mode | model | strategy | devices | global batch | ms/step | images/s | speed-up | "
             "efficiency | collective B/step (theory) | state B/device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['model']} | {r['strategy']} | {r['devices']} | {r['batch']} | "
                     f"{r['ms']:.1f} | {r['images_per_sec']:,.0f} | {r['speedup']:.2f} | "
                     f"{r['efficiency']:.2f} | {r['comm_bytes']:,} ({r['comm_theory'].get('total', 0):,}) | "
                     f"{r['state_bytes']:,} |")
    if rows:
        env = rows[0]["env"]
        rounds = points.rounds_note(max((p["rounds"] for p in found), default=1), "point")
        lines.append(f"\n{env['cpu_cores']} CPU cores shared by all simulated devices of a point; "
                     f"threads: {env['threads']}; jax {env['jax']}; {rounds}.")
    ranks = ranks_summary(found)
    return "\n".join(lines) + "\n" + (f"\n{ranks}" if ranks else "")


def ranks_summary(found: list[dict]) -> str:
    """OUT/summary.md's table of the rank points ('' if none), with both baselines named."""
    rows = speedup.rank_rows(found)
    if not rows:
        return ""
    lines = ["| mode | model | strategy | ranks | threads/rank | global batch | ms/step | images/s | "
             "speed-up vs 1 rank | efficiency | speed-up vs best 1-process | comm B/step/rank "
             "(theory) | busiest rank sent/received B (model) | comm alone ms | state B/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wire = speedup.busiest_rank_bytes(r["comm_theory"])
        comm_ms = DASH if r["comm_ms"] is None else f"{r['comm_ms']:.2f}"
        lines.append(
            f"| {r['mode']} | {r['model']} | {r['strategy']} | {ranks_cell(r)} | "
            f"{r['env'].get('threads_per_process', 1)} | {r['batch']} | {r['ms']:.1f} | "
            f"{r['images_per_sec']:,.0f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
            f"{r['speedup_vs_best']:.2f} | {r['comm_bytes']:,} ({r['comm_theory'].get('total', 0):,}) | "
            f"{DASH if wire is None else f'{wire[0]:,} / {wire[1]:,}'} | {comm_ms} | "
            f"{r['state_bytes']:,} |")
    bests = {(r["mode"], r["model"]): r["best"] for r in rows if r["best"]}
    lines.append("\nBest single-process configuration (one process, all cores, XLA's default "
                 "threads): " + "; ".join(
                     f"{mode} {model}: {b['strategy']} on {b['devices']} device(s), "
                     f"{b['images_per_sec']:,.0f} images/s" for (mode, model), b in sorted(bests.items())))
    lines.append(f"\n{rows[0]['cores']} CPU cores; each rank one XLA thread pinned to core "
                 "rank % cores (more ranks than cores share them: 'oversubscribed', whose images/s "
                 "measure the sharing as much as the strategy). Ring all-reduce: 2(R-1)/R of the "
                 "fused buffer each way per rank; parameter server: the root receives R-1 gradients "
                 "and sends R-1 states; mpi-pipeline: M micro-batch activations forward and M "
                 "gradients backward per stage boundary. 'comm alone' times the step's MPI calls "
                 "without compute; state: parameters + optimizer state on the fullest rank.")
    return "\n".join(lines) + "\n"


def _pick(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def devices_findings(data_dir: Path) -> str:
    """What the device points show, in numbers from the scaling study's files."""
    rows = speedup.device_rows(sources.load_source(data_dir, "scaling")["points"])
    spread = lambda **m: span([r["speedup"] for r in _pick(rows, **m) if r["strategy"] != speedup.REFERENCE],  # noqa: E731
                              ".2f", "x")
    cnn = dict(model="cnn")
    mlp = dict(model="mlp")
    top = max(r["devices"] for r in rows)
    fsdp_weak = [r["speedup"] for r in _pick(rows, mode="weak", strategy="fsdp", **mlp)]
    others_weak = [r["speedup"] for r in _pick(rows, mode="weak", **mlp)
                   if r["strategy"] not in ("fsdp", speedup.REFERENCE)]
    single = _pick(rows, mode="strong", strategy=speedup.REFERENCE, devices=1, **mlp)[0]
    fsdp, plain = (_pick(rows, mode="strong", strategy=s, devices=top, **mlp)[0] for s in ("fsdp", "dp-shard-map"))
    return bullets([
        f"The CNN, whose one device already uses both cores: 2 devices run at {spread(mode='strong', devices=2, **cnn)} "
        f"one in strong scaling and {spread(mode='weak', devices=2, **cnn)} in weak; at {top} devices, strong, "
        f"{spread(mode='strong', devices=top, **cnn)}.",
        f"The MLP, a step of a few milliseconds: {spread(mode='strong', devices=2, **mlp)} one device on 2 "
        f"devices and {spread(mode='strong', devices=top, **mlp)} on {top} in strong scaling; in weak scaling "
        f"`fsdp` holds {span(fsdp_weak, '.2f', 'x')}, the others run {span(others_weak, '.2f', 'x')}.",
        f"The MLP's one-device step is bimodal: the {len(single['rounds_ms'])} rounds of `single` (the "
        f"baseline of both modes) took {listing([f'{ms:.1f}' for ms in single['rounds_ms']])} ms.",
        f"`fsdp` holds 1/{round(plain['state_bytes'] / fsdp['state_bytes'])} of the parameters and Adam "
        f"state per device at {top} devices, for {percent(fsdp['comm_bytes'] / plain['comm_bytes'] - 1)} "
        f"more bytes moved than a plain all-reduce ({fsdp['comm_bytes']:,} against {plain['comm_bytes']:,} B)."])


def _rank_row(rows: list[dict], strategy: str, ranks: int = 2, mode: str = "strong", model: str = "cnn") -> dict:
    (row,) = _pick(rows, strategy=strategy, ranks=ranks, mode=mode, model=model)
    return row


def ranks_findings(data_dir: Path) -> str:
    """What the rank points show, in numbers from the scaling study's files."""
    rows = speedup.rank_rows(sources.load_source(data_dir, "scaling")["points"])
    ring = {m: _rank_row(rows, "mpi-allreduce", mode=m) for m in ("strong", "weak")}
    server = {m: _rank_row(rows, "mpi-param-server", mode=m) for m in ("strong", "weak")}
    eff = lambda r: percent(r["efficiency"])  # noqa: E731
    one = _rank_row(rows, speedup.REFERENCE, ranks=1)
    model_parallel = [s for s in ("mpi-pipeline", "pipeline", "tensor", "tensor-auto", "layer-split")
                      if _pick(rows, strategy=s, ranks=2, mode="strong", model="cnn")]
    at = lambda s, n=2: _rank_row(rows, s, ranks=n)  # noqa: E731
    four = [s for s in dict.fromkeys(r["strategy"] for r in _pick(rows, ranks=4, mode="strong", model="cnn"))]
    return bullets([
        f"The CNN on 2 single-threaded ranks: `mpi-allreduce` reaches {eff(ring['strong'])} (strong) and "
        f"{eff(ring['weak'])} (weak) scaling efficiency over one rank, the parameter server "
        f"{eff(server['strong'])} and {eff(server['weak'])}; against the best single process the "
        f"all-reduce's two ranks run {times(ring['strong']['speedup_vs_best'])} (strong) and "
        f"{times(ring['weak']['speedup_vs_best'])} (weak).",
        f"The MLP on 2 ranks: `mpi-allreduce` runs {times(_rank_row(rows, 'mpi-allreduce', model='mlp')['speedup'])} "
        f"one rank in strong scaling and {times(_rank_row(rows, 'mpi-allreduce', mode='weak', model='mlp')['speedup'])} "
        "in weak.",
        f"jax.distributed's collectives keep up with mpi4jax's: on the CNN, `dp-auto` runs "
        f"{times(at('dp-auto')['speedup'])} one rank ({at('dp-auto')['ms']:.1f} ms against "
        f"`mpi-allreduce`'s {ring['strong']['ms']:.1f}), `dp-pmap` {times(at('dp-pmap')['speedup'])}.",
        f"The model-parallel strategies on 2 ranks, against one rank's {one['ms']:.1f} ms (the median of its "
        f"{len(one['rounds_ms'])} rounds): " + ", ".join(
            f"`{s}` {times(at(s)['speedup'])} ({at(s)['ms']:.1f} ms)" for s in model_parallel) + ".",
        "On 4 ranks, two to a core: " + ", ".join(
            f"`{s}` {times(at(s, 4)['speedup'])}" for s in four if s != speedup.REFERENCE) + "."])


TABLES = {"scaling-devices": functools.partial(devices_table, "strong"),
          "scaling-devices-weak": functools.partial(devices_table, "weak"),
          "scaling-ranks": ranks_table,
          "scaling-devices-findings": devices_findings, "scaling-ranks-findings": ranks_findings}
