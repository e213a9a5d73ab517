"""The pipeline study's table (`report`): bubble, images/s, activation memory and bytes moved
against micro-batches M per schedule, from its pipeline.json.

    TABLES["pipeline"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import DASH, markdown, mb, num
from experiments.studies.pipeline.study import GEMS


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


TABLES = {"pipeline": pipeline_table}
