"""The peers study's figure (peers.png): images/s of every configuration, jaxpar beside
PyTorch, one panel per model (and the model-parallel section's), from its peers.json.

    python -m experiments figures --data figures/data --out figures
"""

from __future__ import annotations

from pathlib import Path

from experiments.publish.plotting import pyplot, save


PEER_COLOURS = {"jaxpar": "tab:blue", "pytorch": "tab:orange"}


def peers_bars(data: dict, out: Path) -> Path:
    """One panel per model: images/s of every configuration, jaxpar beside PyTorch, each
    jaxpar bar labelled with its ratio to its PyTorch peer.

    Args:
        data: the peers.json dict written by experiments/peers/study.py.
        out: folder for peers.png.
    Returns:
        the PNG path.
    """
    plt = pyplot()
    rows, env, cfg = data["metrics"]["rows"], data["env"], data["config"]
    panels = {model: [r for r in rows if r["model"] == model] for model in dict.fromkeys(r["model"] for r in rows)}
    rounds = dict.fromkeys(panels, cfg["rounds"])  # each section runs rounds of its own
    mp = data["metrics"].get("model_parallel")
    if mp and mp["rows"]:  # the model-parallel section, a panel of its own
        title = f"{mp['config']['mp_model']}, model parallelism"
        panels[title], rounds[title] = mp["rows"], mp["config"]["rounds"]
    tallest = max((len(p) for p in panels.values()), default=1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.0 + 0.45 * tallest * len(panels)), squeeze=False)
    for ax, (model, panel) in zip(axes[:, 0], panels.items()):
        mine = panel[::-1]  # first configuration on top
        ips = [r["images_per_sec"] for r in mine]
        ax.barh(range(len(mine)), ips, color=[PEER_COLOURS[r["framework"]] for r in mine])
        ax.set_yticks(range(len(mine)), [
            f"{r['framework']}: {r['what']} ({r['processes']} proc x {r['threads_per_process']} thr)"
            for r in mine], fontsize=8)
        for i, r in enumerate(mine):
            note = f"{r['images_per_sec']:,.0f}"
            if r["ratio_vs_peer"] is not None:
                note += f"  ({r['ratio_vs_peer']:.2f}x {r['peer'].removeprefix('torch-')})"
            ax.text(r["images_per_sec"], i, " " + note, va="center", fontsize=8)
        ax.set_xlim(0, max(ips) * 1.45)
        ax.set_title(f"{model}: images/s, median of {rounds[model]} interleaved rounds "
                     "(jaxpar / PyTorch peer in brackets)", fontsize=10)
    axes[-1, 0].set_xlabel(f"images/s, global batch {cfg['batch_size']}; {env['cpu_cores']} CPU cores, "
                           f"jax {env['jax']}, torch {env.get('torch')}")
    fig.tight_layout()
    return save(fig, out / "peers.png")


FIGURES = (("peers", (("peers.png", peers_bars),)),)
