"""The cost model checked against every committed measurement it covers: each bench or
training result under figures/data/ predicted from the committed profile of this machine
(figures/data/cost/profile.json), with its error; the tables `report` writes and the
predicted-against-measured figure come from here.

    rows = check_rows(Path("figures/data"))   # one per measured point, predicted and measured
    error_summary(rows)                        # median and largest |error| per study

Covered: one process's simulated CPU devices (every core), mpi4jax ranks and jax.distributed
processes (one thread each, on one global mesh), on one host or (the network study) one
rank per emulated host, priced on the point's link rate. Not covered, and listed as such:
pipelines measured in the single-program (SPMD) form that one program per stage
(`implementation: mpmd` in the result) replaced, and jax.distributed points under a profile
without their collectives (one taken before it measured them, or without mpiexec).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from pathlib import Path

from experiments.cost import pricing
from experiments.cost import terms
from experiments.infra import cluster
from experiments.points import points
from experiments.publish import sources
from jaxpar import cost, results
from jaxpar.errors import ConfigError, ResultsError
from jaxpar.parallel import STRATEGIES
from jaxpar.profiling.machine import model_key

# (study, the results files under the data folder). A point measured in rounds (the strategies,
# scaling and pipeline studies', peers' jaxpar rows, the bounds study's) holds r<k>/result.json:
# its step is their median; the patterns match its folder or its first round's file.
CHECKED_STUDIES = (
    ("strategies", "strategies/points/*/r0/result.json"),
    ("strategies-cnn", "strategies_cnn/points/*/r0/result.json"),
    ("scaling", "scaling/*/*/r0/result.json"),
    ("scaling-ranks", "scaling/ranks/*/*/r0/result.json"),
    ("pipeline", "pipeline/points/*/r0/result.json"),
    ("time-to-accuracy", "time_to_accuracy/*/result.json"),
    ("peers", "peers/points/*/jaxpar-*"),
    ("bounds", "bounds/points/*/*"),
    ("network", "network/*/*/result.json"),
)
# The studies whose points fall in groups measured apart (each with its own `single`): the
# part of a point's path that names its group (a scaling mode; the bounds study's devices).
MODE_PART = {"scaling": 1, "scaling-ranks": 2, "bounds": 2}
# A sitting (points measured together, `ranking`): a group's part, and the network study's
# bandwidth (a cluster made for each; the study's one-host `single` anchors them all).
SITTING_PART = {**MODE_PART, "network": 1}
PROFILE_UNDER_DATA = "cost/profile.json"


def _measured(point: Path) -> tuple[results.RunResult, float, list[float]]:
    """A point folder's result, its measured step (ms) and each round's; a point measured in
    rounds (r<k>/: the strategies, scaling and pipeline studies', peers' jaxpar rows, the bounds
    study's): the median of its rounds, as those studies report them."""
    rounds = [results.load(f) for f in points.round_files(point)]
    steps = [r.metrics["step_time_ms_median"] for r in rounds]
    return rounds[0], statistics.median(steps), steps


def _point(path: Path) -> Path:
    """The point folder of a CHECKED_STUDIES match (a point folder, or a result file in one or in its
    first round's folder)."""
    return path if path.is_dir() else points.point_folder(path)


def link_of(config: dict) -> cost.Link | None:
    """The emulated link a network-study point ran over (its labels' rate), or None (one host,
    or a link left unshaped)."""
    labels = (config.get("point") or {}).get("labels") or {}
    rate = labels.get("rate_bits_per_s")
    return cost.Link(labels["bandwidth"], rate / 8, 0.0, labels.get("link", "")) if rate else None


def on_link(machine: cost.Machine, link: cost.Link) -> cost.Machine:
    """`machine`'s ranks one per host over `link`: each collective costs what it costs on one
    host (copies, MPI's protocol) plus its bytes at the link's rate (`cost.link_seconds`),
    less what the shaper's full bucket (`cluster.burst_bytes`) lets through at once: once per
    step for a collective whose directions run at once, once per direction for point-to-point
    sends, which alternate (a pipeline's activations one way, their gradients back)."""
    burst_s = cluster.burst_bytes(int(8 * link.bytes_per_s)) / link.bytes_per_s

    def wire(c: cost.Collective) -> float:
        directions = 2 if c.op.removeprefix("mpi_") in ("sendrecv", "collective-permute", "send") else 1
        return max(cost.link_seconds(link, c) - directions * burst_s, 0.0)

    return dataclasses.replace(machine, collective_s=lambda c: machine.collective_s(c) + wire(c), wire_s=wire,
                               notes=machine.notes + (f"link {link.name}",))


def across_measured_link(machine: cost.Machine, fits: dict, name: str) -> cost.Machine:
    """`machine`'s ranks one per host, each collective at what the profile measured across 2
    emulated hosts at the point's bandwidth (`profile --links`). All of that time is the
    link's (`wire_s`: the transport's protocol and waits on the wire, not this machine's
    arithmetic), which the check's anchor for the session's speed does not scale (scaled, the
    MLP's steps of eight ~4 ms collectives came out 40-100% too long)."""
    across = cost.fitted_collectives(fits, send_share=0.5)
    return dataclasses.replace(machine, collective_s=across, wire_s=across,
                               notes=machine.notes + (f"link {name} (measured)",))


def replaced(cls, described: dict | None) -> bool:
    """A pipeline result measured in the single-program (SPMD) form: the CPU runs one program
    per stage (`implementation: mpmd`), which is what the model prices on simulated devices."""
    return "pipeline_impl" in cls.options and (described or {}).get("implementation") != "mpmd"


def predict_point(profile: dict, config: dict, env: dict, described: dict | None = None,
                  fixed_hidden: bool = True) -> tuple[cost.Prediction | None, str]:
    """The prediction for one measured point (`described`: the result's strategy record), or
    (None, why it is not covered). `fixed_hidden`: collectives of simulated devices at their
    bytes' part (`cost.shared_pool_collectives`; False: as the model priced them before)."""
    p = config["parallel"]
    cls = STRATEGIES[p["strategy"]]
    processes = env.get("process_count", 1)
    if processes > 1 and not profile.get("distributed"):
        return None, "jax.distributed over processes: no profile of its collectives"
    if replaced(cls, described):
        return None, "implementation replaced: measured as one SPMD program, not one program per stage"
    one_thread = env.get("threads_per_process") == 1 or p.get("single_thread", False)
    compute = pricing.compute_source(profile)
    link = link_of(config)
    bandwidth = ((config.get("point") or {}).get("labels") or {}).get("bandwidth")
    measured = (profile.get("links") or {}).get(bandwidth) if bandwidth else None
    if cls.uses_mpi or processes > 1:
        machine = (cost.mpi_ranks if cls.uses_mpi else cost.distributed_ranks)(profile, compute)
        if measured:
            machine = across_measured_link(machine, measured["mpi" if cls.uses_mpi else "distributed"], bandwidth)
        elif link:
            machine = on_link(machine, link)
        devices = env.get("mpi_ranks", 1) if cls.uses_mpi else env["device_count"]
        one_thread = True
    else:
        machine = cost.simulated(profile, lambda key, _: compute(key, one_thread), fixed_hidden=fixed_hidden)
        devices = p.get("devices") or env["device_count"]
    key = model_key(config["model"])
    implementation = (described or {}).get("implementation", "spmd")
    machine, one_thread = pricing.for_stages(machine, profile, cls.name, key, implementation, one_thread)
    c = machine.compute(key, one_thread)
    axes, _ = pricing.mesh_axes(cls.name, devices, p.get("mesh", ""), len(c.layers))
    problem = pricing.problem(key, cls.name, axes, config["data"]["batch_size"], c,
                                 microbatches=p["microbatches"], schedule=p["schedule"],
                                 sync_every=p.get("sync_every", 1),
                                 implementation=implementation,
                                 collective_form=(described or {}).get("collective_form", "native"),
                                 cut_inside=bool((described or {}).get("cut_inside")))
    work = cls.cost(problem)
    return cost.predict(work, machine, config["data"]["batch_size"], pricing.cost_devices(axes) or 1), ""


def check_rows(data_dir: Path, base: bool = False) -> list[dict]:
    """Every covered committed point: study, name, model, strategy, devices or ranks, measured
    and predicted ms/step, the prediction's parts, state bytes, and the error; points the
    model does not cover carry `why` instead of a prediction. Computed once per data folder
    and profile file (its tables and figure share it). `base`: the model as it stood before
    the terms measured from the points (`terms`), the shared pool's collectives
    (`cost.shared_pool_collectives`) and the pooled anchors: what the misses' table compares."""
    return _check_rows(*cache_key(data_dir), base)


def cache_key(data_dir: Path) -> tuple[str, int]:
    """What an answer computed from `data_dir`'s points is cached under: the folder and its
    profile's time of change (ResultsError, naming the command, without a profile)."""
    profile = Path(data_dir) / PROFILE_UNDER_DATA
    if not profile.is_file():
        raise ResultsError(sources.missing_line(Path(data_dir), "cost"))
    return str(Path(data_dir).resolve()), profile.stat().st_mtime_ns


NO_TERMS = terms.Terms({}, terms.PinnedHost(0.0, ()))


@functools.lru_cache(maxsize=8)
def _check_rows(data_dir: str, _stamp: int, base: bool) -> list[dict]:
    data_dir = Path(data_dir)
    profile = pricing.load_profile(str(data_dir / PROFILE_UNDER_DATA))
    rows = []
    for study, pattern in CHECKED_STUDIES:
        for path in sorted(Path(data_dir).glob(pattern)):
            point = _point(path)
            r, measured, steps = _measured(point)
            row = _measured_row(study, point.relative_to(data_dir).as_posix(), r, measured, steps)
            try:
                pred, why = predict_point(profile, r.config, r.env, r.strategy, fixed_hidden=not base)
            except (ConfigError, NotImplementedError) as e:
                pred, why = None, str(e)
            row["why"] = why
            if pred is not None:
                row.update(raw_compute_ms=1000 * pred.compute_s, raw_comm_ms=1000 * pred.comm_s,
                           raw_bubble_ms=1000 * pred.bubble_s, wire_ms=1000 * pred.wire_s,
                           state_predicted=pred.state_bytes)
            rows.append(row)
    apply_terms(rows, NO_TERMS if base else terms.fitted_terms(rows), profile["cores"])
    anchor(rows, pool=not base)
    return rows  # callers must not change it (cached)


def _measured_row(study: str, name: str, r: results.RunResult, measured: float, steps: list[float]) -> dict:
    """What a point's results say: where and how it ran, its step (the median of its rounds,
    and each round's), its state bytes."""
    p = r.config["parallel"]
    processes = max(r.env.get("mpi_ranks", 1), r.env.get("process_count", 1))
    part = SITTING_PART.get(study)
    return {"study": study, "point": name, "sitting": study + ("/" + name.split("/")[part] if part else ""),
            "label": name.split("/")[-1], "model": model_key(r.config["model"]), "strategy": p["strategy"],
            "devices": processes if processes > 1 else (p.get("devices") or r.env["device_count"]),
            "ranks": processes > 1, "measured_ms": measured, "rounds_ms": steps,
            "one_thread": r.env.get("threads_per_process") == 1 or STRATEGIES[p["strategy"]].uses_mpi,
            "steps_per_dispatch": p.get("steps_per_dispatch", 1), "sync_every": p.get("sync_every", 1),
            "batch": r.config["data"]["batch_size"], "microbatches": p["microbatches"], "schedule": p["schedule"],
            "process_devices": p.get("devices"), "state_measured": r.metrics.get("state_bytes_per_device"),
            "pinned": bool(p.get("single_thread")) and (processes > 1 or p["strategy"] == "single"),
            "mesh": (r.strategy or {}).get("mesh")}


def apply_terms(rows: list[dict], fitted: terms.Terms, cores: int) -> None:
    """Each predicted row's `predicted_ms` and parts: its raw prediction with its formulation's
    measured factor (on this machine's arithmetic, not on a link's wire) and, on a pinned
    process, the host's time per step added to its compute (`terms`); and the profile's
    error."""
    for r in rows:
        if "raw_compute_ms" not in r:
            continue
        f = fitted.factor(r["strategy"], r["ranks"])
        parts = {k: r["raw_" + k] for k in ("compute_ms", "comm_ms", "bubble_ms")}
        total = sum(parts.values())
        scale = (f * (total - r["wire_ms"]) + r["wire_ms"]) / total if total else 1.0
        parts = {k: v * scale for k, v in parts.items()}
        # each core runs the host work of every process pinned to it (`cost.predict`)
        host = 1000 * fitted.host_s * max(1.0, r["devices"] / cores) if r["pinned"] else 0.0
        parts["compute_ms"] += host
        r.update(parts, formulation=f, host_ms=host, predicted_ms=sum(parts.values()))
        r["error_profile"] = r["predicted_ms"] / r["measured_ms"] - 1


def _group(row: dict) -> tuple[str, str, bool]:
    """The points one `single` anchors: a study (a scaling mode, the bounds study's device
    count), a model, and whether they ran on one thread per process (ranks) or on every core
    (the day's slowdown differs)."""
    part = MODE_PART.get(row["study"])
    mode = row["point"].split("/")[part] if part else ""
    return f"{row['study']}{'/' + mode if mode else ''}", row["model"], row["one_thread"]


def _alike(a: dict, b: dict) -> bool:
    """Two `single` points of one configuration (model, threads, batch, the devices its process
    simulated) in one study: the scaling study's strong and weak modes measure the same one."""
    keys = ("study", "model", "one_thread", "batch", "process_devices")
    return all(a[k] == b[k] for k in keys)


def anchor(rows: list[dict], scales: dict | None = None, pool: bool = True) -> dict:
    """Scale each point's prediction by its group's `single` point (measured / predicted): one
    number per study and model that takes out how fast the machine ran that day against the
    day of the profile (the same code measured 2.4x apart on this machine); time on an
    emulated link's wire is the link's, not the machine's, and is not scaled. The anchor's
    measured step is the median of every round of the `single` points of its configuration in
    its study (`_alike`: the scaling study's two modes measured it six times, not three).
    Adds `scale`, `anchored_ms` and `error` (anchored / measured - 1) to every predicted row
    and marks the anchors (`anchor`; left out of the errors). A group without a `single` point
    (the peers' and time-to-accuracy's ranks) takes the median scale of the same model and
    threads elsewhere, else of every model on those threads. `scales`: {group: scale} to use
    instead (a study left out: other studies' scales); `pool` False: each anchor's own rounds
    alone. Returns the scales it used."""
    singles = [r for r in rows if r["strategy"] == "single" and r["steps_per_dispatch"] == 1
               and "predicted_ms" in r]
    # One anchor per group: the point named for `single` where another configuration also
    # came out as `single` (the peers' "best" of the MLP), else the first.
    chosen: dict = {}
    for r in sorted(singles, key=lambda r: "single" not in r["point"]):
        chosen.setdefault(_group(r), r)
    anchors = list(chosen.values())
    pooled = {group: [x for s in singles if (_alike(s, r) and pool or s is r) and "single" in s["point"]
                      for x in s["rounds_ms"]] for group, r in chosen.items()}
    spread = {group: (max(xs) - min(xs)) / statistics.median(xs) for group, xs in pooled.items()}
    if scales is None:
        scales = {group: (statistics.median(pooled[group]) - r["host_ms"]) / (r["predicted_ms"] - r["host_ms"])
                  for group, r in chosen.items()}
    by_model: dict = {}
    for (_, model, threads), scale in scales.items():
        by_model.setdefault((model, threads), []).append(scale)
        by_model.setdefault(threads, []).append(scale)
    for r in rows:
        if "predicted_ms" not in r:
            continue
        fallback = by_model.get((r["model"], r["one_thread"])) or by_model.get(r["one_thread"], [1.0])
        scale = scales.get(_group(r)) or statistics.median(fallback)
        fixed = r["wire_ms"] + r["host_ms"]   # the link's and the host's: not the session's speed
        anchored = (r["predicted_ms"] - fixed) * scale + fixed
        r.update(scale=scale, anchored_ms=anchored, error=anchored / r["measured_ms"] - 1,
                 anchor=any(r is a for a in anchors), anchor_spread=spread.get(_group(r)))
    return scales


def error_summary(rows: list[dict]) -> list[dict]:
    """Per study (and 'all'): points, points predicted, anchors; median and largest |error|
    of the anchored prediction (anchors left out), the points beyond 25%; the median |error|
    of the profile alone and the median scale (the study's speed over the profile's)."""
    out = []
    for study in [s for s, _ in CHECKED_STUDIES] + ["all"]:
        here = [r for r in rows if study in ("all", r["study"])]
        covered = [r for r in here if "error" in r]
        errors = [abs(r["error"]) for r in covered if not r["anchor"]]
        median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out.append({"study": study, "points": len(here), "covered": len(covered),
                    "anchors": sum(r["anchor"] for r in covered),
                    "median": median(errors), "max": max(errors) if errors else None,
                    "beyond_25": sum(e > 0.25 for e in errors),
                    "median_profile": median([abs(r["error_profile"]) for r in covered]),
                    "state_checked": sum(bool(r.get("state_measured")) for r in covered),
                    "state_equal": sum(bool(r.get("state_measured")) and
                                       abs(r["state_predicted"] / r["state_measured"] - 1) < 0.01 for r in covered),
                    "scale": median([r["scale"] for r in covered])})
    return out



# --- the assumed H100 against a measured one ------------------------------------------------

H100_PROFILE = "cost-h100/profile.json"   # measured on a lent H100 node (experiments/infra/measure_node.sh)
H100_BATCHES = (16, 128, 256)


def _one_device_ms(data_dir: Path, device_kind: str) -> dict:
    """{(model key, batch): ms} of the machine command's one-device rows on `device_kind`."""
    found = {}
    for path in sorted(data_dir.glob("machines/*/machine.json")):
        r = results.load(path)
        if r.env.get("device_kind") == device_kind:
            for row in r.metrics["rows"]:
                if row["part"] == "one-device":
                    key = model_key({"model": row["model"], "depth": r.config["depth"], "width": r.config["width"]})
                    found[(key, row["batch"])] = row["ms"]
    return found


def assumed_h100_rows(data_dir: Path) -> list[dict]:
    """`single`'s step on the assumed H100 (this machine's profile carried to
    `jaxpar.cost.DEVICES['h100']`, as the extrapolation figure uses it) beside the step an H100
    profile measured, for each model that profile holds at H100_BATCHES; with the machine
    command's one-device step on the same kind of device, where it measured one."""
    data_dir = Path(data_dir)
    gpu = pricing.load_profile(str(data_dir / H100_PROFILE))
    assumed = pricing.compute_source(pricing.load_profile(str(data_dir / PROFILE_UNDER_DATA)), "h100")
    machine_ms = _one_device_ms(data_dir, gpu["env"]["device_kind"])
    rows = []
    for key, entry in gpu["models"].items():
        for b, ms in zip(entry["steps"]["batch"], entry["steps"]["step_ms_median"]):
            if b in H100_BATCHES:
                predicted = 1000 * assumed(key).step_s(b)
                rows.append({"model": key, "batch": b, "measured_ms": ms, "assumed_ms": predicted,
                             "ratio": predicted / ms, "machine_ms": machine_ms.get((key, b))})
    return rows
