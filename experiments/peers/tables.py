"""The peers study's tables: the docs' (`report`: jaxpar beside PyTorch, and the model-parallel
section) and its own OUT/summary.md, from its peers.json.

    TABLES["peers"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

from pathlib import Path

from experiments.peers.rows import chained
from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, times
from jaxpar import results


def peers_report_table(data_dir: Path) -> str:
    """jaxpar beside PyTorch: ms/step, images/s, the ratio to its PyTorch peer, FLOP/s and peak."""
    return peers_table(sources.load_source(data_dir, "peers"))


def peers_model_parallel(data_dir: Path) -> str:
    """The peers study's model-parallel section: PyTorch's pipelining and DTensor beside jaxpar's."""
    data = sources.load_source(data_dir, "peers")
    if "model_parallel" not in data["metrics"]:
        raise results.ResultsError(f"{sources.path_of(data_dir, 'peers')} has no model-parallel rows; "
                                   f"{sources.source_command(data_dir, 'peers')} with --sections model-parallel "
                                   "writes them")
    return mp_table(data["metrics"]["model_parallel"])


def _num(x, fmt: str) -> str:
    return DASH if x is None else format(x, fmt)


def peers_table(data: dict) -> str:
    """The markdown table of a peers.json dict: one row per model and configuration (also
    the `report:peers` table of the docs)."""
    lines = ["| model | framework | configuration | processes x threads | ms/step | images/s | "
             "jaxpar / PyTorch (peer) | GFLOP/s | % of matmul peak | first step / compile s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["metrics"]["rows"]:
        ratio = "" if r["peer"] is None else f"{r['ratio_vs_peer']:.2f} ({r['peer'].removeprefix('torch-')})"
        lines.append(
            f"| {r['model']} | {r['framework']} | {r['what']} | {r['processes']} x {r['threads_per_process']} | "
            f"{r['ms_per_step']:.2f} | {r['images_per_sec']:,.0f} | {ratio} | {_num(r['achieved_gflops'], '.1f')} | "
            f"{_num(r['percent_of_peak'], '.1f')} | {_num(r['first_step_s'], '.2f')} |")
    return "\n".join(lines)


def peers_summary(data: dict) -> str:
    """OUT/summary.md: `peers_table` of a peers.json dict, with the machine, threads and peaks behind it."""
    cfg, env, m = data["config"], data["env"], data["metrics"]
    mp = m.get("model_parallel")
    mp_load = "" if mp is None else (
        "\nModel-parallel section: 1-minute load average before each round and at the end: "
        + ", ".join(f"{x:.1f}" for x in mp["load_average_1min"]) + f" ({env['cpu_cores']} cores).\n")
    if not m["rows"]:  # only the model-parallel section ran
        return mp_table(mp) + "\n" + mp_load
    lines = [f"Global batch {cfg['batch_size']}, Adam (constant lr {cfg['lr']:g}, betas 0.9/0.999, "
             f"eps 1e-8; PyTorch's `{cfg['adam']}` kernel), synthetic data of the real shapes; "
             f"{cfg['rounds']} interleaved rounds, each a median of {cfg['iters']} steps after "
             f"{cfg['warmup']}; ms/step is the median of the round medians.\n", peers_table(data)]
    peaks = {r["framework"]: r["peak_gflops"] for r in m["rows"]}
    lines += [
        "\nParameters (jaxpar = its PyTorch twin): "
        + ", ".join(f"{k} {v:,}" for k, v in m["param_counts"].items()) + ".",
        f"\nMatmul peak (2048^3 f32, measured in every round by `single` and PyTorch eager, median): "
        f"XLA {_num(peaks.get('jaxpar'), '.1f')} GFLOP/s, PyTorch {_num(peaks.get('pytorch'), '.1f')} GFLOP/s. "
        "GFLOP/s counts one global step's FLOPs (XLA's cost analysis of jaxpar's `single` step) "
        "for every configuration.",
        f"\n{env['cpu_cores']} CPU cores ({env.get('cores_available')} available); jax {env['jax']}, "
        f"torch {env.get('torch')}. Threads: single-process jaxpar points use XLA's default pool "
        f"({env.get('threads_per_process')} threads, the cores available); PyTorch single-process "
        f"points torch.set_num_threads({env.get('torch_threads')}) (interop "
        f"{env.get('torch_interop_threads')}); rank points run {cfg['ranks']} processes x 1 thread, "
        "each pinned to core rank % cores (jaxpar --single-thread under mpiexec; DDP ranks "
        "set_num_threads(1) and sched_setaffinity). torch.compile: "
        f"{env.get('torch_compile')} (C++ compiler: {env.get('cxx_compiler') or 'none found'}).",
        "\nBest single-process jaxpar configuration, screened per model (images/s, "
        f"{cfg['screen_iters']} calls each, of one step or of the steps per dispatch shown): " + "; ".join(
            f"{model}: " + ", ".join(f"{c['strategy']} x{c['devices']}{chained(c)} {c['images_per_sec']:,.0f}"
                                     for c in b["candidates"]) for model, b in m["best"].items())]
    slower = [r for r in m["rows"] if r.get("screened_pick")]
    if slower:
        lines.append("\nWhere the best single-process row is `single`, the screen's pick ran slower in "
                     "the rounds than `single` did: " + "; ".join(
                         f"{r['model']}: {r['screened_pick']}, {r['screened_pick_ms_per_step']:.2f} ms/step"
                         for r in slower) + ".")
    load, cores = env.get("load_average_1min") or [0], env["cpu_cores"]
    # The average counts the study's own processes: a point's busy threads, and the rank
    # points' spin-waiting ranks and launcher, leave it near or a little above the cores.
    lines.append(f"\n1-minute load average before each round and at the end: "
                 f"{', '.join(f'{x:.1f}' for x in load)} ({cores} cores; the study's own "
                 "points count in it, up to about one more than the cores)." + (
                     " Other work shared the machine: these timings are provisional (PyTorch's "
                     "OpenMP threads spin-wait and lose most when cores are oversubscribed)."
                     if max(load) > cores + 1 else ""))
    for name, why in {**m["skipped"], **m["failed"]}.items():
        status = "skipped" if name in m["skipped"] else "failed"
        lines.append(f"\n{name}: {status} ({why.strip().splitlines()[-1] if why.strip() else ''})")
    return "\n".join(lines) + "\n" + ("" if mp is None else f"\n{mp_table(mp)}\n" + mp_load)


def mp_table(mp: dict) -> str:
    """The section's markdown table and the settings behind it."""
    cfg = mp["config"]
    names = cfg.get("stage_layers")  # recorded since the cut may fall inside conv2
    starts = ", ".join(f"{s} ({names[s]})" if names else str(s) for s in cfg["stage_starts"])
    lines = [f"Model parallelism: {cfg['mp_model']} on {cfg['ranks']} ranks; the pipelines cut it into "
             f"{cfg['ranks']} stages starting at layers {starts} (jaxpar's cut, both frameworks), {cfg['microbatches']} "
             f"micro-batches, global batch {cfg['batch_size']}, Adam; {cfg['rounds']} interleaved "
             f"rounds of {cfg['iters']} steps after {cfg['warmup']}.\n",
             "| model | framework | configuration | processes x threads | ms/step | images/s | "
             "jaxpar / PyTorch (same kind) | first step / compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in mp["rows"]:
        ratio = "" if r["peer"] is None else f"{r['ratio_vs_peer']:.2f} ({r['peer'].removeprefix('torch-')})"
        lines.append(f"| {cfg['mp_model']} | {r['framework']} | {r['what']} | {r['processes']} x "
                     f"{r['threads_per_process']} | {r['ms_per_step']:.2f} | {r['images_per_sec']:,.0f} | "
                     f"{ratio} | {r['first_step_s']:.2f} |")
    for name, why in {**mp["skipped"], **mp["failed"]}.items():
        status = "skipped" if name in mp["skipped"] else "failed"
        lines.append(f"\n{name}: {status} ({why.strip().splitlines()[-1] if why.strip() else ''})")
    return "\n".join(lines)


PEER_NAMES = {"torch-eager": "PyTorch eager", "torch-compile": "PyTorch's `torch.compile`",
              "torch-ddp": "PyTorch DDP"}


def peers_findings(data_dir: Path) -> str:
    """jaxpar over PyTorch per model and configuration, the best single process, the peaks."""
    m = sources.load_source(data_dir, "peers")["metrics"]
    rows = {(r["model"], r["config"]): r for r in m["rows"]}
    models = list(dict.fromkeys(r["model"] for r in m["rows"]))
    ratio = lambda r: f"{times(r['ratio_vs_peer'])} {PEER_NAMES[r['peer']]}"  # noqa: E731
    lines = [f"{model}: `single` on one device runs {ratio(rows[(model, 'jaxpar-single')])}"
             + (f", `mpi-allreduce` on 2 single-threaded ranks {ratio(rows[(model, 'jaxpar-ranks')])} on the same ranks"
                if (model, "jaxpar-ranks") in rows else "") + "." for model in models]
    best = {model: rows[(model, "jaxpar-best")] for model in models if (model, "jaxpar-best") in rows}
    slower = [r for r in best.values() if r.get("screened_pick")]
    lines.append("jaxpar's best single-process configuration, the faster of the screen's pick and `single` in "
                 "the rounds: " + "; ".join(f"{model}: {r['what'].removeprefix('best single-process: ')}"
                                            for model, r in best.items())
                 + "".join(f"; the {r['model']}'s pick, {r['screened_pick']}, ran "
                           f"{r['screened_pick_ms_per_step']:.1f} ms a step in the rounds against `single`'s "
                           f"{rows[(r['model'], 'jaxpar-single')]['ms_per_step']:.1f}" for r in slower) + ".")
    peaks = {r["framework"]: r["peak_gflops"] for r in m["rows"] if r["peak_gflops"]}
    if len(peaks) == 2:
        lines.append(f"The matmul peak (2048^3 float32, measured in every round): XLA {peaks['jaxpar']:.0f} GFLOP/s, "
                     f"PyTorch {peaks['pytorch']:.0f} ({times(peaks['jaxpar'] / peaks['pytorch'], 1)}).")
    return bullets(lines)


SCHEDULE_WORDS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B",
                  "looped-bfs": "looped BFS", "zb-h1": "ZB-H1", "zbv": "ZBV", "dualpipev": "DualPipeV"}


def _runs(rows: dict, kind: str, schedules: list[str]) -> dict[str, dict]:
    """{schedule: row} of one jaxpar configuration kind (e.g. 'jaxpar-mpi-pipeline')."""
    return {s: rows[f"{kind}-{s}"] for s in schedules if f"{kind}-{s}" in rows}


def _over_peer(rows: dict, runs: dict[str, dict], what: str) -> str:
    return (f"{what}: " + ", ".join(
        f"{times(r['ratio_vs_peer'])} under {SCHEDULE_WORDS[s]} ({r['ms_per_step']:.1f} ms against "
        f"{rows[r['peer']]['ms_per_step']:.1f})" for s, r in runs.items())) if runs else ""


def _against_1f1b(runs: dict[str, dict], what: str) -> str:
    """Each schedule's step against 1F1B's on the same runtime: what a schedule buys."""
    if "1f1b" not in runs or len(runs) < 2:
        return ""
    base = runs["1f1b"]["ms_per_step"]
    return (f"{what}, each schedule's step against 1F1B's ({base:.1f} ms): " + ", ".join(
        f"{SCHEDULE_WORDS[s]} {100 * (r['ms_per_step'] / base - 1):+.1f}%" for s, r in runs.items() if s != "1f1b"))


def peers_mp_findings(data_dir: Path, aim: float = 1.5) -> str:
    """jaxpar's model parallelism over PyTorch's, per configuration, what meets `aim`, and
    each schedule against 1F1B on the same ranks."""
    mp = sources.load_source(data_dir, "peers")["metrics"]["model_parallel"]
    rows = {r["config"]: r for r in mp["rows"]}
    jaxpar = [r for r in mp["rows"] if r["peer"]]
    schedules = mp["config"]["schedules"]
    kinds = {"jaxpar-mpi-pipeline": "`mpi-pipeline`, a stage per MPI rank",
             "jaxpar-pipeline-ranks": "`pipeline` on one jax.distributed mesh over the 2 ranks",
             "jaxpar-pipeline-devices": "`pipeline` on 2 simulated devices in one process"}
    lines = [_over_peer(rows, _runs(rows, k, schedules), f"{what}, over PyTorch's pipelining")
             for k, what in kinds.items()]
    lines += [_against_1f1b(_runs(rows, k, schedules), what) for k, what in kinds.items()]
    if "jaxpar-tensor-ranks" in rows:
        r = rows["jaxpar-tensor-ranks"]
        lines.append(f"`tensor` over the 2 ranks: {times(r['ratio_vs_peer'])} DTensor's split "
                     f"({r['ms_per_step']:.1f} ms against {rows[r['peer']]['ms_per_step']:.1f})")
    short = [r["what"].split(",")[0] for r in jaxpar if r["ratio_vs_peer"] < aim]
    lines.append(f"Every jaxpar row runs {aim}x its PyTorch peer or more" if not short else
                 f"Below {aim}x their PyTorch peer: {listing(short)}")
    return bullets([line + "." for line in lines if line])


TABLES = {"peers": peers_report_table, "peers-model-parallel": peers_model_parallel,
          "peers-findings": peers_findings, "peers-model-parallel-findings": peers_mp_findings}
