"""`plan` validated against what measured fastest: for each model, device (or process) count and
batch a committed sitting measured, the configuration `plan` picks among everything it weighs
(strategy, mesh, micro-batches, schedule) and, among the configurations that sitting measured,
the one it ranks first, against the one that measured fastest (within the sitting's noise:
`ranking.group_noise`). `plan` predicts from the profile alone (no anchor: a user has not
measured that day), with the terms fitted on the committed points.

    rows = plan_validation(check_rows(data), profile, fitted_terms(rows))
"""

from __future__ import annotations

from experiments.cost import pricing, ranking
from jaxpar.parallel import STRATEGIES


def _nontrivial_axes(mesh: dict | None) -> dict:
    return {k: v for k, v in (mesh or {}).items() if v > 1}


def _same(plan_row: dict, point: dict, devices: int) -> bool:
    """Whether `plan`'s row is the configuration `point` measured: its strategy and, where the
    strategy takes them, its micro-batches, schedule and mesh."""
    cls = STRATEGIES[plan_row["strategy"]]
    if plan_row["strategy"] != point["strategy"]:
        return False
    if "microbatches" in cls.options and plan_row.get("microbatches") != point["microbatches"]:
        return False
    if "schedule" in cls.options and plan_row.get("schedule") != point["schedule"]:
        return False
    if len(cls.axes) > 1:
        mesh = "" if plan_row["mesh"] == "default" else plan_row["mesh"]
        axes, _ = pricing.mesh_axes(plan_row["strategy"], devices, mesh)
        return _nontrivial_axes(axes) == _nontrivial_axes(point.get("mesh"))
    return True


def _label(plan_row: dict) -> str:
    extra = [f"M={plan_row['microbatches']}"] if "microbatches" in plan_row else []
    extra += [plan_row["schedule"]] if plan_row.get("schedule") else []
    return " ".join([plan_row["strategy"], *([] if plan_row["mesh"] == "default" else [plan_row["mesh"]]), *extra])


def _singles(rows: list[dict], first: dict) -> list[dict]:
    """The `single` points a device group's sitting measured at its model and batch on every
    core (`plan` weighs `single` too; the check anchors on them, `plan` does not)."""
    if first["ranks"]:
        return []
    return [r for r in rows if r["strategy"] == "single" and r["sitting"] == first["sitting"] and "predicted_ms" in r
            and r["model"] == first["model"] and r["batch"] == first["batch"] and not r["one_thread"]
            and r["steps_per_dispatch"] == 1]


def plan_validation(rows: list[dict], profile: dict, fitted) -> list[dict]:
    """Per ranked group (`ranking.sitting_groups`): `plan`'s own pick and whether the sitting
    measured it (and then how it ran), its pick among the measured configurations, the
    measured fastest, and whether each pick hits. The network study's links are not a
    `plan` machine: there only its order of the measured configurations counts."""
    fallback = ranking.fresh_process_spread(rows)
    out = []
    for group in ranking.sitting_groups(rows, key="predicted_ms"):
        first, noise = group[0], ranking.group_noise(group, fallback)
        group = group + _singles(rows, first)
        best = min(group, key=lambda r: r["measured_ms"])
        among = min(group, key=lambda r: r["predicted_ms"])
        processes = all(r["ranks"] for r in group)
        entry = {"sitting": first["sitting"], "model": first["model"], "devices": first["devices"],
                 "processes": processes, "batch": first["batch"], "noise": noise,
                 "best": best["label"], "best_ms": best["measured_ms"],
                 "among": among["label"], "among_hit": among["measured_ms"] <= best["measured_ms"] * (1 + noise),
                 "pick": None, "pick_measured": None, "pick_hit": None}
        if first["study"] != "network":
            plan = pricing.plan_rows(profile, first["model"], first["devices"], first["batch"], pricing.PROFILED,
                                     "measured", None, processes=processes, fitted=fitted)
            top = plan[0]
            measured = next((r for r in group if _same(top, r, first["devices"])), None)
            entry.update(pick=_label(top), pick_ms=1000 * top["prediction"].total_s,
                         pick_measured=measured["measured_ms"] if measured else None,
                         pick_hit=(measured["measured_ms"] <= best["measured_ms"] * (1 + noise)) if measured else None)
        out.append(entry)
    return out
