"""The training loop: batches -> strategy.step -> evaluation -> RunResult.

One loop for every strategy. It validates each epoch (or every `--eval-every` steps), tests
at the end, shows a rich progress bar and returns a `RunResult` for `results.save`. `fit`
reads as its pieces:

    set_up            options checked, data loaded, state placed (or resumed from a checkpoint)
    compile_programs  step and eval programs compiled: compile time, FLOPs, bytes, memory
    train_epoch       an epoch's steps: `log_step` at each sync point, `record_validation` every N steps
    end_epoch         the epoch's validation, running sums reset, checkpoint when due
    make_result       test split, metrics, the RunResult

    python -m experiments train --model cnn --epochs 3 --out results/run1
    python -m experiments train --model mlp --epochs 5 --eval-every 25 --target-accuracy 0.85

With `--target-accuracy` the run stops at the first validation whose accuracy reaches the
target; `time_to_target_s` is the training time up to that step: step time only, without
compilation (`compile_s`, reported apart) and without evaluation. It survives `--resume`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxpar import checkpoint as ckptlib
from jaxpar import data as datalib
from jaxpar import events
from jaxpar.config import RESUME_AUTO, TrainConfig, to_dict
from jaxpar.errors import ConfigError, Diverged
from jaxpar import models
from jaxpar.optim import make_optimizer
from jaxpar.parallel import STRATEGIES
from jaxpar.results import RESULT_FILE, RunResult, capture_provenance, environment
from jaxpar.runtime import watchdog
from jaxpar.step import SUMS, summarize
from jaxpar import validate as validation  # the configuration's check (validation.validate)


def first_reaching(history: list[dict[str, Any]], target: float | None) -> dict[str, Any] | None:
    """The first validation record whose accuracy reaches `target` (None: none, or no target)."""
    if target is None:
        return None
    return next((h for h in history if h["val_accuracy"] >= target), None)


def make_strategy(config: TrainConfig):
    """The `--strategy` named in `config`, constructed (ConfigError naming the choices)."""
    name = config.parallel.strategy
    if name not in STRATEGIES:
        raise ConfigError(f"unknown --strategy {name!r}; choices: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](config)


def build_model(config: TrainConfig):
    """The model `config` describes, its parameters seeded by `config.seed`, for the images
    and classes of its dataset."""
    return models.from_config(config.model, config.seed, datalib.spec(config.data))


def evaluate(strategy, state, split, batch_size: int) -> dict[str, float]:
    """Loss and accuracy over a whole split (padding rows carry weight 0)."""
    totals: dict[str, float] = {}
    for batch in datalib.eval_batches(split, batch_size):
        sums = strategy.host_sums(strategy.eval_step(state, strategy.place_batch(batch)))
        watchdog.progress()  # a wait for the other processes ended
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + v
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


def _progress(enabled: bool):
    """The live progress bar (a silent one when not `enabled`)."""
    # rich's progress bar: only when shown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.3f}  "
                               "{task.fields[ips]:,.0f} img/s"),
                    TimeRemainingColumn(), disable=not enabled, transient=False)


@dataclass
class Outcome:
    """What `fit` returns: the result, and what produced it for tests and checkpoints."""

    result: RunResult
    strategy: Any   # the Strategy that ran, for `to_reference` and checkpoints
    state: Any      # its final TrainState (placed on devices)


@dataclass(frozen=True)
class Run:
    """What a run is set up with: the loop reads it and never changes it."""

    config: TrainConfig
    strategy: Any                  # the jaxpar.parallel Strategy that places the run
    mesh: jax.sharding.Mesh
    splits: datalib.Splits
    per_epoch: int                 # steps per pass over the training split
    total_steps: int
    eval_bs: int                   # evaluation batch size (at most the test split)
    ckpt: ckptlib.Checkpointer | None
    console: Any                   # a rich Console for epoch lines (None: quiet)
    # One step in flight on CPU: XLA's in-process collectives deadlock when steps queue up;
    # elsewhere wait only every few steps so the host runs ahead.
    sync_every: int

    @property
    def epochs(self) -> int:
        return math.ceil(self.total_steps / self.per_epoch)


@dataclass
class LoopState:
    """What the loop changes as it goes; a checkpoint keeps everything but `step_times`."""

    state: Any                     # the strategy's TrainState
    step: int = 0
    resumed_from: int | None = None
    train_s: float = 0.0           # step time only (no compilation, no evaluation)
    running: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUMS, 0.0))  # this epoch's
    history: list[dict[str, Any]] = field(default_factory=list)   # one record per validation
    last: dict[str, float] = field(default_factory=lambda: {"loss": math.nan, "accuracy": math.nan})
    step_times: list[float] = field(default_factory=list)
    reached: dict[str, Any] | None = None  # the first validation that reached --target-accuracy
    last_finite_loss: float | None = None  # the latest logged step's loss, while finite
    # Metric sums of the steps since the loop last waited (still on device), and when the
    # first of them started: the loop waits every `sync_every` steps, then logs them all.
    pending: list[dict] = field(default_factory=list)
    window_t0: float = 0.0

    def done(self, run: Run) -> bool:
        return self.step >= run.total_steps or self.reached is not None


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
    capture_provenance(config.data)  # the revision and data this run starts from
    run, loop = set_up(config, console)
    compiled = compile_programs(run, loop.state)
    events.log(config.events, "start", step=loop.step, total_steps=run.total_steps,
               batch_size=config.data.batch_size, strategy=run.strategy.describe(), **compiled)
    # Every wait for another process from here to the test split's last batch is bounded.
    with watchdog.armed(config.parallel.strategy, functools.partial(resume_hint, run)):
        try:
            loop_epochs(run, loop)
            if run.ckpt is not None and run.ckpt.last_saved != loop.step:
                save_checkpoint(run, loop)
        except Diverged as stop:
            stop.result = diverged_result(run, loop, compiled, wall_start, stop)
            events.log(config.events, "end", status="diverged", metrics=stop.result.metrics,
                       message=str(stop), result=_result_path(config))
            raise
        finally:
            if run.ckpt is not None:
                run.ckpt.close()  # waits for the asynchronous writes (the good ones, on divergence)
        result = make_result(run, loop, compiled, wall_start)
    events.log(config.events, "end", status="completed", metrics=result.metrics,
               result=_result_path(config))
    return Outcome(result, run.strategy, loop.state)


def resume_hint(run: Run) -> str:
    """How the same run goes on after a fault ended it (the watchdog's report)."""
    if run.ckpt is None:
        return ("Nothing was checkpointed: with --checkpoint-dir DIR --checkpoint-every N "
                "--resume auto, the same command goes on after a fault from the latest checkpoint.")
    saved = (f"step {run.ckpt.last_saved} in {run.ckpt.directory}" if run.ckpt.last_saved
             else f"none yet in {run.ckpt.directory}: it starts over")
    if run.config.resume == RESUME_AUTO:
        return f"To go on, run the same command again: --resume auto continues from the latest checkpoint ({saved})."
    return f"To go on, run the same command with --resume auto (latest checkpoint: {saved})."


def _result_path(config: TrainConfig) -> str | None:
    """Where the caller writes the result (`--out`), for the "end" record."""
    return str(Path(config.out) / RESULT_FILE) if config.out else None


def loop_epochs(run: Run, loop: LoopState) -> None:
    """The training loop: epoch after epoch until the budget, the target or a stop."""
    with _progress(run.config.progress and run.console is not None) as bar, \
            (run.ckpt or contextlib.nullcontext()):
        task = bar.add_task("train", total=run.total_steps, completed=loop.step, epoch=1,
                            loss=math.nan, acc=0.0, ips=0.0)
        show = functools.partial(bar.update, task)
        for epoch in range(loop.step // run.per_epoch, run.epochs):
            if loop.reached is not None:
                break
            start = loop.step - epoch * run.per_epoch  # > 0 only in the epoch a resumed run stopped in
            train_epoch(run, loop, epoch, start, show)
            end_epoch(run, loop, epoch, start)
            if loop.done(run):
                break


def sync_interval() -> int:
    """Steps between the loop's waits for the device. One on CPU: XLA's in-process collectives
    deadlock when steps queue up (one collective step in flight); elsewhere the host runs up
    to 10 steps ahead, and a non-finite loss is caught within those 10 steps."""
    return 1 if jax.default_backend() == "cpu" else 10


def set_up(config: TrainConfig, console=None) -> tuple[Run, LoopState]:
    """Check the options, load the data, place the initial state; resume it if asked.
    Every check comes before any write (bad --resume input overwrites nothing)."""
    validation.validate(config)  # every option and combination (the CLI has checked them too)
    strategy = make_strategy(config)
    ckpt = ckptlib.Checkpointer(config) if config.checkpoint_dir else None  # checks the folder
    splits = datalib.load_splits(config.data, config.seed)
    mesh = strategy.make_mesh(jax.devices())
    per_epoch = datalib.steps_per_epoch(len(splits.train[1]), config.data.batch_size)
    total_steps = config.steps if config.steps is not None else config.epochs * per_epoch
    validation.check_schedule(config, total_steps)
    run = Run(config, strategy, mesh, splits, per_epoch, total_steps,
              eval_bs=min(config.data.eval_batch_size, len(splits.test[1])), ckpt=ckpt,
              console=console, sync_every=sync_interval())
    tx = make_optimizer(config.optim, total_steps)
    loop = LoopState(state=strategy.init(build_model(config), tx, mesh))
    if ckpt is not None and ckpt.resuming:
        resume(run, loop)
    # A run resumed after it reached the target has nothing left to train.
    loop.reached = first_reaching(loop.history, config.target_accuracy)
    return run, loop


def resume(run: Run, loop: LoopState) -> None:
    """Continue from the latest readable checkpoint: state, step, running sums, history."""
    ref, saved = run.ckpt.restore(run.strategy.state_to_reference(loop.state))
    loop.state = run.strategy.state_from_reference(ref)
    loop.step = loop.resumed_from = saved["step"]
    loop.running, loop.history = saved["running"], saved["history"]
    loop.train_s = saved.get("train_s", 0.0)  # time to target counts the steps before the stop
    if run.console is not None:
        run.console.print(f"resumed from step {loop.step} ({run.ckpt.directory / str(loop.step)})")


def compile_programs(run: Run, state) -> dict[str, Any]:
    """AOT-compile the step and evaluation programs; the metrics that come from them
    (compile seconds, FLOPs per step, communication and memory)."""
    strategy, splits = run.strategy, run.splits
    batch_size, seed = run.config.data.batch_size, run.config.seed
    first = strategy.place_batch(next(datalib.train_batches(splits.train, batch_size, seed, 0)))
    step = strategy.compile("step", state, first)
    accounting = strategy.accounting(step, state)
    example = strategy.place_batch(next(datalib.eval_batches(splits.test, run.eval_bs)))
    evals = strategy.compile("eval_step", state, example)
    k = run.config.parallel.steps_per_dispatch
    chained = {"steps_compile_s": strategy.compile("steps", state, (first,) * k).seconds} if k > 1 else {}
    return {"compile_s": step.seconds, "eval_compile_s": evals.seconds, **chained,
            "flops_per_step": step.flops, **accounting}


def train_epoch(run: Run, loop: LoopState, epoch: int, start: int, show: Callable[..., Any]) -> None:
    """Train on `epoch`'s batches from batch `start` until the epoch ends or the run stops,
    validating every --eval-every steps and checkpointing when due or signalled. Each
    dispatch runs one step, or --steps-per-dispatch K steps in one program where no
    validation, checkpoint or end falls inside them."""
    config, strategy = run.config, run.strategy
    batches = datalib.train_batches(run.splits.train, config.data.batch_size, config.seed,
                                    epoch, start)
    while loop.step < run.total_steps:
        group = list(itertools.islice(batches, dispatch_size(run, loop.step, epoch)))
        if not group:
            break
        if not loop.pending:
            loop.window_t0 = time.perf_counter()
        placed = [strategy.place_batch(batch) for batch in group]
        if len(placed) == 1:
            loop.state, sums = strategy.step(loop.state, placed[0])
            loop.pending.append(sums)
        else:
            loop.state, many = strategy.steps(loop.state, placed)
            loop.pending.extend(many)
        loop.step += len(placed)
        evaluating = bool(config.eval_every) and loop.step % config.eval_every == 0
        # Wait for the step before a validation, so train_s counts every step before it.
        if len(loop.pending) >= run.sync_every or loop.step == run.total_steps or evaluating:
            log_steps(run, loop, epoch, show)
        if evaluating:
            record_validation(run, loop, epoch)
        if run.ckpt is not None and run.ckpt.signum is not None:  # SIGTERM / Ctrl-C
            folder = save_checkpoint(run, loop)
            run.ckpt.close()
            raise run.ckpt.interrupted(folder)
        if run.ckpt is not None and run.ckpt.due(loop.step) and loop.step % run.per_epoch:
            save_checkpoint(run, loop)  # (at an epoch's end, end_epoch saves after the running sums reset)
        if loop.done(run):
            break


def dispatch_size(run: Run, step: int, epoch: int) -> int:
    """Steps the next dispatch runs from `step`: --steps-per-dispatch K when the K steps stay
    in `epoch` and the run, and none but the last is followed by a validation or a
    checkpoint (the host acts between steps only at a dispatch's end); else 1."""
    k, config = run.config.parallel.steps_per_dispatch, run.config
    if k == 1 or step + k > min(run.total_steps, (epoch + 1) * run.per_epoch):
        return 1
    for inner in range(step + 1, step + k):  # the steps that end before the dispatch does
        if (config.eval_every and inner % config.eval_every == 0) or (
                run.ckpt is not None and run.ckpt.due(inner)):
            return 1
    return k


def log_steps(run: Run, loop: LoopState, epoch: int, show: Callable[..., Any]) -> None:
    """Log the steps since the last wait: wait for them, add them up (`drain`), show them."""
    drain(run, loop)
    loop.last = summarize(loop.running)
    ips = run.config.data.batch_size / statistics.median(loop.step_times[-50:])
    show(completed=loop.step, epoch=epoch + 1, loss=loop.last["loss"], acc=loop.last["accuracy"],
         ips=ips)
    events.log(run.config.events, "step", step=loop.step, epoch=epoch + 1, loss=loop.last["loss"],
               accuracy=loop.last["accuracy"], images_per_sec=ips,
               step_ms=1000 * run.config.data.batch_size / ips)


def drain(run: Run, loop: LoopState) -> None:
    """Wait for the steps since the last wait, add their metric sums to the running totals and
    count their time. A step whose loss is not finite stops the run there (Diverged)."""
    if not loop.pending:
        return
    window = [run.strategy.host_sums(sums) for sums in loop.pending]
    dt = time.perf_counter() - loop.window_t0
    first = loop.step - len(window) + 1
    for i, totals in enumerate(window):
        loss = totals["loss_sum"] / max(totals["count"], 1.0)
        if not math.isfinite(loss):
            raise Diverged(first + i, loop.last_finite_loss, run.config.optim.lr)
        loop.last_finite_loss = loss
        for k in loop.running:
            loop.running[k] += totals[k]
    loop.step_times.append(dt / len(window))
    loop.train_s += dt
    loop.pending = []
    watchdog.progress(loop.step, dt, len(window))  # the steps' waits for other processes ended


def record_validation(run: Run, loop: LoopState, epoch: int) -> None:
    """Record one validation: evaluate the validation split, append the record to the history
    and check it against --target-accuracy."""
    if run.splits.val is None:
        return
    val = evaluate(run.strategy, loop.state, run.splits.val, run.eval_bs)
    last, console = loop.last, run.console
    record = {"step": loop.step, "epoch": epoch, "train_loss": last["loss"],
              "train_accuracy": last["accuracy"], "val_loss": val["loss"],
              "val_accuracy": val["accuracy"], "train_s": loop.train_s}
    loop.history.append(record)
    events.log(run.config.events, "validation", **record)
    if console is not None:
        console.print(f"epoch {epoch + 1:>3}  step {loop.step:>6}  train loss {last['loss']:.4f}  "
                      f"val loss {val['loss']:.4f}  val acc {val['accuracy']:.4f}")
    loop.reached = first_reaching([record], run.config.target_accuracy)
    if loop.reached is not None and console is not None:
        console.print(f"target validation accuracy {run.config.target_accuracy} reached at step "
                      f"{loop.step} ({loop.train_s:.1f} s of training)")


def end_epoch(run: Run, loop: LoopState, epoch: int, start: int) -> None:
    """After an epoch's batches: validate (once per epoch, unless --eval-every), and at an
    epoch boundary reset the running sums and checkpoint when due."""
    if not run.config.eval_every and loop.step > epoch * run.per_epoch + start and loop.reached is None:
        record_validation(run, loop, epoch)
    if loop.step % run.per_epoch == 0:
        loop.running = dict.fromkeys(loop.running, 0.0)
        if run.ckpt is not None and run.ckpt.due(loop.step) and loop.step < run.total_steps:
            save_checkpoint(run, loop)


def save_checkpoint(run: Run, loop: LoopState):
    """Checkpoint the state and the loop's progress; returns the step's folder. A state that
    is not finite is never saved (Diverged): the last good checkpoint stays the latest."""
    drain(run, loop)  # the running sums the checkpoint keeps count every step before it
    # Checked in the reference layout, on the host: every process holds all of it there, even
    # where a stage's arrays live on another process's device.
    ref = run.strategy.state_to_reference(loop.state)
    if not finite(ref.params):
        raise Diverged(loop.step, loop.last_finite_loss, run.config.optim.lr, "model's parameters")
    # The data order is a function of (seed, epoch): the step fixes the position in it.
    progress = {"epoch": loop.step // run.per_epoch, "position": loop.step % run.per_epoch,
                "running": loop.running, "history": loop.history, "train_s": loop.train_s}
    folder = run.ckpt.save(loop.step, ref, progress)
    watchdog.progress()  # the state's gathers from other processes ended
    return folder


def finite(tree) -> bool:
    """Every array of `tree` (host arrays: a reference-layout state) finite; called only
    before a checkpoint."""
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


def diverged_result(run: Run, loop: LoopState, compiled: dict[str, Any], wall_start: float,
                    stop: Diverged) -> RunResult:
    """What a diverged run writes instead of test metrics: where it stopped and why."""
    metrics = {"steps": loop.step, "diverged_at_step": stop.step,
               "last_finite_loss": stop.last_finite_loss, "train_s": loop.train_s,
               "wall_s": time.perf_counter() - wall_start, **compiled}
    return RunResult(kind="train", config=to_dict(run.config), env=environment(run.config, run.strategy),
                     metrics=metrics, strategy=run.strategy.describe(), history=loop.history,
                     status="diverged")


def make_result(run: Run, loop: LoopState, compiled: dict[str, Any], wall_start: float) -> RunResult:
    """Test the final state; the run's metrics, set-up and validation history."""
    config, history, batch_size = run.config, loop.history, run.config.data.batch_size
    test = evaluate(run.strategy, loop.state, run.splits.test, run.eval_bs)
    median_s = statistics.median(loop.step_times) if loop.step_times else float("nan")
    metrics = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "val_accuracy": history[-1]["val_accuracy"] if history else None,
        "val_loss": history[-1]["val_loss"] if history else None,
        "final_loss": loop.last["loss"],
        "resumed_from_step": loop.resumed_from,
        "steps": loop.step,
        "epochs": loop.step / run.per_epoch,
        "step_time_ms_median": 1000 * median_s,
        "images_per_sec": batch_size / median_s,
        "train_s": loop.train_s,
        "wall_s": time.perf_counter() - wall_start,
        **compiled,  # compile_s, eval_compile_s, flops_per_step, communication and memory
    }
    if config.target_accuracy is not None:
        metrics.update(target_metrics(loop.reached, batch_size))
    if run.console is not None:
        run.console.print(f"test accuracy {test['accuracy']:.4f}  test loss {test['loss']:.4f}  "
                          f"({loop.step} steps, {metrics['wall_s']:.0f} s)")
    return RunResult(kind="train", config=to_dict(config), env=environment(config, run.strategy),
                     metrics=metrics, strategy=run.strategy.describe(), history=history)
