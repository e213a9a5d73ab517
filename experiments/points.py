"""Running one study point in its own process: a point's device count (or rank count) must be
fixed before JAX starts, and a hang or crash must not take the study down with it.

    run_point(cmd, timeout)                      # any command; raises PointError on failure
    bench_point(folder, ["--model", "mlp", ...])  # `python -m experiments bench`, resumable
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

from jaxpar import results

STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL


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


def bench_point(folder: str | Path, flags: list[str], timeout: float, ranks: int | None = None) -> dict:
    """Run `python -m experiments bench FLAGS --out FOLDER` unless FOLDER already holds a
    complete result (a stopped study resumes); return that result as a dict.

    Args:
      ranks: run it as that many single-threaded MPI ranks (`rank_scaling.command`) instead.
    """
    path = Path(folder) / results.RESULT_FILE
    if path.exists():
        try:
            return dataclasses.asdict(results.load(path))
        except results.ResultsError:
            pass  # damaged or older schema: measure again
    bench = [sys.executable, "-m", "experiments", "bench", *flags]
    if ranks is not None:
        from experiments.rank_scaling import command

        bench = command(ranks, bench)
    run_point([*bench, "--out", str(folder)], timeout)
    return dataclasses.asdict(results.load(path))
