"""Strategies study: one model under every strategy at the same device count — step time,
images/s, compile time, collective bytes per step (measured, and theory where the strategy
states one), parameter + optimizer state and temporary (activation) memory per device.

    python -m experiments strategies --out figures/data/strategies     # full: minutes
    python -m experiments strategies --quick --out /tmp/strategies     # 3 strategies, seconds

One `bench --no-matmul-peak` process per strategy (`experiments.points.bench_point`: a stopped
study resumes, complete points are not run again): every single-process strategy on --devices
simulated devices with a mesh that uses all of them (`mesh_for`), the MPI strategies as
--devices single-threaded ranks when mpi4jax is installed (else recorded as skipped, with
why). Writes OUT/points/<strategy>/result.json, OUT/strategies.json (RunResult: config, env,
metrics.rows; `experiments.plots.strategies_bars` draws it) and OUT/summary.md, atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

from experiments.points import PointError, bench_point, reusable
from jaxpar import results
from jaxpar.config import ConfigError
from jaxpar.mesh import DATA, STAGE, TENSOR, format_mesh, parse_mesh
from jaxpar.parallel import STRATEGIES

POINT_TIMEOUT_S = 600  # one bench process (or mpiexec job); a hang must not stall the study
QUICK_TIMEOUT_S = 120
# --quick: enough to check the study's properties (no communication for single; fsdp keeps
# 1/N of dp-auto's state; explicit collectives equal theory), one process of seconds each.
QUICK_STRATEGIES = ("single", "dp-auto", "fsdp")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/strategies", help="output folder (default: results/strategies)")
    p.add_argument("--quick", action="store_true",
                   help=f"stack-mlp width 32 depth 4, {','.join(QUICK_STRATEGIES)}, 3 timed steps")
    p.add_argument("--model", default="stack-mlp", help="model every strategy runs (default: stack-mlp; "
                                                        "tensor, pipeline, layer-split and hybrid need "
                                                        "identical blocks)")
    p.add_argument("--width", type=int, default=256, help="hidden width (default: 256)")
    p.add_argument("--depth", type=int, default=8, help="blocks (default: 8; a multiple of --devices "
                                                        "for pipeline and layer-split)")
    p.add_argument("--devices", type=int, default=4,
                   help="devices every strategy uses (MPI strategies: that many ranks) (default: 4)")
    p.add_argument("--batch-size", type=int, default=128, help="global batch (default: 128)")
    p.add_argument("--microbatches", type=int, default=8,
                   help="pipeline and hybrid micro-batches per global batch (default: 8)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per strategy (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated (default: every strategy; --quick: "
                        f"{','.join(QUICK_STRATEGIES)})")


def mesh_for(strategy: str, devices: int) -> str:
    """The --mesh a single-process strategy takes on `devices` devices: its own default
    (`Strategy.default_mesh`), written out so the point's command line says it."""
    if strategy == "single":
        return ""
    return format_mesh(STRATEGIES[strategy].default_mesh(devices))


def _is_mpi(strategy: str) -> bool:
    return STRATEGIES[strategy].uses_mpi


def _split(names: list[str], axis: str, devices: int) -> list[str]:
    """The strategies of `names` that cut the model over `axis` on all `devices` devices."""
    return [s for s in names if not _is_mpi(s)
            and STRATEGIES[s].default_mesh(devices).get(axis, 1) == devices > 1]


def _mpi_missing() -> str | None:
    """Why the MPI strategies cannot run here, or None when they can."""
    from experiments.rank_scaling import mpiexec
    from jaxpar.parallel.mpi_common import INSTALL_HINT

    if importlib.util.find_spec("mpi4jax") is None:
        return f"mpi4jax is not installed in this venv; {INSTALL_HINT}"
    if not mpiexec().exists():
        return f"{mpiexec()} is missing; {INSTALL_HINT}"
    return None


def plan(args: argparse.Namespace) -> tuple[list[str], dict[str, str], dict]:
    """Check the options before any work (ConfigError names the fix); apply --quick.

    Returns:
      (strategies to run, {strategy: reason} of those skipped, the study config)
    """
    if args.quick:
        args.width, args.depth, args.iters, args.warmup = 32, 4, 3, 1
    # default order: by family (reference, data, model, hybrid, multi-process), as the table reads
    everything = list(STRATEGIES)  # by family, as the registry lists them
    names = args.strategies.split(",") if args.strategies else (
        list(QUICK_STRATEGIES) if args.quick else everything)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(everything)}")
    _check(args, names)
    n, skipped = args.devices, {}
    mpi = [s for s in names if _is_mpi(s)]
    why = _mpi_missing() if mpi else None
    if why:
        skipped = {s: why for s in mpi}
    elif mpi and n < 2:
        skipped = {s: "MPI strategies need --devices >= 2 ranks" for s in mpi}
    config = {"model": args.model, "width": args.width, "depth": args.depth, "devices": n,
              "batch_size": args.batch_size, "microbatches": args.microbatches, "iters": args.iters,
              "warmup": args.warmup, "quick": args.quick, "strategies": names,
              "meshes": {s: ("" if _is_mpi(s) else mesh_for(s, n)) for s in names}}
    return [s for s in names if s not in skipped], skipped, config


def _check(args: argparse.Namespace, names: list[str]) -> None:
    """Every option value, for every strategy in `names`, before any work."""
    from jaxpar.models import MODELS

    if args.model not in MODELS:
        raise ConfigError(f"--model {args.model!r}: choose from {', '.join(MODELS)}")
    for flag, value in (("--devices", args.devices), ("--batch-size", args.batch_size),
                        ("--iters", args.iters), ("--microbatches", args.microbatches),
                        ("--width", args.width), ("--depth", args.depth)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    n, bad = args.devices, []
    for s in names:
        takes = STRATEGIES[s].models
        if takes is not None and args.model not in takes:
            bad.append(f"{s} takes --model {' or '.join(takes)}")
    if _split(names, STAGE, n) and args.depth % n:
        bad.append(f"--depth {args.depth} blocks do not split into {n} stages (pipeline, layer-split): "
                   f"make --depth a multiple of --devices")
    if _split(names, TENSOR, n) and args.width % n:
        bad.append(f"--width {args.width} does not split over tensor={n}: make it a multiple of --devices")
    if "hybrid" in names and n % 2:
        bad.append(f"hybrid runs 2 stages: give an even --devices, not {n}")
    if "pipeline" in names and n < 2:
        bad.append("pipeline needs --devices >= 2 stages")
    for name in ("pipeline", "hybrid"):
        if name not in names or (name == "hybrid" and n % 2):
            continue
        shards = parse_mesh(mesh_for(name, n)).get(DATA, 1)
        if args.batch_size % (shards * args.microbatches):
            bad.append(f"{name}: --microbatches {args.microbatches} must divide the --batch-size "
                       f"{args.batch_size} rows of each of its {shards} data shard(s)")
    if args.batch_size % n:
        bad.append(f"--batch-size {args.batch_size} must be a multiple of --devices {n}")
    if bad:
        raise ConfigError("; ".join(bad) + " (or leave those strategies out with --strategies)")


def bench_flags(strategy: str, config: dict) -> list[str]:
    """One point's `bench` flags (an MPI point: those of each rank, one device each)."""
    mpi = _is_mpi(strategy)
    flags = ["--model", config["model"], "--width", str(config["width"]), "--depth",
             str(config["depth"]), "--strategy", strategy, "--devices", "1" if mpi else
             str(config["devices"]), "--batch-size", str(config["batch_size"]), "--iters",
             str(config["iters"]), "--warmup", str(config["warmup"]), "--no-matmul-peak"]
    if config["meshes"][strategy]:
        flags += ["--mesh", config["meshes"][strategy]]
    if strategy in ("pipeline", "hybrid"):
        flags += ["--microbatches", str(config["microbatches"])]
    return flags


def _ranks(strategy: str, config: dict) -> int | None:
    """An MPI strategy's rank count (one device each); None for a single-process strategy."""
    return config["devices"] if _is_mpi(strategy) else None


def row(strategy: str, result: dict) -> dict:
    """One table row from a bench result dict."""
    m, env, desc = result["metrics"], result["env"], result["strategy"]
    theory = m.get("collective_bytes_theory") or {}
    mem = m["memory_per_device"]
    processes = env.get("mpi_ranks", 1)
    return {
        "strategy": strategy,
        "family": STRATEGIES[strategy].family,
        "mesh": {"ranks": processes} if _is_mpi(strategy) else desc.get("mesh", {}),
        "devices_used": desc.get("devices", 1),
        "processes": processes,
        "threads_per_process": env.get("threads_per_process"),
        "microbatches": desc.get("microbatches"),
        "ms_per_step": m["step_time_ms_median"],
        "ms_per_step_min": m["step_time_ms_min"],
        "images_per_sec": m["images_per_sec"],
        "compile_s": m["compile_s"],
        "collective_bytes_per_step": m["collective_bytes_per_step"],
        "collective_bytes_theory": theory.get("total"),
        "collective_bytes_by_op": m.get("collective_bytes_by_op", {}),
        "state_bytes_per_device": m["state_bytes_per_device"],
        "temp_bytes_per_device": mem["temp_bytes"],
        # what the step holds besides its state: XLA's temporaries (layer-split: the residuals
        # its stage programs hand from forward to backward, see LayerSplit.accounting)
        "activation_bytes_per_device": m.get("activation_bytes_per_device", mem["temp_bytes"]),
        "argument_bytes_per_device": mem["argument_bytes"],
        "bubble_fraction": m.get("bubble_fraction"),
    }


def run(args: argparse.Namespace) -> list[Path] | None:
    """Every strategy's point, then OUT/strategies.json and OUT/summary.md (atomically).
    Returns their paths, or None when a point failed (the others are still written)."""
    names, skipped, config = plan(args)
    out = results.ensure_writable(args.out)
    # Points left by an earlier run: reused when measured with these settings, refused
    # (ConfigError) when not, all before any work.
    done = [s for s in names if reusable(out / "points" / s, bench_flags(s, config), _ranks(s, config))]
    if done:
        print(f"{len(done)} of {len(names)} points already done in {out}; running the rest")
    timeout = QUICK_TIMEOUT_S if args.quick else POINT_TIMEOUT_S
    rows, failed, env = [], {}, None
    for strategy in names:
        folder = out / "points" / strategy
        mpi = _is_mpi(strategy)
        where = f"{config['devices']} ranks" if mpi else f"mesh {config['meshes'][strategy] or 'one device'}"
        print(f"{strategy:16} {where}", flush=True)
        try:
            result = bench_point(folder, bench_flags(strategy, config), timeout, _ranks(strategy, config))
        except PointError as e:
            print(f"  failed: {e}", flush=True)
            failed[strategy] = str(e)[-2000:]
            continue
        rows.append(row(strategy, result))
        print(f"  {rows[-1]['ms_per_step']:.2f} ms/step, {rows[-1]['images_per_sec']:,.0f} images/s",
              flush=True)
        if not mpi and env is None:
            env = result["env"]  # the machine as the single-process points see it
    study = results.RunResult(kind="strategies", config=config, env=env or results.environment(),
                              metrics={"rows": rows, "skipped": skipped, "failed": failed})
    paths = [results.write_atomic(out / "strategies.json", study.to_json() + "\n"),
             results.write_atomic(out / "summary.md", summary(dataclasses.asdict(study)))]
    print(paths[1].read_text())
    return None if failed else paths


def _bytes(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


def summary(study: dict) -> str:
    """Markdown table of a strategies.json dict, with the machine behind the numbers."""
    cfg, env, m = study["config"], study["env"], study["metrics"]
    lines = [f"{cfg['model']} width {cfg['width']} depth {cfg['depth']}, global batch "
             f"{cfg['batch_size']}, {cfg['devices']} devices per strategy, median of {cfg['iters']} "
             f"steps after {cfg['warmup']}.\n",
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
    for name, why in {**m["skipped"], **m.get("failed", {})}.items():
        status = "skipped" if name in m["skipped"] else "failed"
        lines.append(f"\n{name}: {status} ({why.strip().splitlines()[-1] if why.strip() else ''})")
    return "\n".join(lines) + "\n"
