"""The points the model misses by more than 25%, grouped by cause, each cause with a measurement
of its own from the committed results, under the model as it stood before the terms
(`check_rows(base=True)`) and as it stands.

A point takes the first cause whose rule it meets (CAUSES, in order); the measurement says
how large the cause is, and `priced` what the model does about it now.

    for row in misses_by_cause(data): ...
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.cost import check, pricing, ranking, terms

MISS = 0.25   # a miss: |anchored error| beyond 25%


def _shared_cores(r: dict) -> bool:
    return not r["ranks"] and r["devices"] > 2


# (cause, the rule a point meets, what the model prices of it now); the rule reads a check row
CAUSES = (
    ("formulation", lambda r: r["strategy"] in terms.FORMULATIONS,
     "the measured factor of each formulation over its twin (`terms`)"),
    ("one fresh process", lambda r: len(r.get("rounds_ms") or []) < 2,
     "nothing: a point measured once carries its process's spread"),
    ("gloo's quantum", lambda r: r["ranks"] and r["strategy"] not in ("mpi-allreduce", "mpi-param-server",
                                                                      "mpi-pipeline"),
     "the profile's collectives across processes, each as measured alone"),
    ("a pinned process's host", lambda r: r["ranks"],
     "the host's time per step on the rank's core (`terms.pinned_host`)"),
    ("the anchor's spread", lambda r: (r.get("anchor_spread") or 0.0) > MISS,
     "an anchor's rounds pooled with its study's other `single` of one configuration"),
    ("more devices than cores", _shared_cores,
     "the devices' work added up over the shared cores"),
    ("collectives inside a step", lambda r: not r["ranks"],
     "on shared cores, each collective's bytes' part alone (`cost.shared_pool_collectives`)"),
)


def cause_of(row: dict) -> str:
    return next(name for name, rule, _ in CAUSES if rule(row)) if any(rule(row) for _, rule, _ in CAUSES) else "other"


def _missed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" in r and not r["anchor"] and abs(r["error"]) > MISS]


def measurements(data_dir: Path, rows: list[dict]) -> dict[str, str]:
    """Each cause's size, measured from the committed results (sentences for the table)."""
    profile = pricing.load_profile(str(Path(data_dir) / check.PROFILE_UNDER_DATA))
    formulations = terms.formulation_terms(rows)
    host = terms.pinned_host(rows)
    dist, coll = profile["distributed"]["all-reduce"], profile["collectives"]["all-reduce"]
    singles = [r for r in rows if r.get("anchor") and len(r["rounds_ms"]) > 1]
    weak = _weak_ratios(rows)
    same = _identical_work_spread(rows)
    ms = lambda x: f"{1000 * x:.2f} ms"  # noqa: E731
    fixed = {n: pricing.cost.fitted_seconds(profile["collectives"], "all-reduce", n, 0) for n in (2, 8)}
    return {
        "formulation": "; ".join(f"{t.strategy}{' (processes)' if t.processes else ''} x{t.factor:.2f} "
                                 f"(x{min(t.ratios):.2f}-{max(t.ratios):.2f}, {len(t.ratios)} sittings)"
                                 for t in formulations.values()),
        "one fresh process": f"one point's rounds range {ranking.fresh_process_spread(rows):.0%} of their median "
                             f"(typical); identical work measured once in one sitting (dp-auto, dp-shard-map, "
                             f"local-sgd) up to {same:.0%} apart",
        "gloo's quantum": f"a 4 KB all-reduce across 2 processes {ms(dist['2']['points'][0][1])}, "
                          f"across 4 (more than the cores) {ms(dist['4']['points'][0][1])}",
        "a pinned process's host": f"{ms(host.seconds)} a step, solved in {len(host.solved)} sittings "
                                   f"({', '.join(ms(h) for _, h, _ in host.solved)})",
        "the anchor's spread": "anchors whose rounds range beyond 25% of their median: " + ", ".join(
            f"{r['sitting']} {r['model']} {r['anchor_spread']:.0%}" for r in singles
            if (r.get("anchor_spread") or 0.0) > MISS),
        "more devices than cores": f"D devices at one device's batch each over D x `single`: "
                                   f"x{min(weak):.2f}-{max(weak):.2f} (weak scaling, D = 2, 4, 8)",
        "collectives inside a step": f"a collective's fixed part (its time at zero bytes) {ms(fixed[2])} on 2 "
                                     f"devices, {ms(fixed[8])} on 8, against a one-device program's dispatch "
                                     f"{ms(profile.get('dispatch_us', 0) / 1e6)}; the 4 KB all-reduce "
                                     f"{ms(coll['2']['points'][0][1])}",
    }


def _weak_ratios(rows: list[dict]) -> list[float]:
    """The scaling study's weak points on D devices (each one device's batch) over D x its
    `single` (the median of both modes' rounds)."""
    singles = {r["model"]: statistics.median(x for s in rows if s["study"] == "scaling" and s["strategy"] == "single"
                                             and s["model"] == r["model"] for x in s["rounds_ms"])
               for r in rows if r["study"] == "scaling" and r["strategy"] == "single"}
    return [r["measured_ms"] / (r["devices"] * singles[r["model"]]) for r in rows
            if r["point"].startswith("scaling/weak/") and r["strategy"] == "dp-shard-map" and r["model"] in singles]


def _identical_work_spread(rows: list[dict]) -> float:
    """The largest relative range of identical-work points measured once in one sitting."""
    sets: dict = {}
    for r in rows:
        if r["strategy"] in ("dp-auto", "dp-shard-map", "local-sgd") and len(r.get("rounds_ms") or []) < 2:
            sets.setdefault((r["sitting"], r["model"], r["devices"]), []).append(r["measured_ms"])
    return max(((max(v) - min(v)) / min(v) for v in sets.values() if len(v) > 1), default=0.0)


def misses_by_cause(data_dir: Path) -> list[dict]:
    """Per cause: the points beyond 25% under the model before the terms and now, and the
    cause's measurement and what the model prices of it."""
    before, now = check.check_rows(data_dir, base=True), check.check_rows(data_dir)
    sizes = measurements(data_dir, now)
    out = []
    for name, _, priced in (*CAUSES, ("other", None, "")):
        was = [r["point"] for r in _missed(before) if cause_of(r) == name]
        left = [r["point"] for r in _missed(now) if cause_of(r) == name]
        if was or left:
            out.append({"cause": name, "before": len(was), "now": len(left), "measured": sizes.get(name, ""),
                        "priced": priced, "points": left})
    return out
