"""Out of sample: each study predicted by the model fitted without it (leave one study out).

What the model takes from the committed points: its terms (`terms`: the formulations' measured
factors, a pinned process's host time) and each sitting's speed (its `single`, the anchor).
Left out, a study is predicted with terms fitted on the other studies alone, either

- anchored on its own `single` (a measurement a user makes before predicting the rest: the
  session's speed, not a fit to the points predicted), or
- with no measurement of its own at all: the other studies' median speed for the same model
  and threads (what the check's anchor falls back to), the model as a user without a single
  step measured that day would have it.

    for row in loso_summary(check_rows(data), cores=2): ...   # per study: in sample, left out, no anchor
"""

from __future__ import annotations

import statistics

from experiments.cost import check, terms


def _study_of(group: tuple) -> str:
    return group[0].split("/")[0]


def left_out_rows(rows: list[dict], study: str, own_anchor: bool, cores: int) -> list[dict]:
    """`study`'s rows predicted with every term fitted without it; anchored on its own `single`
    (`own_anchor`) or on the other studies' speeds alone. Copies: the cached rows stay."""
    copied = [dict(r) for r in rows]
    check.apply_terms(copied, terms.fitted_terms(copied, leave_out=study), cores)
    scales = check.anchor(copied)
    if not own_anchor:
        check.anchor(copied, {g: s for g, s in scales.items() if _study_of(g) != study})
        # its `single` points stay out of its errors, as in sample
    return [r for r in copied if r["study"] == study]


def _abs_errors(rows: list[dict]) -> list[float]:
    return [abs(r["error"]) for r in rows if "error" in r and not r["anchor"]]


def _stats(errors: list[float]) -> dict:
    return {"median": statistics.median(errors) if errors else None,
            "beyond_25": sum(e > 0.25 for e in errors), "points": len(errors)}


def loso_summary(rows: list[dict], cores: int) -> list[dict]:
    """Per study and over all: the anchored errors in sample, left out (its own anchor kept),
    and left out with no measurement of its own (median |error|, points beyond 25%)."""
    studies = [s for s, _ in check.CHECKED_STUDIES if any(r["study"] == s and "error" in r for r in rows)]
    out, pooled = [], {"in": [], "out": [], "blind": []}
    for study in studies:
        errs = {"in": _abs_errors([r for r in rows if r["study"] == study]),
                "out": _abs_errors(left_out_rows(rows, study, True, cores)),
                "blind": _abs_errors(left_out_rows(rows, study, False, cores))}
        out.append({"study": study, **{k: _stats(v) for k, v in errs.items()}})
        for k, v in errs.items():
            pooled[k] += v
    out.append({"study": "all", **{k: _stats(v) for k, v in pooled.items()}})
    return out
