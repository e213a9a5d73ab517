"""Time-to-accuracy study: wall time, steps and images/s to a target *validation* accuracy for
the MLP, the CNN and the ResNet under each strategy, test accuracy measured at the end.

One `python -m experiments train --target-accuracy T` process per (model, strategy) point (its
device count is fixed before JAX starts), all with the same global batch, seed and validation
split, so the data-parallel strategies follow single's trajectory and differ only in time.

    python -m experiments time-to-accuracy --out figures/data/time_to_accuracy  # minutes, see below
    python -m experiments time-to-accuracy --quick --out /tmp/tta                  # seconds

Writes OUT/<model>-<strategy>/result.json per point (a stopped study resumes: complete points
are not run again), OUT/time_to_accuracy.json (rows, config, env) and OUT/summary.md.
Time to target counts training steps only: compilation (reported apart) and validation are
left out. The learning rate is constant (Adam), so the budget (--max-epochs) caps a run
without changing its trajectory. ResNet's batch norm under the shard_map strategies
(dp-shard-map, fsdp) normalises with per-shard batch statistics, so its trajectory can differ
from single's (dp-auto, one global-batch program, normalises over the whole batch like single).

The full run took 6 min on a 2-core machine with nothing else running; most of it is the CNN
and ResNet points (process start, data, compilation and 75 steps each).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.points import run_point
from jaxpar import results
from experiments.points import pending
from jaxpar.config import ConfigError

RESULTS_FILE = "time_to_accuracy.json"
# Strategies that train on the same global batch as single (same trajectory, up to
# reduction order and batch-norm statistics); local-sgd and model parallelism are other studies.
CHOICES = ("single", "dp-pmap", "dp-shard-map", "dp-auto", "fsdp")
DEFAULT_STRATEGIES = ("single", "dp-shard-map", "dp-auto", "fsdp")
DEFAULT_MODELS = ("mlp", "cnn", "resnet")
# Strategies whose step runs per shard (shard_map, pmap): batch norm there normalises with each
# shard's own batch statistics. dp-auto is one global-batch program, like single.
PER_SHARD_BATCH_NORM = ("dp-pmap", "dp-shard-map", "fsdp")
# Validation accuracies each model reaches within a few hundred steps at batch 128 (Adam 1e-3,
# constant), so the full study takes minutes on a 2-core CPU: MLP at step 175, CNN and ResNet
# (the slowest step by far) at step 75, every strategy.
DEFAULT_TARGETS = {"mlp": 0.84, "cnn": 0.82, "resnet": 0.70}
POINT_TIMEOUT_S = 1200  # one train process, even one that never reaches its target
QUICK_TIMEOUT_S = 120
# --quick: a small MLP on the synthetic set, single against one data-parallel strategy.
QUICK = {"models": ("mlp",), "strategies": ("single", "dp-shard-map"), "targets": {"mlp": 0.9},
         "flags": ["--dataset", "synthetic", "--synthetic-size", "3000", "--width", "64", "--depth", "1"],
         "val_size": 500, "batch_size": 50, "eval_every": 2, "max_epochs": 1}


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/time-to-accuracy",
                   help="output folder (default: results/time-to-accuracy)")
    p.add_argument("--quick", action="store_true",
                   help="small MLP on synthetic data, single and dp-shard-map (seconds)")
    p.add_argument("--models", default=None,
                   help=f"comma-separated (default: {','.join(DEFAULT_MODELS)})")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated, of {','.join(CHOICES)} (default: {','.join(DEFAULT_STRATEGIES)})")
    p.add_argument("--devices", type=int, default=2,
                   help="simulated devices of the data-parallel points; single uses 1 (default: 2)")
    p.add_argument("--targets", default="",
                   help="validation accuracy to reach per model, model=acc,... (default: "
                        f"{','.join(f'{m}={a}' for m, a in DEFAULT_TARGETS.items())})")
    p.add_argument("--batch-size", type=int, default=128, help="global batch, every strategy (default: 128)")
    p.add_argument("--max-epochs", type=int, default=2,
                   help="budget per point; a point that runs out is reported as not reached (default: 2)")
    p.add_argument("--eval-every", type=int, default=25,
                   help="validate every N steps: the resolution of steps to target (default: 25)")
    p.add_argument("--val-size", type=int, default=2000,
                   help="validation examples carved (seeded) from train (default: 2000)")
    p.add_argument("--seed", type=int, default=0, help="seeds parameters, split and data order (default: 0)")


@dataclass(frozen=True)
class Point:
    model: str
    strategy: str
    devices: int
    target: float

    def folder(self) -> str:
        return f"{self.model}-{self.strategy}"


def _names(flag: str, text: str | None, default: tuple[str, ...], choices: tuple[str, ...]) -> list[str]:
    names = [n for n in (text.split(",") if text else default) if n]
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise ConfigError(f"{flag} {text!r}: unknown {', '.join(bad) or '(none given)'}; "
                          f"choices: {', '.join(choices)}")
    return names


def _targets(text: str, base: dict[str, float]) -> dict[str, float]:
    targets = dict(base)
    for item in filter(None, text.split(",")):
        model, _, value = item.partition("=")
        try:
            targets[model.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--targets takes model=accuracy pairs, e.g. mlp=0.84,cnn=0.82; "
                              f"got {item!r}") from None
    bad = {m: a for m, a in targets.items() if not 0 < a <= 1}
    if bad:
        raise ConfigError(f"--targets are validation accuracies in (0, 1]; got {bad}")
    return targets


def plan(args: argparse.Namespace) -> tuple[list[Point], list[str]]:
    """The study's points and the train flags they share; checks every flag before any work."""
    from jaxpar.models import MODELS

    models = _names("--models", args.models, QUICK["models"] if args.quick else DEFAULT_MODELS, tuple(MODELS))
    strategies = _names("--strategies", args.strategies,
                        QUICK["strategies"] if args.quick else DEFAULT_STRATEGIES, CHOICES)
    targets = _targets(args.targets, QUICK["targets"] if args.quick else DEFAULT_TARGETS)
    missing = [m for m in models if m not in targets]
    if missing:
        raise ConfigError(f"no target accuracy for {', '.join(missing)}; add it to --targets, "
                          f"e.g. --targets {missing[0]}=0.8")
    extra: list[str] = []
    if args.quick:
        extra = list(QUICK["flags"])
        for key in ("val_size", "batch_size", "eval_every", "max_epochs"):
            setattr(args, key, QUICK[key])
    if args.devices < 2 and any(s != "single" for s in strategies):
        raise ConfigError(f"--devices {args.devices}: the data-parallel points need at least 2")
    for flag in ("batch_size", "max_epochs", "eval_every", "val_size"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    shared = [*extra, "--batch-size", str(args.batch_size), "--epochs", str(args.max_epochs),
              "--val-size", str(args.val_size), "--eval-every", str(args.eval_every),
              "--seed", str(args.seed), "--lr-schedule", "constant", "--no-progress"]
    points = [Point(m, s, 1 if s == "single" else args.devices, targets[m])
              for m in models for s in strategies]
    return points, shared


def train_command(point: Point, shared: list[str]) -> list[str]:
    return [sys.executable, "-m", "experiments", "train", "--model", point.model, "--strategy",
            point.strategy, "--devices", str(point.devices), "--target-accuracy", str(point.target),
            *shared]


def row(point: Point, result: results.RunResult) -> dict:
    """One table row from a point's train result; its validation curve for the figure."""
    m = result.metrics
    return {"model": point.model, "strategy": point.strategy, "devices": point.devices,
            "target": point.target, "reached": m["reached_target"], "steps": m["steps_to_target"],
            "examples": m["examples_to_target"], "time_s": m["time_to_target_s"],
            "images_per_sec": m["images_per_sec_to_target"],
            "images_per_sec_median_step": m["images_per_sec"], "compile_s": m["compile_s"],
            "steps_run": m["steps"], "test_accuracy": m["test_accuracy"],
            "val_accuracy": m["val_accuracy"], "wall_s": m["wall_s"],
            "batch_norm_per_shard": point.model == "resnet" and point.strategy in PER_SHARD_BATCH_NORM,
            "curve": [{k: h[k] for k in ("step", "val_accuracy", "train_s")} for h in result.history]}


def run(args: argparse.Namespace) -> list[Path]:
    points, shared = plan(args)
    out = results.ensure_writable(args.out)  # fail before the work, not after it
    todo = pending(points, lambda p: out / p.folder() / results.RESULT_FILE)
    if len(todo) < len(points):
        print(f"{len(points) - len(todo)} of {len(points)} points already done in {out}; running the rest")
    timeout = QUICK_TIMEOUT_S if args.quick else POINT_TIMEOUT_S
    for point in todo:
        print(f"{point.model:6} {point.strategy:13} devices={point.devices} target={point.target}",
              flush=True)
        run_point([*train_command(point, shared), "--out", str(out / point.folder())], timeout)
    loaded = [(p, results.load(out / p.folder())) for p in points]
    rows = [row(p, r) for p, r in loaded]
    config = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    config.update(models=list(dict.fromkeys(p.model for p in points)),
                  strategies=list(dict.fromkeys(p.strategy for p in points)),
                  targets={p.model: p.target for p in points}, train_flags=shared)
    study = results.RunResult(kind="time-to-accuracy", config=config, env=loaded[0][1].env,
                              metrics={"rows": rows})
    path = results.write_atomic(out / RESULTS_FILE, study.to_json() + "\n")
    table = summary(rows, study.env, config)
    results.write_atomic(out / "summary.md", table)
    print(table)
    return [path, out / "summary.md"]


def summary(rows: list[dict], env: dict, config: dict) -> str:
    """Markdown table of the study's rows and what stands behind the times."""
    lines = ["| model | strategy | devices | target (val) | reached | steps | examples | time s | "
             "images/s | compile s | test accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " †" if r["batch_norm_per_shard"] else ""
        if r["reached"]:
            cells = f"yes | {r['steps']} | {r['examples']:,} | {r['time_s']:.1f} | {r['images_per_sec']:,.0f}"
        else:
            cells = f"no ({r['steps_run']} steps) | – | – | – | –"
        lines.append(f"| {r['model']} | {r['strategy']}{mark} | {r['devices']} | {r['target']:.2f} | "
                     f"{cells} | {r['compile_s']:.1f} | {r['test_accuracy']:.4f} |")
    notes = [
        f"Global batch {config['batch_size']}, seed {config['seed']}, Adam at a constant learning rate, "
        f"validation on {config['val_size']} examples every {config['eval_every']} steps (steps to target "
        f"are multiples of it), budget {config['max_epochs']} epochs per point; one process per point.",
        "time s: training steps up to the validation that reached the target, compilation (compile s) "
        "and validation excluded; images/s = examples / time s.",
        f"{env.get('cpu_cores', '?')} CPU cores ({env.get('cores_available', '?')} available) shared by all "
        f"simulated devices of a point; XLA threads: {env.get('threads', '?')}; jax {env.get('jax', '?')}, "
        f"{env.get('device_kind', '?')}.",
    ]
    if any(r["batch_norm_per_shard"] for r in rows):
        notes.append("† ResNet's batch norm normalises with per-shard batch statistics under this strategy "
                     "(dp-auto and single use the whole global batch), so its trajectory can differ from "
                     "single's.")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
