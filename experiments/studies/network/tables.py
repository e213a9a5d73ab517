"""The network study's tables: the docs' (`report`: every strategy at every bandwidth, and the
crossovers) and its own OUT/summary.md, from its network.json.

    TABLES["network"](Path("figures/data"))   # -> a markdown table and the crossovers in words
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import DASH
from experiments.studies.network.rows import HEADER_BYTES, crossover_words, position
from jaxpar.parallel import STRATEGIES


def network_report(data_dir: Path) -> str:
    """Every strategy across 2 emulated hosts at each link bandwidth, and the crossovers."""
    m = sources.load_source(data_dir, "network")["metrics"]
    notes = [f"*{model}:* " + "; ".join(crossover_words(c)) + "."
             for model, c in m["crossovers"].items()]
    return network_table(m) + "\n" + "\n".join(notes)


def _mb(x: float | None) -> str:
    return DASH if x is None else f"{x / 1e6:,.2f}"


def _ms(x: float | None) -> str:
    return DASH if x is None else f"{x:,.1f}"


def network_table(metrics: dict) -> str:
    """One row per (model, strategy, bandwidth), the one-host reference per model first."""
    lines = ["| model | strategy | sends | link | ms/step | images/s | x one host | wire MB/step "
             "sent / received | theory MB/step (busier way) | compute ms | exposed comm ms | "
             "link time ms |", "|" + "---|" * 12]
    for ref in metrics["references"]:
        lines.append(f"| {ref['model']} | single (one host, 1 rank) | – | none | {_ms(ref['ms_per_step'])} | "
                     f"{ref['images_per_sec']:,.0f} | 1.00 | – | – | – | – | – |")
    for r in sorted(metrics["rows"], key=_order(metrics["rows"])):
        ratio = "–" if r["vs_one_host"] is None else f"{r['vs_one_host']:.2f}"
        lines.append(f"| {r['model']} | {r['strategy']} | {r['sends']} | {r['bandwidth']} | "
                     f"{_ms(r['ms_per_step'])} | {r['images_per_sec']:,.0f} | {ratio} | "
                     f"{_mb(r['wire_sent_per_step'])} / {_mb(r['wire_received_per_step'])} | "
                     f"{_mb(r['theory_wire_per_step'])} | {_ms(r['compute_ms'])} | "
                     f"{_ms(r['exposed_comm_ms'])} | {_ms(r['link_ms'])} |")
    return "\n".join(lines) + "\n"


def _order(rows: list[dict]):
    strategies = list(STRATEGIES)
    finite = sorted({r["rate_bits_per_s"] for r in rows if r["rate_bits_per_s"]})
    return lambda r: (r["model"], strategies.index(r["strategy"]), position(r["bandwidth"], finite))


def network_summary(study: dict) -> str:
    """OUT/summary.md: the table, the crossovers, the machine and links behind them."""
    cfg, env, m = study["config"], study["env"], study["metrics"]
    notes = [f"{model}: " + "; ".join(crossover_words(c)) for model, c in m["crossovers"].items()]
    failed = [f"failed: {folder} ({why.strip().splitlines()[-1] if why.strip() else ''})"
              for folder, why in m.get("failed", {}).items()]
    return (network_table(m) + "\n" + "\n".join(notes + failed) + "\n\n"
            f"{cfg['hosts']} emulated hosts (network namespaces on one {env['cpu_cores']}-core machine), "
            f"one single-threaded rank each; global batch {cfg['batch_size']}, median of "
            f"{cfg['iters']} steps after {cfg['warmup']}; jax {env['jax']}. Wire bytes: host 0's eth0 "
            f"counters over the timed steps, {HEADER_BYTES} header bytes per packet aside.\n")


TABLES = {"network": network_report}
