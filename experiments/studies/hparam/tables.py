"""The hparam study's table (`report`): per (width, depth) group the vmapped and one-by-one
search times, the speed-up, and the best configurations both ways, from its hparam.json.

    TABLES["hparam"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import bullets, markdown, times


def hparam_table(data_dir: Path) -> str:
    study = sources.load_source(data_dir, "hparam")
    trials = study["config"]["trial_list"]  # [seed, lr, momentum] per trial
    out = []
    for g in study["metrics"]["groups"]:
        b, s, q = g["best"], g["best_over_seeds"], g["best_over_seeds_sequential"]
        worst = max(range(len(trials)), key=lambda i: g["loss_diff_per_trial"][i])
        seed, lr, mom = trials[worst]
        out.append([f"width {g['width']}, depth {g['depth']}", f"{g['vmapped_s']:.1f} s",
                    f"{g['sequential_s']:.1f} s", f"{g['speedup']:.2f}x",
                    f"{g['vmapped_compile_s']:.1f} s / {g['sequential_compile_s']:.1f} s",
                    f"lr {b['lr']:g}, m {b['momentum']:g}, seed {b['seed']} ({b['val_accuracy']:.3f})",
                    f"({s['lr']:g}, {s['momentum']:g}): {s['mean_val_accuracy']:.3f}",
                    "yes" if (s["lr"], s["momentum"]) == (q["lr"], q["momentum"]) else "no",
                    f"{g['max_loss_diff']:.2g} (lr {lr:g}, m {mom:g}, seed {seed})"])
    return markdown(["group", "vmapped", "one by one", "speed-up", "compile (vmapped / one by one)",
                     "best trial (val. accuracy)", "best (lr, momentum) over seeds",
                     "same best over seeds one by one", "largest loss difference (trial)"], out)


def hparam_findings(data_dir: Path) -> str:
    """Where vmapped trials win, whether both ways pick the same best, how far they drift."""
    study = sources.load_source(data_dir, "hparam")
    groups, m = study["metrics"]["groups"], study["metrics"]
    same = [g for g in groups if (g["best_over_seeds"]["lr"], g["best_over_seeds"]["momentum"])
            == (g["best_over_seeds_sequential"]["lr"], g["best_over_seeds_sequential"]["momentum"])]
    worst = max(groups, key=lambda g: g["max_loss_diff"])
    best = m["best"]
    return bullets([
        f"{groups[0]['trials']} trials a group as one vmapped program, against one after another (training "
        "time, compilation apart): " + ", ".join(
            f"width {g['width']} depth {g['depth']} {times(g['speedup'])}" for g in groups) + ".",
        f"The best (lr, momentum) averaged over the seeds is the same both ways in {len(same)} of "
        f"{len(groups)} groups; the largest loss difference between the two ways, "
        f"{worst['max_loss_diff']:.2g}, is in the width {worst['width']} depth {worst['depth']} group.",
        f"The best trial of all: width {best['width']}, depth {best['depth']}, lr {best['lr']:g}, momentum "
        f"{best['momentum']:g}, seed {best['seed']}: validation accuracy {best['val_accuracy']:.3f}."])


TABLES = {"hparam": hparam_table, "hparam-findings": hparam_findings}
