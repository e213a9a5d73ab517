"""The fault study's tables, from its results file alone:

    TABLES["faults"](Path("figures/data"))   # -> per family: a flap, a cut link, a lost host
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import bullets, listing, markdown, span
from jaxpar.config import TrainConfig


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _flap(f: dict) -> str:
    return ("survived" if f["survived"] else "**ended**") + f" (steps stalled {_s(f['longest_step_gap_s'])})"


def table(m: dict) -> str:
    """Per family: the flap, the cut link and the lost host, beside PyTorch's defaults."""
    rows = [[r["family"], f"`{r['strategy']}`", _flap(r["flap"]),
             _s(r["cut"]["end_s"]), str(r["cut"]["exit"]), "yes" if r["cut"]["names_host"] else "**no**",
             _s(r["lost_host"]["end_s"]), str(r["lost_host"]["exit"]),
             "; ".join(f"{f['seconds']:g} s: {_flap(f)}" for f in r.get("long_flaps", {}).get("flaps", [])) or "-"]
            for r in m["families"]]
    torch = "; ".join(f"{what}: {s // 60} min" for what, s in m["pytorch_default_s"].items())
    return (markdown(["family", "strategy", f"link down {m['families'][0]['flap']['seconds']:g} s, then up",
                      "cut link: job ended after", "exit", "report names the host",
                      "lost host: job ended after", "exit",
                      f"longer flaps, bound {TrainConfig().parallel.collective_timeout:g} s"], rows)
            + f"\n*Bound:* --collective-timeout {m['bound_s']:g} s ({m['link']}). *PyTorch's defaults "
            f"for the same wait:* {torch}.")


def overhead_table(m: dict) -> str:
    """The watchdog's cost: mpi-allreduce's median step with and without it."""
    rows = [[model, ", ".join(f"{x:.2f}" for x in c["with_ms"]), ", ".join(f"{x:.2f}" for x in c["without_ms"]),
             f"{statistics.median(c['with_ms']):.2f}", f"{statistics.median(c['without_ms']):.2f}",
             f"{c['ratio']:.3f}", f"{round_ratio(c):.3f}", f"{100 * c['thread_cpu_share']:.3f}%"]
            for model, c in m["overhead"].items()]
    return markdown(["model", "with watchdog: ms/step by round", "without: ms/step by round",
                     "median with", "median without", "with / without (medians)",
                     "with / without (median of the rounds' ratios)",
                     "watchdog thread's CPU time / run time"], rows)


def round_ratio(c: dict) -> float:
    """The median over rounds of with / without, each round's pair measured back to back (a
    slow spell of a shared machine falls on both of a pair more often than on both medians)."""
    return statistics.median(w / o for w, o in zip(c["with_ms"], c["without_ms"], strict=True))


def faults_report(data_dir: Path) -> str:
    """Per family: a flap, a cut link, a lost host across 2 emulated hosts."""
    return table(sources.load_source(data_dir, "faults")["metrics"])


def faults_overhead(data_dir: Path) -> str:
    """mpi-allreduce's step with and without the watchdog."""
    return overhead_table(sources.load_source(data_dir, "faults")["metrics"])


def fault_findings(m: dict) -> list[str]:
    """What the families' rows say, in words: the flap, the cut, the lost host, the longer flaps."""
    rows, bound = m["families"], m["bound_s"]
    flap = rows[0]["flap"]["seconds"]
    survived = sum(r["flap"]["survived"] for r in rows)
    cut = [r["cut"]["end_s"] for r in rows]
    named = sum(r["cut"]["names_host"] for r in rows)
    statuses = sorted({r["cut"]["exit"] for r in rows})
    lost = [r["lost_host"]["end_s"] for r in rows]
    lost_statuses = sorted({r["lost_host"]["exit"] for r in rows})
    lines = [f"{survived} of {len(rows)} families survived the {flap:g} s flap, their steps held up "
             f"{span([r['flap']['longest_step_gap_s'] for r in rows], '.1f', ' s')}.",
             f"After the cut every job ended {span(cut, '.1f', ' s')} after it (bound {bound:g} s), "
             f"exit status {', '.join(map(str, statuses))}; rank 0's report named the silent host "
             f"in {named} of {len(rows)}.",
             f"A lost host ended every job {span(lost, '.1f', ' s')} after the kill, through MPICH's "
             f"launcher (exit status {', '.join(map(str, lost_statuses))}, its own message)."]
    longer = [(r["strategy"], f) for r in rows for f in r.get("long_flaps", {}).get("flaps", [])]
    if longer:
        held = [f["longest_step_gap_s"] / f["seconds"] for _, f in longer]
        went_on = sorted({s for s, f in longer if f["survived"]})
        lines.append(f"Under the default bound ({rows[0]['long_flaps']['bound_s']:g} s) the longer flaps "
                     f"held the steps up {span(held, '.2f', 'x')} the flap itself (TCP's next "
                     f"retransmission); {listing([f'`{s}`' for s in went_on]) if went_on else 'no family'} went on.")
    default = TrainConfig().parallel.collective_timeout
    lines.append("PyTorch's defaults wait " + span([s / default for s in m["pytorch_default_s"].values()], ".0f", "x")
                 + f" jaxpar's default bound ({default:g} s) before its watchdog ends such a job.")
    return lines


def overhead_findings(m: dict) -> list[str]:
    """The watchdog's cost in words: the rounds' ratios and its thread's CPU time."""
    costs = m["overhead"].values()
    off = max(abs(round_ratio(c) - 1) for c in costs)
    return [f"The median of the rounds' ratios lies within {100 * off:.1f}% of 1 for "
            f"{' and '.join(m['overhead'])}; the watchdog's thread took "
            f"{span([100 * c['thread_cpu_share'] for c in costs], '.3f', '%')} of a core (a few "
            "datagrams a second and a look at a clock; a step costs it one call that stores two "
            "numbers, `watchdog.progress`)."]


TABLES = {"faults": faults_report, "faults-overhead": faults_overhead,
          "faults-findings": lambda d: bullets(fault_findings(sources.load_source(d, "faults")["metrics"])),
          "faults-overhead-findings": lambda d: bullets(overhead_findings(sources.load_source(d, "faults")["metrics"]))}
