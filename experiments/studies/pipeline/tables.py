"""The pipeline study's table (`report`): bubble, images/s, activation memory and bytes moved
against micro-batches M per schedule, from its pipeline.json.

    TABLES["pipeline"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import statistics

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, markdown, mb, num, percent, span
from experiments.studies.pipeline.study import GEMS
from jaxpar import results


def pipeline_table(data_dir: Path) -> str:
    data = sources.load_source(data_dir, "pipeline")
    rows = data["metrics"]["rows"]
    by = {(r["schedule"], r["M"]): r for r in rows}
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    gems = [GEMS] if GEMS in names else []  # its own bubble (GPipe's and 1F1B's agree)
    bubble = lambda h: f"{h['bubble']:.3f} ({h['theory']:.3f})" if h else DASH  # noqa: E731
    out = []
    for m in sorted({r["M"] for r in rows}):
        here = [by.get((s, m), {}) for s in names]
        out.append([m, bubble(here[0]), *[bubble(by.get((g, m))) for g in gems],
                    *[num(h.get("images_per_sec")) for h in here],
                    *[num(h.get("activation_bytes", h["temp_bytes"]) / 2 ** 20, 1) if h.get("temp_bytes") else DASH
                      for h in here],
                    *[mb(h.get("moved_bytes", h.get("collective_bytes"))) for h in here]])
    table = markdown(["M", "bubble (S-1)/(M+S-1)", *[f"{g} bubble (S-2)/(2M+S-2)" for g in gems],
                      *[f"{s} images/s" for s in names], *[f"{s} activation MiB/device" for s in names],
                      *[f"{s} MB moved/step" for s in names]], out)
    single = data["metrics"].get("single") or {}
    if not single.get("images_per_sec"):
        return table  # measured before the study had its reference, or --no-measure
    return (f"The reference, `single` on one device at the same batch: {num(single['images_per_sec'])} "
            f"images/s ({num(single['step_ms'], 1)} ms/step).\n\n{table}")


def _mib(row: dict) -> float:
    return row.get("activation_bytes", row["temp_bytes"]) / 2 ** 20


def pipeline_findings(data_dir: Path) -> str:
    """The bubble against its formula, memory and throughput against M, and the timelines."""
    data = sources.load_source(data_dir, "pipeline")
    m = data["metrics"]
    rows, S = m["rows"], m["stages"]
    of = lambda name: [r for r in rows if r["schedule"] == name]  # noqa: E731
    plain = [r for r in rows if r["schedule"] in ("gpipe", "1f1b")]
    off = [r for r in of(GEMS) if abs(r["bubble"] - r["theory"]) > 1e-9]
    lines = [("The tables' bubble equals (S-1)/(M+S-1) for GPipe and 1F1B at every M"
              if all(abs(r["bubble"] - r["theory"]) < 1e-9 for r in plain) else
              "The tables' bubble departs from (S-1)/(M+S-1)")
             + f" (S = {S}, M = {listing([str(r['M']) for r in of('gpipe')])}), GEMS's equals (S-2)/(2M+S-2)"
             + ("".join(f" but at M = {r['M']} ({r['bubble']:.3f} against {r['theory']:.3f})" for r in off))
             + "; the most micro-batches stage 0 holds at once grows as M under GPipe "
             f"({max(r['peak_in_flight'] for r in of('gpipe'))} at M = {max(r['M'] for r in rows)}) and stops at "
             f"{max(r['peak_in_flight'] for r in of('1f1b'))} under 1F1B."]
    others = [name for name in dict.fromkeys(r["schedule"] for r in rows) if name not in ("gpipe", "1f1b", GEMS)]
    if others:
        at = {name: max(of(name), key=lambda r: r["M"]) for name in others}
        lines.append("Replayed from their own lists with a backward twice a forward, the other schedules idle "
                     + "; ".join(f"{name} {percent(at[name]['bubble'])} at M = {at[name]['M']}" for name in others)
                     + f" (1F1B {percent(max(of('1f1b'), key=lambda r: r['M'])['bubble'])} at its largest M).")
    timed = [r for r in rows if r.get("images_per_sec")]
    if timed:
        first = min(r["M"] for r in timed)
        at = lambda name, k: next(r for r in timed if r["schedule"] == name and r["M"] == k)  # noqa: E731
        ends = {name: (at(name, min(r["M"] for r in timed if r["schedule"] == name)),
                       at(name, max(r["M"] for r in timed if r["schedule"] == name)))
                for name in dict.fromkeys(r["schedule"] for r in timed)}
        lines.append("Activations per device: " + "; ".join(
            f"{name} {_mib(a):.1f} MiB at M = {a['M']}" + (f", {_mib(b):.1f} at M = {b['M']}" if b is not a else "")
            for name, (a, b) in ends.items()) + ".")
        single = (m.get("single") or {}).get("images_per_sec")
        if single:
            ones = [r for r in timed if r["M"] == first]
            lines.append(f"At M = {first} the pipelines run {span([r['images_per_sec'] / single for r in ones], '.2f', 'x')} "
                         f"`single` on one device at the same batch ({listing([num(r['images_per_sec']) for r in ones])} "
                         f"against {num(single)} images/s); from the smallest timed M to the largest: " + "; ".join(
                             (f"{name} from {num(a['images_per_sec'])} to {num(b['images_per_sec'])}" if b is not a
                              else f"{name} {num(a['images_per_sec'])} (timed at M = {a['M']} alone)")
                             for name, (a, b) in ends.items()) + " images/s.")
        spread = {(r["schedule"], r["M"]): max(r["step_ms_rounds"]) / min(r["step_ms_rounds"]) - 1
                  for r in timed if len(r.get("step_ms_rounds", ())) > 1}
        if spread:
            (name, k) = max(spread, key=spread.get)
            lines.append(f"A point's rounds spread by up to {percent(spread[(name, k)])} ({name} at M = {k}: "
                         f"{span(at(name, k)['step_ms_rounds'], '.0f', ' ms')}).")
        moved = [r["moved_bytes"] for r in of(GEMS) if r.get("moved_bytes")]  # its timed M's
        if moved:
            lines.append(f"GEMS moves {mb(moved[-1])} MB a step: each stage's gradient to the "
                         "stage's other copy.")
    lines += [_timeline_line(name, tl) for name, tl in m.get("timelines", {}).items()]
    cut = _timeline_cut(data_dir, m)
    if cut:
        lines.append(cut)
    return bullets(lines)


def _timeline_line(name: str, tl: dict) -> str:
    """One measured timeline: the walked step's bubble beside its table's, replayed with the
    same action times (older files: the stamped walk's idle share beside the table's)."""
    if tl.get("walk_ms") is not None:
        return (f"Timeline, {name} ({tl['model']}): walked from the host ({tl['walk_ms']:.1f} ms before "
                f"its updates), the step idles {percent(tl['bubble_measured'])} of devices x walk against "
                f"{percent(tl['bubble_timed'])}, its table replayed with the same action times (each program "
                f"timed alone); as one program per device the step takes {tl['step_ms']:.1f} ms.")
    return (f"Timeline, {name} ({tl['model']}): measured idle {percent(tl['idle_fraction'])} of devices x "
            f"span against the schedule's bubble of {percent(tl['bubble_fraction'])}; the timed step "
            f"{tl['step_ms']:.1f} ms.")


def _timeline_cut(data_dir: Path, m: dict) -> str:
    """Stage 0's share of the timelines' model's FLOPs, from one timeline point's result."""
    timelines = list(m.get("timelines", {}).values())
    if not timelines:
        return ""
    path = sources.path_of(data_dir, "pipeline").parent / timelines[0]["point"] / results.RESULT_FILE
    flops = results.load(path).strategy.get("stage_flops_per_example")
    if not flops:
        return ""
    shares = ", ".join(f"stage {k} {percent(f / sum(flops))}" for k, f in enumerate(flops))
    first = next(iter(m["timelines"]))
    return f"The timelines' {timelines[0]['model']} cut by FLOPs into stages ({first}): {shares} of its FLOPs."


def pipeline_ranks_table(data_dir: Path) -> str:
    """Every schedule across ranks: per M the median round's step, the median of the rounds'
    ratios to 1F1B's step (below 1: faster), and the table's bubble (a backward twice a
    forward)."""
    rows = sources.load_source(data_dir, "pipeline")["metrics"].get("ranks") or []
    if not rows:
        return "No rank points in this run (`--ranks 0`)."
    by = {(r["schedule"], r["M"]): r for r in rows}
    counts = sorted({r["M"] for r in rows})
    out = [[name, *[cell for m in counts for cell in _rank_cells(by.get((name, m)))]]
           for name in dict.fromkeys(r["schedule"] for r in rows)]
    rounds = len(rows[0]["step_ms_rounds"])
    head = [h for m in counts for h in (f"M={m} ms/step", f"M={m} of 1F1B's step", f"M={m} table bubble",
                                        f"M={m} idle ms: measured / table replayed")]
    return (f"`pipeline` across {rows[0]['ranks']} MPI ranks of one device and one thread each (stack-mlp, "
            f"a stage per rank, its step one program per process); {rounds} rounds, the order rotated each; "
            f"a step's ratio to 1F1B's is the median over rounds of the ratio within a round; the idle time "
            f"a device a step within the span of the step's actions, as the ranks' programs stamped it, "
            f"against the step's table replayed with the same step's action times and the measured "
            f"mean message latency (medians over steps, then over rounds).\n\n"
            + markdown(["schedule", *head], out) + "\n\n" + _rank_gains(rows, counts))


def _rank_gains(rows: list[dict], counts: list[int]) -> str:
    """Per M, the schedules faster than 1F1B across the ranks (median ratio below 1); the
    measured idle time against the replayed table's, schedule by schedule."""
    lines = []
    for m in counts:
        faster = sorted((r for r in rows if r["M"] == m and r["to_1f1b"] < 1), key=lambda r: r["to_1f1b"])
        lines.append(f"At M = {m}, faster than 1F1B: " + (", ".join(
            f"{r['schedule']} by {percent(1 - r['to_1f1b'])}" for r in faster) or "none") + ".")
    timed = [r for r in rows if r.get("idle_ms") is not None and r.get("idle_ms_replayed")]
    if timed:
        near = [r for r in timed if abs(r["idle_ms"] / r["idle_ms_replayed"] - 1) <= 0.25]
        lines.append(f"The idle time stamped within 25% of the replayed table's in {len(near)} of "
                     f"{len(timed)} (schedule, M): " + ", ".join(
                         f"{r['schedule']} M={r['M']} {r['idle_ms'] / r['idle_ms_replayed']:.2f}x" for r in timed)
                     + ".")
    latencies = [r["latency_ms"] for r in rows if r.get("latency_ms") is not None]
    if latencies:
        lines.append(f"A message's mean latency, from an activation's send to the end of a receive that waited for it: "
                     f"{1000 * statistics.median(latencies):.0f} µs (the median over the rows; "
                     f"{1000 * min(latencies):.0f} to {1000 * max(latencies):.0f}).")
    return bullets(lines)


def _rank_cells(row: dict | None) -> list:
    if row is None:
        return [DASH] * 4
    idle = (DASH if row.get("idle_ms") is None or row.get("idle_ms_replayed") is None else
            f"{num(row['idle_ms'], 1)} / {num(row['idle_ms_replayed'], 1)}")
    return [num(row["step_ms"], 1), f"{row['to_1f1b']:.3f}", percent(row["bubble"]), idle]


TABLES = {"pipeline": pipeline_table, "pipeline-findings": pipeline_findings,
          "pipeline-ranks": pipeline_ranks_table}
