"""Every generated table of README.md and docs/ by name, each a function of the committed results
(or, for the strategy list, of the strategy classes), written by `python -m experiments report`:
each study's `TABLES` (its tables module), the cost model's, and those of no one study here
(the strategy list, the main results, the line naming where each study's results were
measured).

    TABLES["scaling-devices"](Path("figures/data"))   # -> a markdown table
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from experiments.cost import tables as cost_tables
from experiments.peers import tables as peers_tables
from experiments.publish import sources
from experiments.points import points
from experiments.publish.markdown import DASH, bullets, markdown, num, percent, span, times
from experiments.publish.measured_on import machine_line, machine_words
from experiments.studies import batch_size, bounds
from experiments.studies.hparam import tables as hparam_tables
from experiments.studies.machine import tables as machine_tables
from experiments.studies.faults import tables as faults_tables
from experiments.studies.network import tables as network_tables
from experiments.studies.pipeline import tables as pipeline_tables
from experiments.studies.scaling import speedup
from experiments.studies.scaling import tables as scaling_tables
from experiments.studies.strategies import tables as strategies_tables
from experiments.studies.time_to_accuracy import tables as time_to_accuracy_tables
from jaxpar import results
from jaxpar.config import TrainConfig, to_dict
from jaxpar.mesh import format_mesh
from jaxpar.parallel import STRATEGIES


def strategy_list(_: Path) -> str:
    """Every registered strategy: family, what it does, models, default mesh, processes."""
    rows = []
    for name, cls in STRATEGIES.items():
        mesh = format_mesh(cls.default_axes).replace("-1", "all")
        across = "MPI ranks (mpi4jax)" if cls.uses_mpi else "jax.distributed" if cls.multiprocess else DASH
        models = ", ".join(f"`{m}`" for m in cls.models) if cls.models else "any"
        rows.append([f"`{name}`", cls.family, cls.summary, models, f"`{mesh}`", across])
    return markdown(["strategy", "family", "what it does", "models", "default mesh",
                     "across processes"], rows)


def _make_args(config: dict) -> str:
    """`make run` with the options that differ from the defaults, as ARGS."""
    default = to_dict(TrainConfig())
    args = []
    for section in ("model", "data", "optim"):
        for k, v in config[section].items():
            if k in default[section] and v != default[section][k] and k not in ("cache_dir", "data_dir"):
                args.append(f"--{k.replace('_', '-')} {v}")
    return "`make run" + (f" ARGS=\"{' '.join(args)}\"`" if args else "`")


def main_results(data_dir: Path) -> str:
    """The default run and its MLP variant: accuracy, time, step, machine."""
    rows = []
    for name in ("train-cnn", "train-mlp"):
        r = sources.load_source(data_dir, name)
        m, c, env = r["metrics"], r["config"], r["env"]
        rows.append([f"{c['model']['model']}", _make_args(c), f"**{100 * m['test_accuracy']:.2f}%**",
                     num(m["epochs"]), f"{m['wall_s']:,.0f} s", f"{m['step_time_ms_median']:.1f} ms",
                     num(m["images_per_sec"]), machine_words(env)])
    return markdown(["model", "command", "test accuracy", "epochs", "wall time", "median step",
                     "images/s", "machine"], rows)


def model_parallelism_headline(data_dir: Path) -> str:
    """The README's paragraph: the model-parallel strategies over ranks against one rank (the
    rank study) and against PyTorch's (the peers study), and the bounds study's verdict."""
    ranks = speedup.rank_rows(sources.load_source(data_dir, "scaling")["points"])
    on_two = {r["strategy"]: r for r in ranks if (r["model"], r["mode"], r["ranks"]) == ("cnn", "strong", 2)}
    mp = {r["config"]: r for r in sources.load_source(data_dir, "peers")["metrics"]["model_parallel"]["rows"]}
    peer = lambda kind: span([r["ratio_vs_peer"] for k, r in mp.items() if k.startswith(kind)], ".2f", "x")  # noqa: E731
    bounds = sources.load_source(data_dir, "bounds")["metrics"]["rows"]
    return (f"On 2 single-threaded ranks, one stage each, `mpi-pipeline` runs {times(on_two['mpi-pipeline']['speedup'])} "
            f"one rank and `pipeline` over jax.distributed {times(on_two['pipeline']['speedup'])}; `tensor` "
            f"{times(on_two['tensor']['speedup'])} on the CNN (the rank study). Against PyTorch on "
            f"the same ranks: `mpi-pipeline` {peer('jaxpar-mpi-pipeline')} its pipelining, `pipeline` "
            f"{peer('jaxpar-pipeline-ranks')}, `tensor` {peer('jaxpar-tensor')} DTensor (the peers study). On "
            f"simulated devices against `single` (the bounds study): {bounds_verdict(bounds)}.")


def bounds_verdict(rows: list[dict]) -> str:
    """Which strategies the bounds study found within their limits, naming the misses with
    their steps, and when more than a third miss, how many and which are within."""
    judged = [r for r in rows if r["met"] is not None]
    missed = [r for r in judged if r["met"] is False]
    if not missed:
        return "every strategy within its limit"
    misses = [f"{r['label']} on {r['devices']} ({times(r['ratio'])} against {r['limit']}x)" for r in missed]
    if 3 * len(missed) <= len(judged):
        return "every strategy within its limit but " + ", ".join(misses)
    met = [f"{r['label']} on {r['devices']}" for r in judged if r["met"]]
    return f"{len(missed)} of {len(judged)} over their limits: {', '.join(misses)}; within: {', '.join(met) or 'none'}"


def _described(data_dir: Path, folder: str) -> dict:
    """The strategy record of a committed point's first round (what every round records alike)."""
    return results.load(points.round_files(Path(data_dir) / folder)[0]).strategy


def cnn_cuts(data_dir: Path) -> str:
    """The CNN's two pipeline cuts (between whole layers, inside conv2): each stage's share of
    the training FLOPs and the bound it sets, from the points that ran them."""
    lines = []
    for study, folder in (("the bounds study's pipelines", "bounds/points/2/pipeline-gpipe"),
                          ("the rank study's pipelines", "scaling/ranks/strong/cnn-mpi-pipeline-r2")):
        d = _described(data_dir, folder)
        flops = d["stage_flops_per_example"]
        stages = " | ".join(", ".join(s) for s in d["stage_layers"])
        where = f"inside {d['cut_inside']}" if d.get("cut_inside") else "between whole layers"
        lines.append(f"Cut {where} ({stages}; {study}): the stages run "
                     + " | ".join(percent(f / sum(flops)) for f in flops) + " of the training FLOPs, a bound of "
                     f"{times(d['speedup_bound'])} one worker at M = {d['microbatches']}.")
    return bullets(lines)


def demo_models(data_dir: Path) -> str:
    """The demo's committed models: what each is, its test accuracy, the size of its folder;
    and the README's run beside the CNN's."""
    lines = []
    for folder in sorted((Path(data_dir) / "demo").iterdir()):
        r = results.load(folder)
        model, optim, m = r.config["model"], r.config["optim"], r.metrics
        shape = "".join(f" {k} {model[k]}" for k in ("width", "depth") if model.get(k))
        momentum = optim.get("momentum") if optim["optimizer"] == "sgd" else None
        how = optim["optimizer"] + (f" (momentum {momentum:g})" if momentum else "")
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        lines.append(f"`figures/data/demo/{folder.name}` ({size / 1e6:.1f} MB): {model['model']}{shape}, {how}, "
                     f"{m['steps']:,} steps: {100 * m['test_accuracy']:.2f}% test accuracy, test loss "
                     f"{m['test_loss']:.4f}.")
    readme = sources.load_source(data_dir, "train-cnn")["metrics"]
    lines.append(f"The README's run (`figures/data/train/cnn.json`, the same recipe): "
                 f"{100 * readme['test_accuracy']:.2f}% test accuracy, test loss {readme['test_loss']:.4f}.")
    return bullets(lines)


TABLES: dict[str, Callable[[Path], str]] = {
    "strategy-list": strategy_list,
    "main-results": main_results,
    "model-parallelism-headline": model_parallelism_headline,
    "cnn-cuts": cnn_cuts,
    "demo-models": demo_models,
    **scaling_tables.TABLES,
    **strategies_tables.TABLES,
    **pipeline_tables.TABLES,
    **bounds.TABLES,
    **batch_size.TABLES,
    **time_to_accuracy_tables.TABLES,
    **hparam_tables.TABLES,
    **peers_tables.TABLES,
    **cost_tables.TABLES,
    **network_tables.TABLES,
    **faults_tables.TABLES,
    **machine_tables.TABLES,
    # One line per results folder (the two training runs share theirs; each machine's row
    # names its own).
    **{f"machine-{name.removesuffix('-cnn')}": functools.partial(machine_line, name)
       for name in sources.SOURCES if name not in ("train-mlp", "machines")},
}
