"""Live training for the demo: each strategy trains in its own `python -m experiments train`
process (the one training loop), and the page follows its `--events` file.

    runs = LiveRuns("results/demo")
    runs.start(RunSpec(model="mlp", dataset="synthetic", strategies=("single", "dp-shard-map")))
    runs.poll()     # one Status per run: step, loss, images/s, accounting, error
    runs.stop()     # SIGTERM: each run saves a checkpoint and exits
    runs.resume()   # the same commands plus --resume

A group of runs lives in `<root>/<time>/<strategy>/`: result.json (at the end), checkpoint/,
events.jsonl, and the process's stdout and stderr.
"""

from __future__ import annotations

import atexit
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.cli import EXIT_USAGE  # the status `train` exits with for an error the user can fix
from experiments.demo.classify import CHECKPOINT_SUBDIR, has_checkpoint
from jaxpar.parallel import STRATEGIES

EVENTS = "events.jsonl"
STOP_GRACE_S = 60  # a stopped run finishes its step and saves; past this it is killed


def strategies_for(model: str) -> list[str]:
    """The strategies one process can run on `model` (mpi4jax ones need an MPI launcher)."""
    return [name for name, cls in STRATEGIES.items()
            if not cls.uses_mpi and (cls.models is None or model in cls.models)]


@dataclass(frozen=True)
class RunSpec:
    """What the train panel asks for; every run of a group shares all but the strategy."""

    model: str = "mlp"
    dataset: str = "fashion_mnist"
    strategies: tuple[str, ...] = ("single", "dp-shard-map")
    devices: int = 2          # simulated CPU devices per process (single uses one of them)
    steps: int = 400
    batch_size: int = 128
    eval_every: int = 50      # validations (the accuracy curve's points) every N steps
    val_size: int = 2000      # small: a validation is a pause in the curve
    extra: tuple[str, ...] = ()  # further train flags, e.g. ("--synthetic-size", "2000")

    def flags(self, strategy: str) -> list[str]:
        return ["--model", self.model, "--dataset", self.dataset, "--strategy", strategy,
                "--devices", str(self.devices), "--steps", str(self.steps),
                "--batch-size", str(self.batch_size), "--eval-every", str(self.eval_every),
                "--val-size", str(self.val_size), "--no-progress", *self.extra]


@dataclass
class Status:
    """What the page shows of one run, from its events file and its process."""

    strategy: str
    folder: Path
    # starting | preparing (loading data, compiling) | training | stopped | finished | failed
    state: str = "starting"
    total_steps: int = 0
    start: dict = field(default_factory=dict)       # the start record: compile time, accounting
    steps: list[dict] = field(default_factory=list)
    validations: list[dict] = field(default_factory=list)
    end: dict = field(default_factory=dict)
    error: str = ""


class Run:
    """One strategy's training process and what it has reported so far."""

    def __init__(self, spec: RunSpec, strategy: str, folder: Path):
        self.spec, self.strategy, self.folder = spec, strategy, folder
        self.proc: subprocess.Popen | None = None
        self.status = Status(strategy, folder)
        self._offset = 0
        self._partial = ""
        self.stopping = False

    def command(self, resume: bool) -> list[str]:
        return [sys.executable, "-m", "experiments", "train", *self.spec.flags(self.strategy),
                "--out", str(self.folder), "--events", str(self.folder / EVENTS),
                "--checkpoint-dir", str(self.folder / CHECKPOINT_SUBDIR),
                *(["--resume"] if resume else [])]

    def launch(self, resume: bool = False) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        checkpoint = self.folder / CHECKPOINT_SUBDIR
        if resume and not has_checkpoint(checkpoint):
            # Stopped before its first checkpoint (during start-up): start it again.
            shutil.rmtree(checkpoint, ignore_errors=True)
            resume = False
        self.stopping = False
        self.status.state, self.status.error = "starting", ""
        with open(self.folder / "stdout.txt", "ab") as out, open(self.folder / "stderr.txt", "wb") as err:
            self.proc = subprocess.Popen(self.command(resume), stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.running():
            self.stopping = True
            self.proc.send_signal(signal.SIGTERM)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> Status:
        """Read the records written since the last poll; settle the state once it exits."""
        for record in self._new_records():
            kind = record.get("event")
            if kind == "start":
                self.status.start = record
                self.status.total_steps = record.get("total_steps", 0)
                self.status.state = "training"
            elif kind == "step":
                self.status.steps.append(record)
            elif kind == "validation":
                self.status.validations.append(record)
            elif kind == "end":
                self.status.end = record
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            if self.status.state == "starting" and self.proc is not None:
                self.status.state = "preparing"
        elif code == 0:
            self.status.state = "finished"
        elif self.stopping or code == 128 + signal.SIGTERM:
            self.status.state = "stopped"
        else:
            self.status.state = "failed"
            self.status.error = failure_message(self.folder / "stderr.txt", code)
        return self.status

    def _new_records(self) -> list[dict]:
        path = self.folder / EVENTS
        if not path.exists():
            return []
        with open(path) as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        self._partial = lines.pop()  # a line still being written
        return [json.loads(line) for line in lines if line.strip()]


def failure_message(stderr: Path, code: int) -> str:
    """A failed run's message: the CLI's one paragraph (exit 2), else the end of its stderr."""
    text = stderr.read_text(errors="replace").strip() if stderr.exists() else ""
    if code == EXIT_USAGE:
        lines = text.splitlines()
        start = max((i for i, line in enumerate(lines) if line.startswith("error: ")), default=0)
        return "\n".join(lines[start:]).removeprefix("error: ")
    tail = "\n".join(text.splitlines()[-12:])
    return f"exited with status {code}:\n{tail}" if tail else f"exited with status {code}"


class LiveRuns:
    """The group of runs the train panel started last (one group at a time)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.runs: list[Run] = []
        self.group: Path | None = None  # the folder of the group's runs
        self.started = 0.0  # wall time the group started: every curve's zero
        # Start, stop and resume one at a time (the page runs their events concurrently): a
        # resume of the old group while a start stops it would leave processes no one tracks.
        self._lock = threading.RLock()
        atexit.register(self.kill)

    def start(self, spec: RunSpec) -> Path:
        """Stop the previous group and start one process per strategy of `spec`."""
        with self._lock:
            return self._start(spec)

    def _start(self, spec: RunSpec) -> Path:
        self.stop(wait=True)
        group = self.root / time.strftime("%Y%m%d-%H%M%S")
        while group.exists():  # two groups in one second
            group = group.with_name(group.name + "-1")
        self.runs = [Run(spec, s, group / s) for s in spec.strategies]
        self.group, self.started = group, time.time()
        for run in self.runs:
            run.launch()
        return group

    def stop(self, wait: bool = False) -> None:
        """SIGTERM every running process (each saves a checkpoint and exits)."""
        with self._lock:
            self._stop(wait)

    def _stop(self, wait: bool) -> None:
        for run in self.runs:
            run.stop()
        if wait:
            deadline = time.monotonic() + STOP_GRACE_S
            for run in self.runs:
                if run.proc is not None:
                    try:
                        run.proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        run.proc.kill()

    def resume(self) -> int:
        """Relaunch the stopped runs with --resume; how many were relaunched."""
        with self._lock:
            stopped = [r for r in self.runs if not r.running() and r.poll().state == "stopped"]
            for run in stopped:
                run.launch(resume=True)
            return len(stopped)

    def poll(self) -> list[Status]:
        return [run.poll() for run in self.runs]

    def running(self) -> bool:
        return any(run.running() for run in self.runs)

    def kill(self) -> None:
        """At exit: stop the processes this demo started (a checkpoint each, if they can)."""
        self.stop(wait=True)


def curves(statuses: list[Status], started: float) -> dict[str, list[dict[str, Any]]]:
    """Rows for the plots: loss per logged step and validation accuracy, against seconds since
    the group started (a stop shows as a gap: wall time, not training time)."""
    loss, accuracy = [], []
    for s in statuses:
        loss += [{"seconds": r["time"] - started, "loss": r["loss"], "strategy": s.strategy,
                  "step": r["step"]} for r in s.steps]
        accuracy += [{"seconds": r["time"] - started, "val_accuracy": r["val_accuracy"],
                      "strategy": s.strategy, "step": r["step"]} for r in s.validations]
    return {"loss": loss, "accuracy": accuracy}


def summary_row(s: Status) -> dict[str, Any]:
    """One table row: progress, speed and the start record's accounting."""
    last = s.steps[-1] if s.steps else {}
    val = s.validations[-1] if s.validations else {}
    memory = s.start.get("memory_per_device", {})
    mib = 2 ** 20
    return {
        "strategy": s.strategy,
        "state": s.state,
        "step": f"{last.get('step', 0)}/{s.total_steps or '?'}",
        "loss": _round(last.get("loss"), 4),
        "val accuracy": _round(val.get("val_accuracy"), 4),
        "images/s": _round(last.get("images_per_sec"), 0),
        "step ms": _round(last.get("step_ms"), 2),
        "compile s": _round(s.start.get("compile_s"), 2),
        "collective B/step": s.start.get("collective_bytes_per_step"),
        "state MiB/device": _round(_div(s.start.get("state_bytes_per_device"), mib), 2),
        "temp MiB/device": _round(_div(memory.get("temp_bytes"), mib), 2),
        "test accuracy": _round(s.end.get("metrics", {}).get("test_accuracy"), 4),
    }


def _div(x, y):
    return None if x is None else x / y


def _round(x, digits):
    return None if x is None else round(float(x), digits)
