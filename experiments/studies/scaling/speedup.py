"""Speed-up and efficiency from the scaling study's bench results, for its table and figures.

    points = load_points("figures/data/scaling")
    device_rows(points)   # 1 process, N simulated devices sharing every core
    rank_rows(points)     # R MPI processes, one pinned thread each

Each point's result records its mode (config["point"]["labels"]["mode"], written by the
study), never inferred from where the file lies. A point measured in rounds (FOLDER/r<k>/) is
one record: the round whose step is the median of its configuration's rounds (for an even
count, the faster of the middle two; the weak mode's `single` runs the strong mode's
configuration, so both count its rounds of both), with its own count of rounds in `rounds`
and every round of its configuration's ms/step in `rounds_ms`.
Two kinds of point live in one results folder:
  - device points: one process, N simulated CPU devices, XLA's default threads (all cores);
    speed-up over `single` on 1 device of the same mode and model;
  - rank points (run with --single-thread): R processes, one thread each; speed-up over ONE
    single-threaded rank, and over the best single-process point of the same mode and model
    (the fastest device point: any strategy, any device count, all cores).
Speed-up is a ratio of images/s, so in weak scaling (batch grows with N) it is throughput
gained; efficiency is speed-up / N.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.points.points import point_folder
from jaxpar import results
from jaxpar.errors import ResultsError
from jaxpar.parallel import STRATEGIES

# The baseline of every speed-up: the reference family's strategy (one device, plain jit).
REFERENCE = next(name for name, cls in STRATEGIES.items() if cls.family == "reference")


def load_points(folder: str | Path) -> list[dict[str, Any]]:
    """One flat record per point under `folder`, with the mode it recorded: the median of
    every round of its configuration in the study (the strong and weak modes' `single` on one
    device or rank is one configuration: its rounds in both modes count for both)."""
    by_point: dict[Path, list[dict]] = {}
    by_config: dict[str, list[dict]] = {}
    for path in sorted(Path(folder).rglob(results.RESULT_FILE)):
        record = _record(path)
        by_point.setdefault(point_folder(path), []).append(record)
        by_config.setdefault(record["config"], []).append(record)
    found = []
    for rounds in by_point.values():
        pooled = sorted(by_config[rounds[0]["config"]], key=lambda p: p["ms"])
        median = pooled[(len(pooled) - 1) // 2]
        own = {k: rounds[0][k] for k in ("mode", "group")}
        found.append({**median, **own, "rounds": len(rounds), "rounds_ms": [p["ms"] for p in pooled]})
    return found


def _record(path: Path) -> dict[str, Any]:
    """The flat record of one bench result file."""
    r = results.load(path)
    m, env = r.metrics, r.env
    mode = recorded_mode(r, path)
    labels = {k: v for k, v in r.config["point"]["labels"].items() if k != "mode"}
    return {
        "mode": mode,
        # what was measured (on how many devices and ranks), whatever the mode it was for
        "config": json.dumps({**r.config, "out": None, "point": {**r.config["point"], "labels": labels},
                              "on": [env["device_count"], env.get("mpi_ranks", 1)]}, sort_keys=True),
        "model": r.config["model"]["model"],
        # Baselines match on the whole model config (a tiny quick MLP is not the full one).
        "group": (mode, json.dumps(r.config["model"], sort_keys=True)),
        "strategy": r.strategy.get("strategy"),
        "devices": env["device_count"],
        "ranks": env.get("mpi_ranks", 1),
        "single_thread": bool(r.config["parallel"].get("single_thread")),
        "threads": env["threads"],
        "cores": env["cpu_cores"],
        "batch": r.config["data"]["batch_size"],
        "ms": m["step_time_ms_median"],
        "images_per_sec": m["images_per_sec"],
        "comm_bytes": m["collective_bytes_per_step"],
        "comm_theory": m.get("collective_bytes_theory", {}),
        "comm_ms": m.get("comm_time_ms_median"),
        "state_bytes": m["state_bytes_per_device"],
        "env": env,
    }


def recorded_mode(result: results.RunResult, path: Path) -> str:
    """'strong' or 'weak', as the scaling study recorded it in the point's result."""
    try:
        return result.config["point"]["labels"]["mode"]
    except (KeyError, TypeError):
        raise ResultsError(f"{path} does not record its scaling mode (strong or weak): it was not "
                           f"written by the scaling study; run `python -m experiments scaling` "
                           f"into a fresh --out") from None


def device_rows(points: list[dict]) -> list[dict]:
    """Device points with 'speedup' (over `single` on 1 device) and 'efficiency' (/ devices)."""
    rows = [p for p in points if not p["single_thread"]]
    base = {p["group"]: p["images_per_sec"] for p in rows
            if p["devices"] == 1 and p["strategy"] == REFERENCE}
    out = []
    for p in rows:
        b = base.get(p["group"])
        speed = p["images_per_sec"] / b if b else float("nan")
        out.append({**p, "speedup": speed, "efficiency": speed / p["devices"]})
    return sorted(out, key=lambda r: (r["mode"], r["model"], r["strategy"] != REFERENCE,
                                      r["strategy"], r["devices"]))


def best_single_process(points: list[dict], group: tuple) -> dict | None:
    """The fastest device point (one process, all cores) of a (mode, model config) group."""
    rows = [p for p in points if not p["single_thread"] and p["group"] == group]
    return max(rows, key=lambda p: p["images_per_sec"], default=None)


def rank_rows(points: list[dict]) -> list[dict]:
    """Rank points with 'speedup' over 1 single-threaded rank, 'efficiency' (/ ranks),
    'speedup_vs_best' over the best single-process point, 'best' (that point) and
    'oversubscribed' (more ranks than the machine's cores)."""
    rows = [p for p in points if p["single_thread"]]
    base = {p["group"]: p["images_per_sec"] for p in rows
            if p["ranks"] == 1 and p["strategy"] == REFERENCE}
    out = []
    for p in rows:
        b = base.get(p["group"])
        best = best_single_process(points, p["group"])
        speed = p["images_per_sec"] / b if b else float("nan")
        out.append({**p, "speedup": speed, "efficiency": speed / p["ranks"], "best": best,
                    "speedup_vs_best": p["images_per_sec"] / best["images_per_sec"] if best else float("nan"),
                    "oversubscribed": p["ranks"] > p["cores"]})
    return sorted(out, key=lambda r: (r["mode"], r["model"], r["strategy"] != REFERENCE,
                                      r["strategy"], r["ranks"]))


def busiest_rank_bytes(theory: dict) -> tuple[int, int] | None:
    """(sent, received) bytes per step of the busiest rank or device by the theory's model
    (a ring all-reduce sends and receives the same), or None when the theory has no model."""
    if "busiest_rank_sent" in theory:
        return theory["busiest_rank_sent"], theory["busiest_rank_received"]
    ring = theory.get("ring_bytes_per_device")
    return None if ring is None else (ring, ring)
