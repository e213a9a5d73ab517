"""The cost model's tables (`python -m experiments report`): its error on every committed
point, per study; how it ranks strategies in each sitting (`ranking`) and what `plan` picks
(`plan_check`); its intervals' calibration (`uncertainty`); each study left out (`loso`); its
misses by cause (`misses`); the hardware it assumes; from `experiments.cost.check`."""

from __future__ import annotations

import functools
from pathlib import Path

from experiments.cost import check as cost_check
from experiments.cost import loso, misses, plan_bench, plan_check, pricing, ranking, terms, uncertainty
from experiments.publish.markdown import DASH, bullets, listing, markdown, percent, span
from jaxpar import cost, results


def _pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.0f}%"


def _pct1(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def cost_summary_table(data_dir: Path) -> str:
    """Median and largest |error| of the predicted step, per study and over all."""
    return markdown(["study", "points", "predicted (anchors)", "median abs. error", "largest abs. error",
                     "beyond 25%", "profile alone: median abs. error", "study's speed / profile's",
                     "state/device within 1%"],
                    [[s["study"], s["points"], f"{s['covered']} ({s['anchors']})", _pct(s["median"]),
                      _pct(s["max"]), s["beyond_25"], _pct(s["median_profile"]),
                      DASH if s["scale"] is None else f"{s['scale']:.2f}",
                      f"{s['state_equal']} of {s['state_checked']}"]
                     for s in cost_check.error_summary(cost_check.check_rows(data_dir))])


def cost_points_table(data_dir: Path) -> str:
    """Every committed point: measured and predicted ms/step, the prediction's parts, the
    error, predicted and measured state bytes per device; or why it is not covered."""
    out = []
    for r in cost_check.check_rows(data_dir):
        where = f"{r['devices']} {'ranks' if r['ranks'] else 'dev'}"
        if "error" not in r:
            out.append([r["point"], r["model"], r["strategy"], where, f"{r['measured_ms']:.1f}",
                        "not covered: " + r["why"], "", "", "", "", ""])
            continue
        state = (f"{r['state_predicted'] / 1e6:.2f} / {r['state_measured'] / 1e6:.2f}"
                 if r.get("state_measured") else DASH)
        out.append([r["point"], r["model"], r["strategy"], where, f"{r['measured_ms']:.1f}",
                    f"{r['predicted_ms']:.1f}",
                    f"{r['compute_ms']:.1f} + {r['comm_ms']:.1f} + {r['bubble_ms']:.1f}",
                    f"{r['anchored_ms']:.1f}", "anchor" if r["anchor"] else f"{100 * r['error']:+.0f}%",
                    f"{100 * r['error_profile']:+.0f}%", state])
    return markdown(["point", "model", "strategy", "devices", "measured ms", "predicted ms (profile)",
                     "compute + comm + bubble ms", "anchored ms", "error (anchored)", "error (profile alone)",
                     "state MB/device predicted / measured"], out)


def assumptions_table(_: Path) -> str:
    """The assumed hardware the extrapolation uses (jaxpar.cost.DEVICES and LINKS), with sources."""
    rows = [[f"device `{d.name}`", f"{d.peak_gflops / 1e3:g} TFLOP/s f32, {d.memory_bytes / 1e9:g} GB at "
             f"{d.memory_bytes_per_s / 1e12:g} TB/s, {1e6 * d.layer_overhead_s:g} us per layer and step",
             d.source] for d in cost.DEVICES.values()]
    rows += [[f"link `{k.name}`", f"{k.bytes_per_s / 1e9:g} GB/s, {1e6 * k.latency_s:g} us per message", k.source]
             for k in cost.LINKS.values()]
    return markdown(["assumed", "value", "source"], rows)


def h100_table(data_dir: Path) -> str:
    """The assumed H100 against an H100 profile measured on a lent node (`single`'s step)."""
    return markdown(["model", "batch", "measured on the H100 (profile) ms", "machine command's one-device ms",
                     "assumed H100 predicted ms", "assumed / measured"],
                    [[r["model"], r["batch"], f"{r['measured_ms']:.3f}",
                      DASH if r["machine_ms"] is None else f"{r['machine_ms']:.3f}",
                      f"{r['assumed_ms']:.3f}", f"{r['ratio']:.2f}"]
                     for r in cost_check.assumed_h100_rows(data_dir)])


def _errors(rows: list[dict], study: str, model: str, strategy: str) -> dict[int, float]:
    """{devices or ranks: anchored error} of one strategy's points in one study."""
    return {r["devices"]: r["error"] for r in rows if (r["study"], r["model"], r["strategy"]) == (study, model, strategy)
            and "error" in r and not r["anchor"] and "/strong/" in f"/{r['point']}/"}


def cost_findings(data_dir: Path) -> str:
    """The profile's session, the misses the check names, and the assumed H100 against a measured one."""
    rows = cost_check.check_rows(data_dir)
    summary = {s["study"]: s for s in cost_check.error_summary(rows)}
    profile = results.load(Path(data_dir) / cost_check.PROFILE_UNDER_DATA).metrics
    threads = [every / one for e in profile["models"].values()
               for every, one in zip(e["steps"]["step_ms_median"], e["steps_one_thread"]["step_ms_median"])]
    said = lambda errors: listing([f"{percent(e, signed=True)} on {n}" for n, e in sorted(errors.items())])  # noqa: E731
    four = {s: _errors(rows, "scaling-ranks", "cnn", s).get(4) for s in ("dp-auto", "pipeline", "layer-split")}
    before = {s["study"]: s for s in cost_check.error_summary(cost_check.check_rows(data_dir, base=True))}["all"]
    now = summary["all"]
    lines = [f"The check covers {now['covered']} of {now['points']} committed points, anchored: median error "
             f"{_pct1(now['median'])}, {now['beyond_25']} of {now['covered'] - now['anchors']} beyond 25%, the "
             f"largest {_pct1(now['max'])}; the profile alone {_pct1(now['median_profile'])}. Before the terms "
             f"measured from the points: {_pct1(before['median'])}, {before['beyond_25']} beyond 25%, the largest "
             f"{_pct1(before['max'])}.",
             f"In the profile's session the every-core step of each model at each batch was "
             f"{span(threads, '.2f', 'x')} its one-thread step: XLA's second thread sometimes cost more than it bought.",
             f"`tensor` across processes on one host: {said(_errors(rows, 'scaling-ranks', 'cnn', 'tensor'))} ranks; "
             f"`tensor-auto` {said(_errors(rows, 'scaling-ranks', 'cnn', 'tensor-auto'))}.",
             "On 4 processes, more than the cores: " + ", ".join(
                 f"`{s}` {percent(e, signed=True)}" for s, e in four.items() if e is not None) + ".",
             f"The network study's {summary['network']['covered']} points, each collective priced as the profile "
             f"measured it across 2 emulated hosts at the point's bandwidth: median error "
             f"{percent(summary['network']['median'])}."]
    h100 = cost_check.assumed_h100_rows(data_dir)
    if h100:
        lines.append(f"The assumed H100 predicts `single`'s step {span([1 / r['ratio'] for r in h100], '.1f', 'x')} "
                     f"faster than the measured H100 ran it ({len(h100)} model and batch pairs).")
    return bullets(lines)


def _profile(data_dir: Path) -> dict:
    return pricing.load_profile(str(Path(data_dir) / cost_check.PROFILE_UNDER_DATA))


def _where(devices: int, ranks: float) -> str:
    """'4 dev', '4 ranks', or '4 dev or ranks' (`ranks`: the share of the points run as processes)."""
    return f"{devices} {'ranks' if ranks == 1 else 'dev or ranks' if ranks else 'dev'}"


def _tau(x: float | None) -> str:
    return DASH if x is None else f"{x:+.2f}"


def ranking_table(data_dir: Path) -> str:
    """Per sitting, model, devices and batch: the predicted order against the measured one."""
    rows = []
    for g in ranking.ranked_groups(cost_check.check_rows(data_dir)):
        rows.append([g["sitting"], g["model"], _where(g["devices"], g["ranks"]), g["batch"], g["configurations"],
                     f"{g['noise']:.0%}" + (" (typical)" if g["measured_once"] else ""), _tau(g["tau"]),
                     _tau(g["tau_tied"]), _tau(g["tau_rounds"]), f"{g['pick']} ({g['pick_ms']:.1f})",
                     f"{g['best']} ({g['best_ms']:.1f})",
                     "yes" if g["hit"] else "**no**"])
    return markdown(["sitting", "model", "devices", "batch", "configurations", "noise", "Kendall's tau",
                     "tau, ties within the noise", "one round against another", "predicted fastest (measured ms)",
                     "measured fastest (ms)",
                     "pick within the noise"], rows)


def _plan_rows(data_dir: Path) -> list[dict]:
    """`plan`'s pick per sitting (two tables use it), cached as `check_rows` is."""
    return _plan_rows_of(*cost_check.cache_key(data_dir))


@functools.lru_cache(maxsize=4)
def _plan_rows_of(data_dir: str, _stamp: int) -> list[dict]:
    rows = cost_check.check_rows(Path(data_dir))
    return plan_check.plan_validation(rows, _profile(Path(data_dir)), terms.fitted_terms(rows))


def plan_table(data_dir: Path) -> str:
    """Per sitting: `plan`'s pick (profile alone, with the terms) and how it ran, against the
    measured fastest."""
    out = []
    for e in _plan_rows(data_dir):
        if e["pick"] is None:
            mine = f"({DASH}: a link `plan` does not price)"
        elif e["pick_measured"] is None:
            mine = f"{e['pick']} (not measured there)"
        else:
            mine = f"{e['pick']} ({e['pick_measured']:.1f}{'' if e['pick_hit'] else ', **miss**'})"
        out.append([e["sitting"], e["model"], _where(e["devices"], e["processes"]), e["batch"], mine,
                    f"{e['among']}{'' if e['among_hit'] else ' (**miss**)'}", f"{e['best']} ({e['best_ms']:.1f})"])
    return markdown(["sitting", "model", "devices", "batch", "`plan`'s pick (measured ms)",
                     "`plan`'s first of the measured configurations", "measured fastest (ms)"], out)


def calibration_table(data_dir: Path) -> str:
    """Per study: how often the measured step falls inside the nominal 80% interval."""
    profile = _profile(data_dir)
    return markdown(["study", "points", "the model's own spread (fitted without the study)",
                     "inside: the profile's noise alone", "inside: every measured spread",
                     "inside: and the model's own"],
                    [[c["study"], c["points"], f"{c['structural']:.3f}", _pct(c.get("profile")),
                      _pct(c.get("measured")), _pct(c.get("all"))]
                     for c in uncertainty.calibration(cost_check.check_rows(data_dir), profile)])


def loso_table(data_dir: Path) -> str:
    """Per study: the anchored errors in sample, left out, and left out with no anchor of its own."""
    cell = lambda s: f"{_pct(s['median'])} ({s['beyond_25']})"  # noqa: E731
    return markdown(["study", "points", "in sample: median abs. error (beyond 25%)",
                     "left out, its own `single` anchoring", "left out, no measurement of its own"],
                    [[r["study"], r["in"]["points"], cell(r["in"]), cell(r["out"]), cell(r["blind"])]
                     for r in loso.loso_summary(cost_check.check_rows(data_dir), _profile(data_dir)["cores"])])


def misses_table(data_dir: Path) -> str:
    """The points beyond 25% by cause: before the terms and now, each cause measured."""
    return markdown(["cause", "beyond 25% before", "beyond 25% now", "measured", "what the model prices of it"],
                    [[m["cause"], m["before"], m["now"], m["measured"], m["priced"]]
                     for m in misses.misses_by_cause(data_dir)])


def plan_bench_table(data_dir: Path) -> str:
    """`plan --bench-top`: its first configurations as it printed them, then measured in rounds."""
    out = []
    for rec in plan_bench.bench_records(data_dir):
        q, found = rec["question"], rec["configurations"]
        fastest = min(found, key=lambda f: f["measured_ms"])
        for k, f in enumerate(found):
            lo, hi = f["interval_ms"]
            out.append([f"`plan --model {q['key']} --{'ranks' if q['processes'] else 'devices'} {q['devices']}`",
                        k + 1, f["folder"], f"{f['predicted_ms']:.1f}",
                        DASH if lo is None else f"{lo:.1f}-{hi:.1f}", "yes" if f["tie"] else "no",
                        f"{f['measured_ms']:.1f}", f"{min(f['rounds_ms']):.1f}-{max(f['rounds_ms']):.1f}",
                        "**fastest**" if f is fastest else "",
                        f"{rec['load_average_1min']['before']:.1f} / {rec['load_average_1min']['after']:.1f}"])
    return markdown(["question", "plan's rank", "configuration", "predicted ms", "80% interval ms", "a tie",
                     "measured ms (median of rounds)", "rounds' range ms", "", "load average before / after"], out)


def _bench_lines(data_dir: Path) -> list[str]:
    lines = []
    for rec in plan_bench.bench_records(data_dir):
        q, found = rec["question"], rec["configurations"]
        fastest = min(found, key=lambda f: f["measured_ms"])
        ask = f"`plan --model {q['key']} --{'ranks' if q['processes'] else 'devices'} {q['devices']}`"
        ties = " (a tie: their intervals overlap)" if all(f["tie"] for f in found) else ""
        lines.append(f"{ask} put {found[0]['folder']} first and {found[1]['folder']} second{ties}; in "
                     f"{rec['rounds']} rotated rounds on {rec['cores']} shared cores (load average "
                     f"{rec['load_average_1min']['before']:.1f} before, {rec['load_average_1min']['after']:.1f} after) "
                     f"they ran {found[0]['measured_ms']:.1f} and {found[1]['measured_ms']:.1f} ms a step: "
                     + ("its first ran fastest." if fastest is found[0] else "its second ran fastest."))
    return lines


def choice_findings(data_dir: Path) -> str:
    """The order, `plan`'s picks, the intervals, each study left out, the terms: in numbers."""
    rows, before = cost_check.check_rows(data_dir), cost_check.check_rows(data_dir, base=True)
    now, was = ranking.rank_summary(ranking.ranked_groups(rows)), ranking.rank_summary(ranking.ranked_groups(before))
    planned = _plan_rows(data_dir)
    measured = [e for e in planned if e["pick_measured"] is not None]
    cal = uncertainty.calibration(rows, _profile(data_dir))[-1]
    out = {r["study"]: r for r in loso.loso_summary(rows, _profile(data_dir)["cores"])}["all"]
    fitted = terms.fitted_terms(rows)
    return bullets([
        f"In {now['groups']} sittings of {ranking.MIN_CONFIGURATIONS} or more configurations, Kendall's tau of the "
        f"predicted against the measured order has a median of {now['tau_median']:.2f} ({now['negative']} below 0; "
        f"before the terms {was['tau_median']:.2f}, {was['negative']} below 0); the predicted fastest measured within "
        f"its sitting's noise of the fastest in {now['hits']} of {now['groups']} (before: {was['hits']}).",
        f"The measurement orders itself no better: in the {now['with_rounds']} sittings measured in rounds, one "
        f"round's order against another's has a median tau of {now['tau_rounds_median']:.2f}, the prediction's "
        f"against their medians {now['tau_with_rounds_median']:.2f}.",
        f"`plan` (the profile alone, with the terms) ranked first, of the configurations each sitting measured, one "
        f"within the noise of the fastest in {sum(e['among_hit'] for e in planned)} of {len(planned)}; its own pick "
        f"over everything it weighs was measured in {len(measured)} sittings and ran within the noise of the "
        f"fastest in {sum(bool(e['pick_hit']) for e in measured)}.",
        f"The nominal {percent(uncertainty.NOMINAL)} interval held the measured step of {_pct1(cal['all'])} of "
        f"{cal['points']} points (each study's with the model's own spread fitted on the others); the profile's "
        f"noise alone {_pct1(cal['profile'])}, every measured spread without the model's {_pct1(cal['measured'])}.",
        f"Each study left out, its terms fitted on the others and its own `single` anchoring: median error "
        f"{_pct1(out['out']['median'])}, {out['out']['beyond_25']} beyond 25% (in sample "
        f"{_pct1(out['in']['median'])}, {out['in']['beyond_25']}); with no measurement of its own (the other "
        f"studies' speed for its sittings): {_pct1(out['blind']['median'])}, {out['blind']['beyond_25']} beyond 25%.",
        "The terms: " + ", ".join(f"`{t.strategy}` x{t.factor:.2f} `{t.twin}`'s step"
                                  + (" across processes" if t.processes else "") for t in fitted.formulations.values())
        + f"; a pinned process {1000 * fitted.host_s:.2f} ms a step of host work on its core.",
        *_bench_lines(data_dir)])


TABLES = {"cost-findings": cost_findings, "cost-summary": cost_summary_table, "cost-points": cost_points_table,
          "cost-assumptions": assumptions_table, "cost-h100": h100_table, "cost-ranking": ranking_table,
          "cost-plan": plan_table, "cost-calibration": calibration_table, "cost-loso": loso_table,
          "cost-misses": misses_table, "cost-plan-bench": plan_bench_table, "cost-choice-findings": choice_findings}
