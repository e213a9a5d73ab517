"""The machine command's rows and results file, from its points' results (its tables: tables.py).

    python -m experiments machine --quick --out /tmp/machine   # writes OUT/machine.json, OUT/summary.md

A row is one point: its part (one-device, torch, devices, ranks), model, strategy, devices,
ranks, threads, global batch, ms/step and images/s. Speed-up is a ratio of images/s over the
part's baseline: the devices and ranks parts over ONE worker (one device with one XLA thread
on a CPU; the one-device point on a GPU), so in weak scaling (--batch-size per worker) it is
throughput gained and efficiency = speed-up / workers; the one-device rows over PyTorch's
eager step of the same model on the same device.
"""

from __future__ import annotations

import dataclasses

from jaxpar import results

PARTS = ("one-device", "torch", "devices", "ranks")


def jaxpar_record(point, result: results.RunResult, load: float) -> dict:
    """One jaxpar point's row (before speed-ups); `load`: the 1-minute load average before it."""
    m, env = result.metrics, result.env
    return {"part": point.labels["part"], "model": point.config.model.model, "framework": "jaxpar",
            # The devices it ran on (a one-device point on a 4-GPU node sees 4, uses 1).
            "strategy": point.config.parallel.strategy, "devices": point.config.parallel.devices or 1,
            "ranks": env.get("mpi_ranks", 1), "threads_per_process": env["threads_per_process"],
            "batch": point.config.data.batch_size, "ms": m["step_time_ms_median"],
            "images_per_sec": m["images_per_sec"], "compile_s": m["compile_s"],
            "achieved_gflops": m["achieved_gflops"], "percent_of_peak": m["percent_of_peak"],
            "folder": point.folder, "load_1min": load}


def torch_record(point, done: dict, load: float) -> dict:
    """One PyTorch point's row, from its torch.json; `load` as for `jaxpar_record`."""
    return {"part": "torch", "model": point.model, "framework": "pytorch", "strategy": point.mode,
            "devices": 1, "ranks": 1, "threads_per_process": done["threads"],
            "batch": point.batch_size, "ms": done["median_ms"],
            "images_per_sec": 1000 * point.batch_size / done["median_ms"],
            "compile_s": None, "achieved_gflops": None, "percent_of_peak": None,
            "folder": point.folder, "load_1min": load, "torch": done["torch"], "device": point.device}


def baseline(rows: list[dict], row: dict) -> dict | None:
    """The row `row`'s speed-up is over (None: it has none)."""
    model = [r for r in rows if r["model"] == row["model"]]
    if row["part"] == "one-device":
        return next((r for r in model if r["part"] == "torch"), None)
    if row["part"] in ("devices", "ranks"):
        one = [r for r in model if r["part"] == "devices" and r["devices"] == 1]
        return (one or [r for r in model if r["part"] == "one-device"] or [None])[0]
    return None


def with_speedups(records: list[dict]) -> list[dict]:
    """Each record with 'workers', 'speedup' (over `baseline`, None without one) and
    'efficiency' (speed-up / workers), in table order (models as measured, then parts)."""
    rows, order = [], {m: i for i, m in enumerate(dict.fromkeys(r["model"] for r in records))}
    for r in records:
        base = baseline(records, r)
        workers = r["ranks"] if r["part"] == "ranks" else r["devices"]
        speed = None if base is None else r["images_per_sec"] / base["images_per_sec"]
        rows.append({**r, "workers": workers, "speedup": speed,
                     "efficiency": None if speed is None or r["part"] == "one-device" else speed / workers})
    return sorted(rows, key=lambda r: (order[r["model"]], PARTS.index(r["part"]), r["workers"]))


def machine_result(config, records: list[dict], env: dict, skipped: dict, failed: dict) -> results.RunResult:
    """The RunResult of machine.json: the probe's env (PyTorch's version added), the rows."""
    torch = next((r["torch"] for r in records if r.get("torch")), None)
    return results.RunResult(kind="machine", config=dataclasses.asdict(config),
                             env={**env, "torch": torch},
                             metrics={"rows": with_speedups(records), "skipped": skipped,
                                      "failed": failed})


def load_words(data: dict) -> str:
    """'load average 9.8-14.1 on 2 cores': how busy the machine was while it was measured."""
    loads = [r["load_1min"] for r in data["metrics"]["rows"] if r.get("load_1min") is not None]
    if not loads:
        return "load not recorded"
    return (f"1-minute load average {min(loads):.1f}-{max(loads):.1f} on "
            f"{data['env']['cores_available']} cores")
