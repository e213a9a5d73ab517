"""Terms of the cost model measured from the committed points, each from a measurement of its
cause (never one point's error): what a formulation's API costs on this machine.

`dp-pmap`, `dp-auto` and `local-sgd` (averaging every step) state the same work and collectives
as `dp-shard-map`, and `tensor-auto` as `tensor`: the model prices each pair the same, yet
they run as other programs (pmap's per-device dispatch, the compiler's placement of the
all-reduce, the average under `lax.cond`, XLA's own split). What that costs is measured
directly: the ratio of the two steps wherever a sitting measured both (same model, devices or
processes and batch, one host: on an emulated link the wire drowns it); the term is the
median ratio over those pairs, on simulated devices and across processes apart.

    pairs = formulation_pairs(rows)         # the measured ratios, one per sitting that ran both
    terms = formulation_terms(rows)         # {(strategy, processes): Formulation}
    formulation_terms(rows, leave_out="scaling")   # fitted without one study (out of sample)
    pinned = pinned_host(rows)              # a pinned process's host time per step
    fitted = fitted_terms(rows)             # both, as `predict` and `plan` take them

A process pinned to one core (an MPI rank, a jax.distributed process, `--single-thread`) runs
its host's work (Python, dispatch, waiting for the step) on the core its XLA thread computes
on; the profile's one-thread steps ran in an unpinned process, whose host work took the other
core. That host time is the same for every model and does not grow with its work: in a
sitting that measured two models' pinned `single`, each measured m = s p + h for the
profile's one-thread step p, one speed s of the sitting and the host's h, two equations in
two unknowns; the term is the median h over those sittings.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# strategy -> the one whose work and collectives it states alike
FORMULATIONS = {"dp-pmap": "dp-shard-map", "dp-auto": "dp-shard-map", "local-sgd": "dp-shard-map",
                "tensor-auto": "tensor"}


@dataclass(frozen=True)
class Formulation:
    """A formulation's measured step over its twin's: the median `factor` of `ratios`, one per
    sitting (`where`) that measured both."""
    strategy: str
    twin: str
    processes: bool
    factor: float
    ratios: tuple[float, ...]
    where: tuple[str, ...]


def _same_work(row: dict) -> bool:
    """A point whose work its twin states alike: one step per dispatch; local-sgd averaging
    every step (k > 1 states fewer collectives); not over an emulated link."""
    return (row.get("steps_per_dispatch", 1) == 1 and row.get("sync_every", 1) == 1
            and not row["study"] == "network")


def formulation_pairs(rows: list[dict], leave_out: str | None = None) -> list[dict]:
    """Every measured pair of a formulation and its twin in one sitting (`rows`: the check's,
    only their measured fields are read): strategy, twin, processes, sitting, model, devices,
    and the ratio of their measured steps. `leave_out`: a study whose points are not used."""
    found = {}
    for r in rows:
        if r["study"] != leave_out and _same_work(r):
            found[(r["sitting"], r["model"], r["devices"], r["batch"], r["ranks"], r["strategy"])] = r
    pairs = []
    for (sitting, model, devices, batch, ranks, strategy), r in sorted(found.items()):
        twin = found.get((sitting, model, devices, batch, ranks, FORMULATIONS.get(strategy)))
        if twin is not None:
            pairs.append({"strategy": strategy, "twin": twin["strategy"], "processes": ranks,
                          "sitting": sitting, "model": model, "devices": devices,
                          "ratio": r["measured_ms"] / twin["measured_ms"]})
    return pairs


def formulation_terms(rows: list[dict], leave_out: str | None = None) -> dict[tuple[str, bool], Formulation]:
    """{(strategy, across processes?): its Formulation}, the median ratio of its pairs
    (`formulation_pairs`); a formulation no sitting measured beside its twin has no term."""
    grouped: dict = {}
    for p in formulation_pairs(rows, leave_out):
        grouped.setdefault((p["strategy"], p["processes"]), []).append(p)
    return {key: Formulation(key[0], ps[0]["twin"], key[1], statistics.median(p["ratio"] for p in ps),
                             tuple(p["ratio"] for p in ps), tuple(f"{p['sitting']} {p['model']} {p['devices']}"
                                                                  for p in ps))
            for key, ps in grouped.items()}


def factor_of(terms: dict | None, strategy: str, processes: bool) -> float:
    """The factor a prediction of `strategy` takes (1 where no term was measured)."""
    term = (terms or {}).get((strategy, processes))
    return term.factor if term else 1.0


@dataclass(frozen=True)
class PinnedHost:
    """A pinned process's host time per step (`seconds`, the median of `solved`), with each
    sitting's solution: (sitting, h in seconds, the sitting's speed s)."""
    seconds: float
    solved: tuple[tuple[str, float, float], ...]


def _pinned_single(row: dict) -> bool:
    return (row["strategy"] == "single" and row["one_thread"] and not row["ranks"] and row.get("pinned")
            and "raw_compute_ms" in row and "single" in row["point"])


def pinned_host(rows: list[dict], leave_out: str | None = None) -> PinnedHost:
    """The host time a pinned process adds to each step, solved in every sitting that measured
    two models' pinned one-thread `single` at one batch (`rows`: the check's, with their raw
    predictions: the profile's one-thread step); 0 where none did."""
    by_sitting: dict = {}
    for r in rows:
        if r["study"] != leave_out and _pinned_single(r):
            by_sitting.setdefault(r["sitting"], {}).setdefault(r["model"], r)
    solved = []
    for sitting, models in sorted(by_sitting.items()):
        if len(models) < 2:
            continue
        (a, b) = sorted(models.values(), key=lambda r: r["raw_compute_ms"])[:2]
        if a["batch"] != b["batch"]:
            continue
        speed = (b["measured_ms"] - a["measured_ms"]) / (b["raw_compute_ms"] - a["raw_compute_ms"])
        solved.append((sitting, (a["measured_ms"] - speed * a["raw_compute_ms"]) / 1000, speed))
    return PinnedHost(statistics.median(h for _, h, _ in solved) if solved else 0.0, tuple(solved))


@dataclass(frozen=True)
class Terms:
    """The terms a prediction on this machine takes: the formulations' factors and a pinned
    process's host time per step."""
    formulations: dict
    pinned: PinnedHost

    @property
    def host_s(self) -> float:
        return self.pinned.seconds

    def factor(self, strategy: str, processes: bool) -> float:
        return factor_of(self.formulations, strategy, processes)

    def twin(self, strategy: str, processes: bool) -> str:
        return self.formulations[(strategy, processes)].twin


def fitted_terms(rows: list[dict], leave_out: str | None = None) -> Terms:
    """Every term fitted on `rows` (the check's), without `leave_out`'s points."""
    return Terms(formulation_terms(rows, leave_out), pinned_host(rows, leave_out))
