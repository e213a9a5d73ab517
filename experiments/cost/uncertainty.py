"""How sure a prediction is: an interval from the noise each of its sources measured, and how
often the committed measurements fall inside it (calibration).

Each source's spread is measured, in log space (a step's noise is a ratio):
- the profile's: the scatter of its median steps about the line the model prices them on
  (`jaxpar.cost.step_line`), per model and threads, carried in proportion to the prediction's
  compute (`profile_sigma`);
- a measurement's: the spread of one point's rounds (each a fresh process), pooled over a
  study's points (`round_sigma`); a point's median of n rounds is known to 1.25 sigma / sqrt(n),
  one measured once to sigma, the anchor's median likewise;
- the session's: how fast this machine ran that day against the profile, the spread of the
  committed sittings' anchor scales (`session_sigma`): a prediction from the profile alone
  carries it, an anchored one does not;
- the model's own: the spread that, with the measured ones above, makes the nominal interval
  hold as often as it claims on the other studies' anchored points (never the point's own
  study: `structural_sigma`), so that each study's coverage tests it out of sample.

    sig = Sigmas.of(rows, profile)                       # every spread, from the check's rows
    lo, hi = interval(pred_ms, sig.total(...), NOMINAL)  # the 80% interval
    calibration(rows, profile)                           # how often the measured point is inside
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from jaxpar import cost

NOMINAL = 0.80                 # the interval's claimed coverage
Z80 = 1.2816                   # its half-width in standard deviations (normal, two-sided 80%)
MEDIAN_SE = 1.2533             # a median of n draws: 1.2533 sigma / sqrt(n)


def _log_sd(values) -> float:
    logs = np.log(np.asarray(values, float))
    return float(np.std(logs, ddof=1)) if len(logs) > 1 else 0.0


def profile_sigma(profile: dict) -> dict[tuple[str, bool], float]:
    """{(model, one thread?): the log scatter of the profile's median steps about the line it is
    priced on}: the profile's own timing noise, as a prediction inherits it."""
    found = {}
    for key, entry in profile["models"].items():
        for one_thread, name in ((False, "steps"), (True, "steps_one_thread")):
            steps = entry.get(name)
            if not steps:
                continue
            ys = cost._typical_ms(steps)
            line = cost.step_line(steps["batch"], ys)
            res = [math.log(y / line(x)) for x, y in zip(steps["batch"], ys)]
            found[(key, one_thread)] = math.sqrt(sum(r * r for r in res) / max(len(res) - 2, 1))
    return found


def round_sigma(rows: list[dict]) -> dict[str, float]:
    """{study: the log spread of one round about its point's median}, pooled over the study's
    points measured in rounds; 'all' over every study's (for points measured once)."""
    pooled: dict = {}
    for r in rows:
        steps = r.get("rounds_ms") or []
        if len(steps) > 1:
            mid = statistics.median(steps)
            for s in (r["study"], "all"):
                pooled.setdefault(s, []).extend(math.log(x / mid) for x in steps)
    # deviations from a median of 3 understate the spread: n / (n - 1) on the variance
    return {s: math.sqrt(sum(d * d for d in ds) / len(ds) * 1.5) for s, ds in pooled.items()}


def session_sigma(rows: list[dict]) -> float:
    """The log spread of the committed sittings' anchor scales (measured / the profile's
    `single`): how far one day's speed moves every prediction from the profile alone."""
    scales = {(r["sitting"], r["model"], r["one_thread"]): r["scale"] for r in rows if r.get("anchor")}
    return _log_sd(list(scales.values()))


@dataclass(frozen=True)
class Sigmas:
    """Every measured spread a prediction's interval is built from (see the module docstring)."""
    profile: dict
    rounds: dict
    session: float
    structural: float

    def measured(self, row: dict) -> float:
        """A row's spread from what was measured: the profile's on its compute, its own
        median's and its anchor's."""
        share = row["compute_ms"] / row["predicted_ms"] if row.get("predicted_ms") else 1.0
        prof = self.profile.get((row["model"], row["one_thread"]), 0.0) * share
        one = self.rounds.get(row["study"], self.rounds.get("all", 0.0))
        n = max(len(row.get("rounds_ms") or []), 1)
        point = (MEDIAN_SE * one / math.sqrt(n)) if n > 1 else self.rounds.get("all", 0.0)
        anchor = MEDIAN_SE * one / math.sqrt(3)
        return math.sqrt(prof ** 2 + point ** 2 + anchor ** 2)

    def total(self, row: dict) -> float:
        return math.sqrt(self.measured(row) ** 2 + self.structural ** 2)

    def for_plan(self, model: str, one_thread: bool, compute_share: float, session: bool) -> float:
        """A prediction from the profile alone (`predict`, `plan`): the profile's noise on its
        compute, the model's own, one fresh measurement's, and with `session` the day's."""
        prof = self.profile.get((model, one_thread), 0.0) * compute_share
        return math.sqrt(prof ** 2 + self.structural ** 2 + self.rounds.get("all", 0.0) ** 2
                         + (self.session ** 2 if session else 0.0))


def structural_sigma(rows: list[dict], profile_sig: dict, rounds: dict, leave_out: str | None = None) -> float:
    """The model's own spread, fitted on every study but `leave_out`: the least s >= 0 for
    which the nominal interval from each point's measured spread and s holds NOMINAL of those
    studies' anchored points (so the left-out study tests it out of sample)."""
    probe = Sigmas(profile_sig, rounds, 0.0, 0.0)
    here = [(abs(math.log(r["measured_ms"] / r["anchored_ms"])), probe.measured(r) ** 2)
            for r in rows if "error" in r and not r["anchor"] and r["study"] != leave_out]
    if not here:
        return 0.0

    def covered(s: float) -> float:
        return sum(d <= Z80 * math.sqrt(m + s * s) for d, m in here) / len(here)

    lo, hi = 0.0, 2.0
    if covered(lo) >= NOMINAL:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if covered(mid) >= NOMINAL else (mid, hi)
    return hi


def sigmas(rows: list[dict], profile: dict, leave_out: str | None = None) -> Sigmas:
    """Every spread from the check's rows and the profile; the model's own fitted without
    `leave_out`."""
    prof, rounds = profile_sigma(profile), round_sigma(rows)
    return Sigmas(prof, rounds, session_sigma(rows), structural_sigma(rows, prof, rounds, leave_out))


def interval(value: float, sigma: float, z: float = Z80) -> tuple[float, float]:
    """The interval value x exp(-+z sigma)."""
    return value * math.exp(-z * sigma), value * math.exp(z * sigma)


def calibration(rows: list[dict], profile: dict) -> list[dict]:
    """Per study and over all: the share of anchored points whose measurement falls inside the
    nominal 80% interval built from the profile's noise alone, from every measured spread, and
    from those and the model's own spread fitted on the other studies."""
    prof, rounds = profile_sigma(profile), round_sigma(rows)
    base = Sigmas(prof, rounds, 0.0, 0.0)
    studies = sorted({r["study"] for r in rows if "error" in r}, key=[r["study"] for r in rows].index)
    out, inside = [], {"profile": [], "measured": [], "all": []}
    for study in studies:
        structural = structural_sigma(rows, prof, rounds, leave_out=study)
        mine = {k: [] for k in inside}
        for r in rows:
            if r["study"] != study or "error" not in r or r["anchor"]:
                continue
            share = r["compute_ms"] / r["predicted_ms"]
            for kind, sigma in (("profile", prof.get((r["model"], r["one_thread"]), 0.0) * share),
                                ("measured", base.measured(r)),
                                ("all", math.sqrt(base.measured(r) ** 2 + structural ** 2))):
                lo, hi = interval(r["anchored_ms"], sigma)
                mine[kind].append(lo <= r["measured_ms"] <= hi)
        out.append({"study": study, "points": len(mine["all"]), "structural": structural,
                    **{k: sum(v) / len(v) for k, v in mine.items() if v}})
        for k in inside:
            inside[k] += mine[k]
    out.append({"study": "all", "points": len(inside["all"]), "structural": structural_sigma(rows, prof, rounds),
                **{k: sum(v) / len(v) for k, v in inside.items()}})
    return out
