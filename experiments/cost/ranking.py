"""Does the cost model order strategies as they run? The first question a user asks of it is
not how long a step takes but which configuration to run: for every group of committed points
measured in one sitting on one model, device (or process) count and batch, the predicted
order against the measured one.

    groups = sitting_groups(check_rows(data))      # 3 or more configurations each, anchors left out
    ranked = [rank_group(g) for g in groups]        # Kendall's tau, the pick and the measured fastest
    rank_summary(ranked)                            # median tau, picks that hit

A group's noise is its points' own: the median over them of their rounds' range (max - min)
over their median; a group measured once per point (the network and time-to-accuracy studies)
has no rounds of its own and takes the typical range of one point's rounds in the studies that
measure rounds (`fresh_process_spread`). The pick hits when the configuration predicted
fastest measured within that noise of the fastest measured.
"""

from __future__ import annotations

import math
import statistics

MIN_CONFIGURATIONS = 3   # a group ranks 3 or more configurations (2 is one coin)


def sitting_groups(rows: list[dict], key: str = "anchored_ms") -> list[list[dict]]:
    """Rows with prediction `key`, grouped by sitting, model, devices (or processes) and
    global batch, the groups of MIN_CONFIGURATIONS or more; the anchors (their prediction
    is their measurement) left out."""
    found: dict = {}
    for r in rows:
        if key in r and not r.get("anchor"):
            found.setdefault((r["sitting"], r["model"], r["devices"], r["batch"]), []).append(r)
    return [g for _, g in sorted(found.items()) if len(g) >= MIN_CONFIGURATIONS]


def round_range(row: dict) -> float | None:
    """A point's rounds' range over their median (None: measured once)."""
    steps = row.get("rounds_ms") or []
    return (max(steps) - min(steps)) / statistics.median(steps) if len(steps) > 1 else None


def fresh_process_spread(rows: list[dict]) -> float:
    """The typical range of one point's rounds (each a fresh process) over their median, in
    the studies that measure rounds: what a point measured once may be off by."""
    ranges = [x for r in rows if (x := round_range(r)) is not None]
    return statistics.median(ranges) if ranges else 0.0


def group_noise(group: list[dict], fallback: float) -> float:
    """The median of the group's points' round ranges; `fallback` for points measured once."""
    ranges = [x for r in group if (x := round_range(r)) is not None]
    return statistics.median(ranges) if ranges else fallback


def kendall_tau(predicted: list[float], measured: list[float], tied: float = 0.0) -> float | None:
    """Kendall's tau-b between two orders (pairs, ties counted as tau-b counts them); `tied`:
    measured values within that fraction of each other are a tie (their order is noise). None
    where either order is all ties."""
    num = n_predicted = n_measured = 0
    for i in range(len(predicted)):
        for j in range(i + 1, len(predicted)):
            p = (predicted[i] > predicted[j]) - (predicted[i] < predicted[j])
            m = measured[i] - measured[j]
            m = 0 if abs(m) <= tied * min(measured[i], measured[j]) else (1 if m > 0 else -1)
            num += p * m
            n_predicted += p != 0
            n_measured += m != 0
    return num / math.sqrt(n_predicted * n_measured) if n_predicted and n_measured else None


def self_tau(group: list[dict]) -> float | None:
    """How well the measurement orders the group against itself: the median Kendall's tau of
    one round's order against another's, over every pair of rounds (None: measured once).
    No prediction can be expected to agree with the measurement better than it agrees with
    itself."""
    n = min(len(r.get("rounds_ms") or []) for r in group)
    taus = [kendall_tau([r["rounds_ms"][a] for r in group], [r["rounds_ms"][b] for r in group])
            for a in range(n) for b in range(a + 1, n)]
    taus = [t for t in taus if t is not None]
    return statistics.median(taus) if taus else None


def rank_group(group: list[dict], fallback: float = 0.0, key: str = "anchored_ms") -> dict:
    """One group ranked: its name, configurations (`ranks`: the share run as processes),
    noise, Kendall's tau (plain and with measured ties within the noise), the predicted and
    measured fastest and whether the pick hits (measured within the group's noise of the
    fastest)."""
    noise = group_noise(group, fallback)
    predicted, measured = [r[key] for r in group], [r["measured_ms"] for r in group]
    pick = min(group, key=lambda r: r[key])
    best = min(group, key=lambda r: r["measured_ms"])
    first = group[0]
    return {"sitting": first["sitting"], "study": first["study"], "model": first["model"],
            "devices": first["devices"], "ranks": sum(r["ranks"] for r in group) / len(group), "batch": first["batch"],
            "configurations": len(group), "noise": noise, "measured_once": round_range(first) is None,
            "tau": kendall_tau(predicted, measured), "tau_tied": kendall_tau(predicted, measured, noise),
            "tau_rounds": self_tau(group),
            "pick": pick["label"], "pick_ms": pick["measured_ms"], "best": best["label"],
            "best_ms": best["measured_ms"], "hit": pick["measured_ms"] <= best["measured_ms"] * (1 + noise),
            "points": [(r["label"], r[key], r["measured_ms"]) for r in group]}


def ranked_groups(rows: list[dict], key: str = "anchored_ms") -> list[dict]:
    """Every group of `rows` ranked by prediction `key` (`rank_group`)."""
    fallback = fresh_process_spread(rows)
    return [rank_group(g, fallback, key) for g in sitting_groups(rows, key)]


def rank_summary(ranked: list[dict]) -> dict:
    """Over the groups: how many, the median tau (plain and tied), how many below zero, the
    picks that hit; over the groups measured in rounds, the median tau of the measurement
    against itself and of the prediction against it."""
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    taus = [g["tau"] for g in ranked if g["tau"] is not None]
    rounds = [g for g in ranked if g["tau_rounds"] is not None and g["tau"] is not None]
    return {"groups": len(ranked), "tau_median": median(taus),
            "tau_tied_median": median([g["tau_tied"] for g in ranked if g["tau_tied"] is not None]),
            "negative": sum(t < 0 for t in taus), "hits": sum(g["hit"] for g in ranked),
            "with_rounds": len(rounds), "tau_rounds_median": median([g["tau_rounds"] for g in rounds]),
            "tau_with_rounds_median": median([g["tau"] for g in rounds])}


def ranks_of(values: list[float]) -> list[float]:
    """Each value's rank in `values`, 0 for the smallest to 1 for the largest (ties share)."""
    order = sorted(values)
    n = max(len(values) - 1, 1)
    return [(order.index(v) + (order.count(v) - 1) / 2) / n for v in values]
