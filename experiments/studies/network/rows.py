"""The network study's numbers from its bench results: rows, wire bytes beside theory, the
compute / exposed-communication split, and the crossovers its figure names.

    metrics = analyse([(point, result), ...])   # {'rows', 'references', 'crossovers'}

Bytes on the wire are host 0's `eth0` counters over the timed steps (bench's `wire`), per
step, headers aside: each counted packet's Ethernet + IPv4 + TCP-with-timestamps headers
(66 bytes; a veth counts a GSO super-packet once, with one set of headers, so this is the
payload the sockets moved) are subtracted. With 2 hosts, what host 0 sends is what host 1
receives and back, so 'sent' and 'received' are the two directions of the one link and the
busier one is compared with the theory's busiest rank.

The split: a strategy's compute is its own step at unlimited bandwidth (the same ranks and
schedule, the messages crossing the network stack at memory speed); its exposed
communication at a bandwidth is its step there minus that. 'Link time' is the theory's bytes
at the link's rate: exposed communication below it means the strategy overlaps its sends with
compute (or its theory overstates), above it means latency-bound messages or idle stages.
"""

from __future__ import annotations

import math
from typing import Any

from experiments.infra.cluster import rate_bits

HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps (as tests/mpi/test_wire_bytes.py)
UNLIMITED = "unlimited"
# What crosses the link: activations (and their gradients) between stages or shards, or the
# model's gradients / parameters. The crossover the figure names is between these two.
SENDS_ACTIVATIONS = ("mpi-pipeline", "pipeline", "layer-split", "tensor", "tensor-auto", "hybrid", "gems")


def sends(strategy: str) -> str:
    return "activations" if strategy in SENDS_ACTIVATIONS else "gradients"


def theory_wire(theory: dict, processes: int, implementation: str | None) -> tuple[int | None, str]:
    """Bytes per step the busier direction of a rank's link carries by the strategy's theory,
    and how they follow from it. Collective operand bytes (each strategy's `theory()`) become bytes sent
    by the usual algorithms over N processes: all-reduce (ring) 2(N-1)/N of its operand,
    reduce-scatter (N-1)/N of its whole operand, all-gather (N-1) shards, collective-permute
    its operand; a host-driven (mpmd) pipeline's permutes count both directions of a boundary."""
    n = processes
    if "busiest_rank_sent" in theory:
        return max(theory["busiest_rank_sent"], theory["busiest_rank_received"]), "busiest rank (strategy's own)"
    if "ring_bytes_per_device" in theory:
        return theory["ring_bytes_per_device"], "ring all-reduce of the gradient"
    factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-gather": n - 1,
              "collective-permute": 0.5 if implementation == "mpmd" else 1.0}
    ops = {k: v for k, v in theory.items() if k != "total"}
    if not ops and theory.get("total") is not None:  # one number: all-reduced activations
        ops = {"all-reduce": theory["total"]}
    if not ops or any(k not in factor for k in ops):
        return None, "no model of the bytes sent"
    return int(sum(factor[k] * v for k, v in ops.items())), "collectives' operands, by algorithm"


def _per_step(wire: dict, direction: str) -> float:
    payload = wire[f"{direction}_bytes"] - HEADER_BYTES * wire[f"{direction}_packets"]
    return payload / wire["steps"]


def link_row(point, result) -> dict[str, Any]:
    """One point's row: link, step, images/s, wire bytes per step and theory."""
    m, labels = result.metrics, point.labels
    strategy = point.config.parallel.strategy
    wire = m.get("wire")
    theory, rule = theory_wire(m.get("collective_bytes_theory") or {}, labels.get("hosts", 1),
                               result.strategy.get("implementation"))
    sent = None if wire is None else _per_step(wire, "tx")
    received = None if wire is None else _per_step(wire, "rx")
    return {"model": point.config.model.model, "strategy": strategy, "sends": sends(strategy),
            "bandwidth": labels.get("bandwidth"), "rate_bits_per_s": labels.get("rate_bits_per_s"),
            "hosts": labels.get("hosts", 1), "ms_per_step": m["step_time_ms_median"],
            "ms_per_step_min": m["step_time_ms_min"], "images_per_sec": m["images_per_sec"],
            "wire_sent_per_step": sent, "wire_received_per_step": received,
            "wire_busier_per_step": None if wire is None else max(sent, received),
            "wire_with_headers_per_step": None if wire is None else
            max(wire["tx_bytes"], wire["rx_bytes"]) / wire["steps"],
            "theory_wire_per_step": theory, "theory_rule": rule,
            "collective_bytes_theory": (m.get("collective_bytes_theory") or {}).get("total"),
            "point": point.folder}


def analyse(done: list) -> dict[str, Any]:
    """{'rows': one per multi-host point with vs_one_host, compute_ms, exposed_comm_ms and
    link_ms; 'references': one per model; 'crossovers': per model (see `crossovers`)}."""
    all_rows = [link_row(p, r) for p, r in done]
    refs = {r["model"]: r for r in all_rows if r["bandwidth"] is None}
    rows = [r for r in all_rows if r["bandwidth"] is not None]
    compute = {(r["model"], r["strategy"]): r["ms_per_step"] for r in rows if r["bandwidth"] == UNLIMITED}
    for r in rows:
        ref, base = refs.get(r["model"]), compute.get((r["model"], r["strategy"]))
        r["vs_one_host"] = None if ref is None else r["images_per_sec"] / ref["images_per_sec"]
        r["compute_ms"] = base
        r["exposed_comm_ms"] = None if base is None else r["ms_per_step"] - base
        rate, theory = r["rate_bits_per_s"], r["theory_wire_per_step"]
        r["link_ms"] = None if rate is None or theory is None else 1000 * 8 * theory / rate
    return {"rows": rows, "references": list(refs.values()),
            "crossovers": {model: crossovers(rows, refs.get(model), model)
                           for model in dict.fromkeys(r["model"] for r in rows)}}


def position(bandwidth: str, rates: list[int]) -> float:
    """Where a bandwidth sits on the figure's x axis (bits/s); unlimited 10x the fastest link."""
    if bandwidth == UNLIMITED:
        return 10.0 * max(rates, default=1e9)
    return float(rate_bits(bandwidth))


def _crossing(order: list[str], xs: list[float], diff: list[float]) -> list[dict]:
    """Where `diff` changes sign between two measured bandwidths: {'between': [lower, upper],
    'rate_bits_per_s': interpolated in log rate, or None where the upper one is unlimited,
    'x': where the lines cross on the figure's axis}."""
    found = []
    for i in range(len(xs) - 1):
        d0, d1 = diff[i], diff[i + 1]
        if (d0 > 0) == (d1 > 0):
            continue
        t = 0.5 if d0 == d1 else d0 / (d0 - d1)
        x = math.exp(math.log(xs[i]) + t * (math.log(xs[i + 1]) - math.log(xs[i])))
        found.append({"between": [order[i], order[i + 1]], "x": x,
                      "rate_bits_per_s": None if order[i + 1] == UNLIMITED else x})
    return found


def crossovers(rows: list[dict], ref: dict | None, model: str) -> dict[str, Any]:
    """For one model, over the measured bandwidths (ascending): the best strategy that sends
    activations and the best that sends gradients at each, the link rates (bits/s) where the
    one overtakes the other, and where the best of all overtakes one host."""
    here = [r for r in rows if r["model"] == model]
    finite = sorted({r["rate_bits_per_s"] for r in here if r["rate_bits_per_s"]})
    order = sorted({r["bandwidth"] for r in here}, key=lambda b: position(b, finite))
    best = {kind: [max((r for r in here if r["bandwidth"] == b and r["sends"] == kind),
                       key=lambda r: r["images_per_sec"], default=None) for b in order]
            for kind in ("activations", "gradients")}
    xs = [position(b, finite) for b in order]
    out: dict[str, Any] = {"bandwidths": order, "x": xs,
                           "best_activations": [r and r["strategy"] for r in best["activations"]],
                           "best_gradients": [r and r["strategy"] for r in best["gradients"]],
                           "activations_overtake_gradients_at": [], "one_host_overtaken_at": []}
    if all(best["activations"]) and all(best["gradients"]):
        # log ratios: interpolated linearly in log rate, where the figure's lines cross
        diff = [math.log(a["images_per_sec"] / g["images_per_sec"])
                for a, g in zip(best["activations"], best["gradients"])]
        out["activations_overtake_gradients_at"] = _crossing(order, xs, diff)
        out["activations_ahead"] = [d > 0 for d in diff]
    tops = [max((r for r in here if r["bandwidth"] == b), key=lambda r: r["images_per_sec"]) for b in order]
    if ref is not None and tops:
        diff = [math.log(t["images_per_sec"] / ref["images_per_sec"]) for t in tops]
        out["one_host_overtaken_at"] = _crossing(order, xs, diff)
        out["beats_one_host"] = [d > 0 for d in diff]
    return out


def crossing_words(c: dict) -> str:
    """'about 2.3 Gbit/s (between 1gbit and 10gbit)', or 'between 10gbit and unlimited'."""
    lo, hi = c["between"]
    bits = c["rate_bits_per_s"]
    if bits is None:
        return f"between {lo} and {hi}"
    about = f"{bits / 1e9:.2g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    return f"about {about} (between {lo} and {hi})"


def crossover_words(c: dict) -> list[str]:
    """The crossovers of one model in words, as the table's notes and the figure name them."""
    lines = []
    if "activations_ahead" in c:
        at = c["activations_overtake_gradients_at"]
        lead = "activations" if c["activations_ahead"][0] else "gradients"
        other = "gradients" if lead == "activations" else "activations"
        lines.append(f"sending {lead} is faster at {c['bandwidths'][0]}" + (
            f"; sending {other} overtakes it " + ", then ".join(crossing_words(x) for x in at) if at
            else f" and stays ahead up to {c['bandwidths'][-1]}"))
    if "beats_one_host" in c:
        at = c["one_host_overtaken_at"]
        if not any(c["beats_one_host"]):
            lines.append(f"one host is faster at every bandwidth, {c['bandwidths'][-1]} included")
        elif all(c["beats_one_host"]):
            lines.append(f"2 hosts beat one host at every bandwidth, {c['bandwidths'][0]} included")
        else:
            lines.append("the best of 2 hosts and one host change places "
                         + ", then ".join(crossing_words(x) for x in at))
    return lines
