"""Rank scaling, the scaling study's MPI part: R processes under `mpiexec` (this venv's own),
one pinned thread each (`single_thread`), one simulated device per process. Data-parallel
strategies (mpi4jax or jax.distributed) and model-parallel ones (tensor, pipeline, hybrid,
layer-split on one jax.distributed mesh over the ranks; mpi-pipeline, a stage per rank) alike,
each on the models it places; more ranks than cores are run all the same, reported as
oversubscribed.

    python -m experiments scaling --ranks 1,2 --out figures/data/scaling          # MLP and CNN
    python -m experiments scaling --ranks 1,2 --quick --device-counts 1 --out /tmp/ranks  # seconds
    python -m experiments scaling --ranks 1,2,4 --models stack-mlp --depth 4 \
        --rank-strategies tensor,pipeline,hybrid,layer-split,mpi-pipeline --out /tmp/ranks-mp

Baselines, in the same results folder: 1 single-threaded rank (`single`, no launcher) and the
best single-process configuration (the device points: `single` on 1 device and --strategies
on --device-counts devices, XLA's default threads on all cores). Rank points go to
OUT/ranks/<mode>/<model>-<strategy>-r<R>/, device points where the device study puts them
(OUT/<mode>/...), so either study reuses the other's.
"""

from __future__ import annotations

import importlib.util

from experiments.points.points import mpiexec
from experiments.studies.scaling.speedup import busiest_rank_bytes, rank_rows
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.mpi.common import INSTALL_HINT


def takes(strategy: str, model: str) -> bool:
    """Whether `strategy` places `model` (a rank point is planned only where it does)."""
    models = STRATEGIES[strategy].models
    return models is None or model in models


def check(strategies: tuple[str, ...], ranks: tuple[int, ...], models: tuple[str, ...]) -> None:
    """Fail before any work when a rank point cannot run, naming the fix."""
    if any(r < 1 for r in ranks):
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    for name in strategies:
        cls = STRATEGIES[name]
        if not (cls.uses_mpi or cls.multiprocess):
            able = [n for n, c in STRATEGIES.items() if c.uses_mpi or c.multiprocess]
            raise ConfigError(f"--rank-strategies {name}: rank points need a strategy that runs "
                              f"across processes ({', '.join(able)})")
        if not any(takes(name, m) for m in models):
            raise ConfigError(f"--rank-strategies {name} places --models {' or '.join(cls.models)}, "
                              f"none of --models {','.join(models)}; add one of them to --models")
    if max(ranks) > 1 and not mpiexec().exists():
        raise ConfigError(f"--ranks {max(ranks)} needs {mpiexec()}: {INSTALL_HINT}")
    if max(ranks) > 1 and importlib.util.find_spec("mpi4jax") is None:
        raise ConfigError(f"--ranks needs mpi4jax in this venv: {INSTALL_HINT}")


def table(points: list[dict]) -> str:
    """Markdown table of the rank points ('' if none), with both baselines named."""
    rows = rank_rows(points)
    if not rows:
        return ""
    lines = ["| mode | model | strategy | ranks | threads/rank | global batch | ms/step | images/s | "
             "speed-up vs 1 rank | efficiency | speed-up vs best 1-process | comm B/step/rank "
             "(theory) | busiest rank sent/received B (model) | comm alone ms | state B/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wire = busiest_rank_bytes(r["comm_theory"])
        comm_ms = "–" if r["comm_ms"] is None else f"{r['comm_ms']:.2f}"
        lines.append(
            f"| {r['mode']} | {r['model']} | {r['strategy']} | {ranks_cell(r)} | "
            f"{r['env'].get('threads_per_process', 1)} | {r['batch']} | {r['ms']:.1f} | "
            f"{r['images_per_sec']:,.0f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
            f"{r['speedup_vs_best']:.2f} | {r['comm_bytes']:,} ({r['comm_theory'].get('total', 0):,}) | "
            f"{'–' if wire is None else f'{wire[0]:,} / {wire[1]:,}'} | {comm_ms} | "
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


def ranks_cell(row: dict) -> str:
    """'4', or '4 (oversubscribed: 2 cores)' when the ranks outnumber the machine's cores."""
    if row["oversubscribed"]:
        return f"{row['ranks']} (oversubscribed: {row['cores']} cores)"
    return str(row["ranks"])
