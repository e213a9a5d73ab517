"""Running one study point in its own process: a point's device count (or rank count) must be
fixed before JAX starts, and a hang or crash must not take the study down with it.

    run_point(cmd, timeout)                      # any command; raises PointError on failure
    bench_point(folder, ["--model", "mlp", ...])  # `python -m experiments bench`, resumable
    reusable(folder, flags)                      # its result if measured with these flags
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from experiments.cli import BENCH, build_parser, config_from_args
from jaxpar import results
from jaxpar.config import to_dict
from jaxpar.config import ConfigError

STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL
T = TypeVar("T")


class PointError(RuntimeError):
    """A study point's process failed or ran past its time limit."""


def run_point(cmd: list[str], timeout: float) -> None:
    """Run one point's command; past `timeout` stop it and everything it started. Raises with
    its stderr on failure."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: mpiexec (hydra) forwards it to its ranks, which run in sessions of
        # their own and would outlive a SIGKILL of mpiexec alone.
        proc.terminate()
        try:
            proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise PointError(f"{' '.join(cmd)} ran past {timeout:.0f} s and was stopped") from None
    if proc.returncode != 0:
        raise PointError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")


def bench_command(flags: list[str], ranks: int | None = None) -> list[str]:
    """`python -m experiments bench FLAGS`, or as `ranks` single-threaded MPI ranks."""
    bench = [sys.executable, "-m", "experiments", "bench", *flags]
    if ranks is None:
        return bench
    from experiments.rank_scaling import command

    return command(ranks, bench)


def reusable(folder: str | Path, flags: list[str], ranks: int | None = None) -> dict | None:
    """The complete bench result in FOLDER, as a dict, if it was measured with FLAGS (a stopped
    study resumes from it); None when there is none or it is damaged (measure again). A result
    of other settings raises ConfigError: a study is never a mix of two configurations.
    Studies call it for every point before any work, so that error comes first."""
    path = Path(folder) / results.RESULT_FILE
    if not path.exists():
        return None
    try:
        result = dataclasses.asdict(results.load(path))
    except results.ResultsError:
        return None  # damaged or older schema
    asked = _settings(bench_command(flags, ranks))
    have = {**_flat(result["config"]), "iters": result["metrics"]["iters"],
            "ranks": result["env"].get("mpi_ranks", 1)}
    diff = [f"{k} {have.get(k)} (asked {v})" for k, v in asked.items() if have.get(k) != v]
    if diff:
        raise ConfigError(f"{folder} holds a point measured with other settings ({', '.join(diff)}); "
                          f"pass a fresh --out or delete that folder")
    return result


def _settings(cmd: list[str]) -> dict:
    """What a bench command line measures: its config (where it writes aside), iters, ranks."""
    args = build_parser({"bench": BENCH}).parse_args(cmd[cmd.index("bench"):])
    config = json.loads(json.dumps(to_dict(config_from_args(args))))  # as stored: lists, not tuples
    ranks = int(cmd[cmd.index("-n") + 1]) if cmd[0] != sys.executable else 1
    settings = {**_flat(config), "iters": args.iters, "ranks": ranks}
    settings.pop("out")
    return settings


def _flat(config: dict) -> dict:
    """A config dict with its sections flattened: {'model.width': 256, 'seed': 0, ...}."""
    return {f"{k}.{kk}": vv for k, v in config.items() if isinstance(v, dict) for kk, vv in v.items()} | \
        {k: v for k, v in config.items() if not isinstance(v, dict)}


def bench_point(folder: str | Path, flags: list[str], timeout: float, ranks: int | None = None) -> dict:
    """Run `python -m experiments bench FLAGS --out FOLDER` unless FOLDER already holds its
    result (`reusable`); return that result as a dict.

    Args:
      ranks: run it as that many single-threaded MPI ranks (`rank_scaling.command`) instead.
    """
    done = reusable(folder, flags, ranks)
    if done is not None:
        return done
    run_point([*bench_command(flags, ranks), "--out", str(folder)], timeout)
    return dataclasses.asdict(results.load(Path(folder) / results.RESULT_FILE))


def pending(jobs: Iterable[T], result_path: Callable[[T], str | Path]) -> list[T]:
    """The jobs of a study whose results file is not there yet (or unreadable): resuming a
    study is re-running it with this filter, since each trial's JSON is written atomically.

    Args:
      jobs: the study's trials (configs, batch sizes, ...), in order.
      result_path: where a job's results JSON goes.
    Returns:
      The jobs still to run, in order.
    """
    todo = []
    for job in jobs:
        path = Path(result_path(job))
        try:
            results.RunResult.from_json(path.read_text())
        except Exception:  # missing, partial or stale: run it (again)
            todo.append(job)
    return todo
