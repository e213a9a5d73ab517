"""The training loop: batches -> strategy.step -> evaluation -> RunResult.

One loop for every strategy. It validates each epoch (or every `--eval-every` steps), tests
at the end, shows a rich progress bar and returns a `RunResult` for `results.save`.

    python -m experiments train --model cnn --epochs 3 --out results/run1
    python -m experiments train --model mlp --epochs 5 --eval-every 25 --target-accuracy 0.85

With `--target-accuracy` the run stops at the first validation whose accuracy reaches the
target; `time_to_target_s` is the training time up to that step: step time only, without
compilation (`compile_s`, reported apart) and without evaluation. It survives `--resume`.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxpar import checkpoint as ckptlib
from jaxpar import data as datalib
from jaxpar import measure
from jaxpar.config import ConfigError, TrainConfig, to_dict
from jaxpar.errors import ResultsError
from jaxpar.models import make_model
from jaxpar.optim import make_optimizer
from jaxpar.parallel import STRATEGIES
from jaxpar.results import RESULT_FILE, RunResult, environment
from jaxpar.step import summarize


def check_target(config: TrainConfig) -> None:
    """A --target-accuracy that can be reached: a fraction in (0, 1] and a validation split."""
    target = config.target_accuracy
    if target is None:
        return
    if not 0 < target <= 1:
        raise ConfigError(f"--target-accuracy is a fraction in (0, 1], e.g. 0.85; got {target}")
    if config.data.val_size == 0:
        raise ConfigError("--target-accuracy is checked on the validation split; set --val-size > 0 "
                          "(examples carved from train)")


def first_reaching(history: list[dict[str, Any]], target: float | None) -> dict[str, Any] | None:
    """The first validation record whose accuracy reaches `target` (None: none, or no target)."""
    if target is None:
        return None
    return next((h for h in history if h["val_accuracy"] >= target), None)


def make_strategy(config: TrainConfig):
    name = config.parallel.strategy
    if name not in STRATEGIES:
        raise ConfigError(f"unknown --strategy {name!r}; choices: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](config)


def build_model(config: TrainConfig):
    m = config.model
    return make_model(m.model, seed=config.seed, depth=m.depth, width=m.width,
                      activation=m.activation, batch_norm=m.batch_norm)


def evaluate(strategy, state, split, batch_size: int) -> dict[str, float]:
    """Loss and accuracy over a whole split (padding rows carry weight 0)."""
    totals: dict[str, float] = {}
    for batch in datalib.eval_batches(split, batch_size):
        sums = jax.device_get(strategy.eval_step(state, strategy.place_batch(batch)))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return summarize(totals)


def target_metrics(reached: dict[str, Any] | None, batch_size: int) -> dict[str, Any]:
    """What reaching --target-accuracy cost, from the first validation record that reached it.

    time_to_target_s: training time up to that validation, step time only (compilation and
    evaluation excluded; `compile_s` is reported apart); images/s to target divides by it."""
    if reached is None:
        return {"reached_target": False, "steps_to_target": None, "examples_to_target": None,
                "time_to_target_s": None, "images_per_sec_to_target": None}
    examples = reached["step"] * batch_size
    return {"reached_target": True, "steps_to_target": reached["step"], "examples_to_target": examples,
            "time_to_target_s": reached["train_s"],
            "images_per_sec_to_target": examples / reached["train_s"] if reached["train_s"] else None}


def log_event(config: TrainConfig, event: str, **fields: Any) -> None:
    """Append one JSON line to `--events` (nothing without it; rank 0 only): what a live view
    such as the demo follows instead of the progress bar.

    Args:
      event: "start" (compile time and the accounting, before the first step), "step" (each
        logged step), "validation" (each validation record) or "end" (metrics and the result
        path its caller writes next).
    """
    if not config.events or jax.process_index() != 0:
        return
    # Opened per record and flushed on close: a reader never waits on a buffer. The first
    # record ("start") comes before any training step, so a bad path costs no training.
    try:
        with open(config.events, "a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}, default=float) + "\n")
    except OSError as e:
        raise ResultsError(f"cannot append to --events {config.events!r} ({e.strerror or e}); pass "
                           "a file in a folder that exists and that you can write to") from e


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.3f}  "
                               "{task.fields[ips]:,.0f} img/s"),
                    TimeRemainingColumn(), disable=not enabled, transient=False)


@dataclass
class Outcome:
    result: RunResult
    strategy: Any   # the Strategy that ran, for `to_reference` and checkpoints
    state: Any      # its final TrainState (placed on devices)


def train(config: TrainConfig, console=None) -> RunResult:
    """Train `config` to the end and return its result (not yet written to disk)."""
    return fit(config, console).result


def fit(config: TrainConfig, console=None) -> Outcome:
    """Train `config` to the end; the result plus the final state and strategy.

    Args:
      config: the run; `config.parallel.devices` must already have been applied
        (`mesh.simulate_cpu_devices`) before JAX started.
      console: a rich Console for epoch lines (None: quiet).
    """
    wall_start = time.perf_counter()
    strategy = make_strategy(config)
    check_target(config)
    if config.resume and not config.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir (the folder the run saved to)")
    # Checks the folder before any work or write (bad --resume input overwrites nothing).
    ckpt = ckptlib.Checkpointer(config) if config.checkpoint_dir else None
    splits = datalib.load(config.data, config.seed)
    mesh = strategy.make_mesh(jax.devices())
    batch_size = config.data.batch_size
    per_epoch = datalib.steps_per_epoch(len(splits.train[1]), batch_size)
    total_steps = config.steps if config.steps is not None else config.epochs * per_epoch
    if total_steps < 1:
        raise ConfigError("--epochs and --steps must give at least one step")
    epochs = math.ceil(total_steps / per_epoch)
    tx = make_optimizer(config.optim, total_steps)
    state = strategy.init(build_model(config), tx, mesh)
    step, resumed_from, train_s = 0, None, 0.0
    running = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    history: list[dict[str, Any]] = []
    if ckpt is not None and config.resume:
        ref, saved = ckpt.restore(strategy.state_to_reference(state))
        state = strategy.state_from_reference(ref)
        step = resumed_from = saved["step"]
        running, history = saved["running"], saved["history"]
        train_s = saved.get("train_s", 0.0)  # time to target counts the steps before the stop
        if console is not None:
            console.print(f"resumed from step {step} ({ckpt.directory / str(step)})")

    first = strategy.place_batch(next(datalib.train_batches(splits.train, batch_size, config.seed, 0)))
    compiled, compile_s = strategy.compile("step", state, first)
    stats = measure.program_stats(compiled)
    accounting = strategy.accounting(stats, state)
    eval_bs = min(config.data.eval_batch_size, len(splits.test[1]))
    eval_example = strategy.place_batch(next(datalib.eval_batches(splits.test, eval_bs)))
    _, eval_compile_s = strategy.compile("eval_step", state, eval_example)
    del first, eval_example
    log_event(config, "start", step=step, total_steps=total_steps, batch_size=batch_size,
              compile_s=compile_s, eval_compile_s=eval_compile_s, strategy=strategy.describe(),
              **accounting)

    # One step in flight on CPU: XLA's in-process collectives deadlock when steps queue up
    # (DEVELOPERS.md); elsewhere wait only every few steps so the host runs ahead.
    sync_every = 1 if jax.default_backend() == "cpu" else 10
    step_times: list[float] = []
    last = {"loss": float("nan"), "accuracy": float("nan")}
    # A run resumed after it reached the target has nothing left to train.
    reached = first_reaching(history, config.target_accuracy)

    def validate(epoch: int) -> None:
        nonlocal reached
        if splits.val is None:
            return
        val = evaluate(strategy, state, splits.val, eval_bs)
        record = {"step": step, "epoch": epoch, "train_loss": last["loss"],
                  "train_accuracy": last["accuracy"], "val_loss": val["loss"],
                  "val_accuracy": val["accuracy"], "train_s": train_s}
        history.append(record)
        log_event(config, "validation", **record)
        if console is not None:
            console.print(f"epoch {epoch + 1:>3}  step {step:>6}  train loss {last['loss']:.4f}  "
                          f"val loss {val['loss']:.4f}  val acc {val['accuracy']:.4f}")
        reached = first_reaching([record], config.target_accuracy)
        if reached is not None and console is not None:
            console.print(f"target validation accuracy {config.target_accuracy} reached at step {step} "
                          f"({train_s:.1f} s of training)")

    def save():  # the data order is a function of (seed, epoch): the step fixes the position
        progress = {"epoch": step // per_epoch, "position": step % per_epoch,
                    "running": running, "history": history, "train_s": train_s}
        return ckpt.save(step, strategy.state_to_reference(state), progress)

    with _progress(config.progress and console is not None) as bar, (ckpt or contextlib.nullcontext()):
        task = bar.add_task("train", total=total_steps, completed=step, epoch=1, loss=float("nan"),
                            acc=0.0, ips=0.0)
        for epoch in range(step // per_epoch, epochs):
            if reached is not None:
                break
            start = step - epoch * per_epoch  # > 0 only in the epoch a resumed run stopped in
            for batch in datalib.train_batches(splits.train, batch_size, config.seed, epoch, start):
                if step >= total_steps:
                    break
                t0 = time.perf_counter()
                state, sums = strategy.step(state, strategy.place_batch(batch))
                step += 1
                evaluating = bool(config.eval_every) and step % config.eval_every == 0
                # Wait for the step before a validation, so train_s counts every step before it.
                if step % sync_every == 0 or step == total_steps or evaluating:
                    sums = jax.device_get(sums)
                    for k in running:
                        running[k] += float(sums[k])
                    dt = time.perf_counter() - t0
                    step_times.append(dt / (sync_every if sync_every > 1 else 1))
                    train_s += dt
                    last = summarize(running)
                    ips = batch_size / statistics.median(step_times[-50:])
                    bar.update(task, completed=step, epoch=epoch + 1, loss=last["loss"],
                               acc=last["accuracy"], ips=ips)
                    log_event(config, "step", step=step, epoch=epoch + 1, loss=last["loss"],
                              accuracy=last["accuracy"], images_per_sec=ips,
                              step_ms=1000 * batch_size / ips)
                if evaluating:
                    validate(epoch)
                if ckpt is not None and ckpt.signum is not None:  # SIGTERM / Ctrl-C
                    folder = save()
                    ckpt.close()
                    raise ckpt.interrupted(folder)
                if ckpt is not None and ckpt.due(step) and step % per_epoch:  # epoch ends: below
                    save()
                if step >= total_steps or reached is not None:
                    break
            if not config.eval_every and step > epoch * per_epoch + start and reached is None:
                validate(epoch)
            if step % per_epoch == 0:
                running = {k: 0.0 for k in running}
                if ckpt is not None and ckpt.due(step) and step < total_steps:
                    save()
            if step >= total_steps or reached is not None:
                break
    if ckpt is not None:
        if ckpt.last_saved != step:
            save()
        ckpt.close()  # waits for the asynchronous writes

    test = evaluate(strategy, state, splits.test, eval_bs)
    median_s = statistics.median(step_times) if step_times else float("nan")
    metrics = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "val_accuracy": history[-1]["val_accuracy"] if history else None,
        "val_loss": history[-1]["val_loss"] if history else None,
        "final_loss": last["loss"],
        "resumed_from_step": resumed_from,
        "steps": step,
        "epochs": step / per_epoch,
        "compile_s": compile_s,
        "eval_compile_s": eval_compile_s,
        "step_time_ms_median": 1000 * median_s,
        "images_per_sec": batch_size / median_s,
        "train_s": train_s,
        "wall_s": time.perf_counter() - wall_start,
        "flops_per_step": measure.step_flops(stats["flops"], accounting, mesh.devices.size),
        **accounting,
    }
    if config.target_accuracy is not None:
        metrics.update(target_metrics(reached, batch_size))
    if console is not None:
        console.print(f"test accuracy {test['accuracy']:.4f}  test loss {test['loss']:.4f}  "
                      f"({step} steps, {metrics['wall_s']:.0f} s)")
    result = RunResult(kind="train", config=to_dict(config), env=environment(), metrics=metrics,
                       strategy=strategy.describe(), history=history)
    log_event(config, "end", metrics=metrics,
              result=str(Path(config.out) / RESULT_FILE) if config.out else None)
    return Outcome(result, strategy, state)
