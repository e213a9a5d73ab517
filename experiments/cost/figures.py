"""The cost model's figures, drawn from the committed profile and results alone:

- cost_predicted.png: every covered committed point's predicted against measured ms/step;
- cost_ranking.png: in every sitting, each configuration's predicted rank against its measured
  rank, and each sitting's Kendall's tau;
- cost_scaling.png: predicted images/s and scaling efficiency from 1 to 1,024 devices for
  each strategy, on the seeds' CNN and on a stack-mlp too wide for one device (assumed H100s
  over an assumed link), with this machine's predicted and measured points on the same axes.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.cost import check as cost_check
from experiments.cost import ranking
from experiments.cost import pricing
from experiments.publish.plotting import legend_below, plain_log_axis, pyplot, save, strategy_style

# The extrapolation (docs/studies/cost.md names its assumptions).
WIDE = "stack-mlp-d16-w8192"   # 8.6 G parameters: 103 GB of f32 state with Adam
SEEDS_CNN = "cnn"
DEVICE, LINK = "h100", "100gbit"
PER_DEVICE_BATCH = 128           # weak scaling: the global batch grows with the devices
COUNTS = tuple(2 ** i for i in range(11))   # 1 ... 1,024
LOCAL_COUNTS = (1, 2, 4, 8)
SCALED = ("dp-shard-map", "fsdp", "tensor", "pipeline")
TENSOR_WITHIN = 8                # tensor parallelism inside one 8-device node, data across


def _data_dir(loaded: dict) -> Path:
    """The data folder: the profile's file is DATA/cost/profile.json."""
    return Path(loaded["files"][0]).parent.parent


def predicted_vs_measured(loaded: dict, out: Path) -> Path:
    """Every covered point's anchored prediction against its measurement (anchors left out)."""
    rows = [r for r in cost_check.check_rows(_data_dir(loaded)) if "error" in r and not r["anchor"]]
    studies = list(dict.fromkeys(r["study"] for r in rows))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    lo = min(min(r["measured_ms"], r["anchored_ms"]) for r in rows) / 1.5
    hi = max(max(r["measured_ms"], r["anchored_ms"]) for r in rows) * 1.5
    ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo * 1.25, hi * 1.25], color="#e9f5e9", label="within 25%")
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="predicted = measured")
    for i, study in enumerate(studies):
        here = [r for r in rows if r["study"] == study]
        ax.scatter([r["measured_ms"] for r in here], [r["anchored_ms"] for r in here], s=18,
                   color=f"C{i}", label=study, alpha=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms/step",
           ylabel="predicted ms/step (anchored to the study's single)")
    plain_log_axis(ax.xaxis), plain_log_axis(ax.yaxis)
    ax.set_title("Cost model: every covered committed point", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(fig, handles, labels, ncol=4, y=0.02)
    return save(fig, out / "cost_predicted.png")


def ranking_figure(loaded: dict, out: Path) -> Path:
    """Left: every ranked configuration's predicted rank against its measured rank in its
    sitting (0 fastest, 1 slowest); right: each sitting's Kendall's tau, by study."""
    groups = ranking.ranked_groups(cost_check.check_rows(_data_dir(loaded)))
    studies = list(dict.fromkeys(g["study"] for g in groups))
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.0), gridspec_kw={"width_ratios": [1, 1.2]})
    for i, g in enumerate(groups):
        predicted = ranking.ranks_of([p for _, p, _ in g["points"]])
        measured = ranking.ranks_of([m for _, _, m in g["points"]])
        jitter = [0.012 * ((i * 7 + k * 3) % 5 - 2) for k in range(len(predicted))]
        left.scatter([m + j for m, j in zip(measured, jitter)], predicted, s=14, alpha=0.6,
                     color=f"C{studies.index(g['study'])}")
    left.plot([0, 1], [0, 1], color="k", lw=0.8)
    left.set(xlabel="measured rank in its sitting (0 fastest)", ylabel="predicted rank (anchored)",
             xlim=(-0.05, 1.05), ylim=(-0.05, 1.05))
    left.set_title("each configuration, in its sitting", fontsize=10)
    for k, study in enumerate(studies):
        taus = [g["tau"] for g in groups if g["study"] == study and g["tau"] is not None]
        right.scatter(taus, [k] * len(taus), color=f"C{k}", s=26, label=study)
        missed = [g["tau"] for g in groups if g["study"] == study and g["tau"] is not None and not g["hit"]]
        right.scatter(missed, [k] * len(missed), facecolors="none", edgecolors="k", s=70)
    summary = ranking.rank_summary(groups)
    right.axvline(summary["tau_median"], color="k", ls=":", lw=1, label=f"median {summary['tau_median']:.2f}")
    right.set_yticks(range(len(studies)), studies, fontsize=8)
    right.set(xlabel="Kendall's tau, predicted against measured order", xlim=(-1.05, 1.05))
    right.set_title(f"each sitting; ringed: its pick missed ({summary['hits']} of {summary['groups']} hit)",
                    fontsize=10)
    right.grid(alpha=0.3, axis="x")
    handles, labels = right.get_legend_handles_labels()
    legend_below(fig, handles, labels, ncol=5, y=0.02)
    return save(fig, out / "cost_ranking.png")


def _axes(strategy: str, n: int, layers: int) -> tuple[str, dict]:
    """The mesh the extrapolation gives `strategy` on `n` devices, as a --mesh string."""
    if strategy == "tensor":
        t = min(n, TENSOR_WITHIN)
        return f"data={n // t},tensor={t}", {}
    if strategy == "pipeline":
        axes, _ = pricing.mesh_axes(strategy, n, "", layers)
        s = axes.get("stage", n)
        return "", {"microbatches": 2 * s}
    return "", {}


def scaling_series(profile: dict, key: str, device: str, link: str, counts) -> dict:
    """{strategy: [(devices, images/s, fits in the device's memory), ...]} under weak scaling."""
    compute = pricing.compute_source(profile, device)(key)
    series = {}
    for name in ("single", *SCALED):
        points = []
        for n in counts if name != "single" else (1,):
            mesh, options = _axes(name, n, len(compute.layers))
            try:
                pred = pricing.predict_one(profile, key, name, n, PER_DEVICE_BATCH * n, device, link,
                                              None, mesh, **options)
            except Exception:  # noqa: BLE001  a mesh the model cannot take: no point
                continue
            mem = pricing.machine(profile, device, link, None).memory_bytes
            points.append((n, pred.images_per_s, mem is None or pred.memory_bytes <= mem))
        series[name] = points
    return series


def _measured_weak(data_dir: Path, model: str) -> tuple[dict, float]:
    """This machine's weak-scaling device points of `model`: {strategy: [(devices, images/s)]},
    and their group's anchor scale (measured / predicted `single`)."""
    found: dict = {}
    scale = 1.0
    for r in cost_check.check_rows(data_dir):
        if r["study"] == "scaling" and r["point"].startswith("scaling/weak/") and r["model"] == model:
            batch = PER_DEVICE_BATCH * r["devices"]
            found.setdefault(r["strategy"], []).append((r["devices"], 1000 * batch / r["measured_ms"]))
            scale = r.get("scale", scale)
    return found, scale


def scaling_extrapolated(loaded: dict, out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.2))
    style = strategy_style(["single", *SCALED])
    measured, scale = _measured_weak(_data_dir(loaded), SEEDS_CNN)
    profile = pricing.load_profile(str(loaded["files"][0]))
    for row, key in enumerate((SEEDS_CNN, WIDE)):
        series = scaling_series(profile, key, DEVICE, LINK, COUNTS)
        base = series["single"][0][1]
        local = scaling_series(profile, key, pricing.PROFILED, "measured", LOCAL_COUNTS) if key == SEEDS_CNN else {}
        for name, points in series.items():
            st = style[name]
            for col, value in enumerate((lambda n, ips: ips, lambda n, ips: ips / (n * base))):
                ax = axes[row][col]
                xs = [n for n, _, _ in points]
                ax.plot(xs, [value(n, ips) for n, ips, _ in points], color=st["color"], ls="-", lw=1.2,
                        label=f"{name} ({DEVICE}, {LINK})")
                ax.scatter([n for n, _, f in points if not f], [value(n, ips) for n, ips, f in points if not f],
                           facecolors="none", edgecolors=st["color"], s=30)
                if name in local:  # anchored like the check: ms x scale, so images/s / scale
                    lb = local["single"][0][1]
                    lv = [ips / scale if col == 0 else ips / (n * lb) for n, ips, _ in local[name]]
                    ax.plot([n for n, _, _ in local[name]], lv, color=st["color"], ls=":", lw=1.2,
                            label=f"{name} (this CPU, predicted, anchored)")
                if name in measured and key == SEEDS_CNN:
                    lb = measured.get("single", [(1, 1.0)])[0][1]
                    pts = sorted(measured[name])
                    ax.scatter([n for n, _ in pts], [ips if col == 0 else ips / (n * lb) for n, ips in pts],
                               color=st["color"], marker="x", s=30, label=f"{name} (this CPU, measured)")
        axes[row][0].set(yscale="log", ylabel=f"{key}: images/s")
        axes[row][1].set(ylabel=f"{key}: scaling efficiency", ylim=(0, 1.3))
        for ax in axes[row]:
            ax.set(xscale="log", xlabel="devices")
            ax.set_xticks(COUNTS, [f"{n:,}" for n in COUNTS], fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].set_title(f"weak scaling, {PER_DEVICE_BATCH} images per device", fontsize=10)
    axes[1][0].set_title(f"{WIDE}: hollow = does not fit one {DEVICE}'s memory", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    legend_below(fig, handles, labels, ncol=3, y=0.02)
    return save(fig, out / "cost_scaling.png")


FIGURES = (("cost", (("cost_predicted.png", predicted_vs_measured), ("cost_ranking.png", ranking_figure),
                     ("cost_scaling.png", scaling_extrapolated))),)
