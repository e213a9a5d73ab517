"""The network study's tables: the docs' (`report`: every strategy at every bandwidth, and the
crossovers) and its own OUT/summary.md, from its network.json.

    TABLES["network"](Path("figures/data"))   # -> a markdown table and the crossovers in words
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish import sources
from experiments.publish.markdown import DASH, bullets, listing, percent, span, times
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


def network_findings(data_dir: Path) -> str:
    """Bytes on the wire against theory, what the slowest link costs, and each model's crossing."""
    m = sources.load_source(data_dir, "network")["metrics"]
    rows, refs = m["rows"], {r["model"]: r for r in m["references"]}
    finite = sorted({r["rate_bits_per_s"] for r in rows if r["rate_bits_per_s"]})
    order = sorted({r["bandwidth"] for r in rows}, key=lambda b: position(b, finite))
    slow, fast = order[0], order[-1]
    at = lambda model, s, bw: next((r for r in rows if (r["model"], r["strategy"], r["bandwidth"]) == (model, s, bw)), None)  # noqa: E731
    wired = [r for r in rows if r["wire_busier_per_step"] and r["theory_wire_per_step"]]
    off = [abs(r["wire_busier_per_step"] / r["theory_wire_per_step"] - 1) for r in wired]
    theory = lambda model: listing([  # noqa: E731
        f"`{s}` {at(model, s, slow)['theory_wire_per_step'] / 1e6:.2f} MB"
        for s in ("mpi-allreduce", "mpi-param-server", "pipeline", "tensor") if at(model, s, slow)])
    lines = [f"Every strategy put its theory's bytes on the wire to within {percent(max(off))} (headers aside; "
             f"{len(wired)} points): " + "; ".join(f"{model} {theory(model)}" for model in refs)
             + " a step, the busier way."]
    beaten = [r for r in rows if r["bandwidth"] == slow and r["vs_one_host"] and r["vs_one_host"] >= 1]
    exposed = {r["strategy"]: r["exposed_comm_ms"] / r["link_ms"] for r in rows
               if r["bandwidth"] == slow and r["model"] == "cnn" and r["link_ms"] and r["exposed_comm_ms"] is not None}
    lines.append(f"At {slow} " + ("nothing beats one host" if not beaten else
                                   f"{listing([r['strategy'] for r in beaten])} beat one host")
                 + "; on the CNN the exposed communication is " + ", ".join(
                     f"`{s}` {times(x, 1)}" for s, x in sorted(exposed.items(), key=lambda kv: kv[1]))
                 + " the theory's bytes at the link's rate.")
    both, one = at("cnn", "pipeline", slow), at("cnn", "mpi-pipeline", slow)
    if both and one:
        lines.append(f"On the CNN at {slow}, `pipeline`, whose sends never wait, takes {both['ms_per_step']:.0f} ms "
                     f"({times(both['exposed_comm_ms'] / both['link_ms'], 1)} one direction's link time) and "
                     f"`mpi-pipeline`, every activation before any gradient, {one['ms_per_step']:.0f} ms "
                     f"({times(one['exposed_comm_ms'] / one['link_ms'], 1)}).")
    for model, ref in refs.items():
        top = {bw: max((r for r in rows if r["model"] == model and r["bandwidth"] == bw),
                       key=lambda r: r["images_per_sec"]) for bw in order}
        lines.append(f"{model}: one host {ref['ms_per_step']:.1f} ms a step; the fastest on 2 hosts: " + ", ".join(
            f"{bw} `{r['strategy']}` {r['ms_per_step']:.1f} ms ({times(r['vs_one_host'])} one host)"
            for bw, r in top.items()) + ".")
    grads = {model: at(model, "mpi-allreduce", slow) for model in refs}
    acts = {model: at(model, "pipeline", slow) for model in refs}
    lines += [f"{model}: the pipeline's boundary is {acts[model]['theory_wire_per_step'] / 1e6:.2f} MB a step against "
              f"{grads[model]['theory_wire_per_step'] / 1e6:.2f} MB of gradients; `pipeline` against `mpi-allreduce`: "
              + ", ".join(f"{bw} {at(model, 'pipeline', bw)['ms_per_step']:.1f} against "
                          f"{at(model, 'mpi-allreduce', bw)['ms_per_step']:.1f} ms" for bw in order) + "."
              for model in refs if acts[model] and grads[model]]
    distributed = [at("cnn", s, fast) for s in ("dp-auto", "dp-shard-map", "fsdp", "local-sgd") if at("cnn", s, fast)]
    if distributed and at("cnn", "mpi-allreduce", fast):
        lines.append(f"The data-parallel strategies on one jax.distributed mesh run the CNN at {fast} in "
                     f"{span([r['ms_per_step'] for r in distributed], '.1f', ' ms')}, `mpi-allreduce` in "
                     f"{at('cnn', 'mpi-allreduce', fast)['ms_per_step']:.1f} ms.")
    return bullets(lines)


TABLES = {"network": network_report, "network-findings": network_findings}
