"""A silent process ends a multi-process job on one host within --collective-timeout, with a
sentence naming it and exit status 75 (jaxpar/runtime/watchdog.py), under plain mpiexec: a
rank stopped with SIGSTOP mid-run (alive, and silent: as behind a cut link) under mpi4jax
(`mpi-allreduce`) and under jax.distributed (`dp-auto`), and one stopped before its first
step, while the programs compile. Across emulated hosts (cut links,
lost hosts, flaps, every family): tests/experiments/infra/test_cluster.py; under SLURM: tests/experiments/infra/test_slurm.py.

    python -m pytest -q tests/runtime/test_watchdog_across_ranks.py
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.errors import PeerLost
from test_mpi_launch import MPIEXEC, ROOT, _rank_pid, mpi_env, needs_mpiexec, wait_for_steps

BOUND_S = 5
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-size", "2000", "--val-size", "0", "--batch-size",
             "32", "--no-progress"]
TINY_RUN = ["--model", "mlp", "--width", "16", "--depth", "1", *SYNTHETIC]


def stop_rank_mid_run(strategy: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """Launch 2 ranks of `strategy` with --collective-timeout BOUND_S, SIGSTOP rank 1 once
    training runs; (the ended job, seconds from the stop to its end)."""
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "experiments", "train",
         "--strategy", strategy, *TINY_RUN, "--steps", "100000", "--collective-timeout", str(BOUND_S),
         "--events", str(events), "--out", str(tmp_path / "out"), *extra],
        cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        wait_for_steps(proc, events, 30, marker='"event": "step"', poll=0.2)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - stopped
    finally:
        if proc.poll() is None:  # only what this test started: its own mpiexec's session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@needs_mpiexec
@pytest.mark.parametrize("strategy", ["mpi-allreduce", "dp-auto"])
def test_a_silent_rank_ends_the_job_within_the_bound_naming_it(strategy, tmp_path):
    """mpi4jax's ranks wait inside an MPI call in C, jax.distributed's inside gloo: either way
    the job ends within the bound (plus a beacon interval and the report's half second), exit
    75, rank 0 naming rank 1 and its host, the step, and how the same command goes on from
    the checkpoint (--resume auto)."""
    ckpt = tmp_path / "ckpt"
    proc, took = stop_rank_mid_run(strategy, tmp_path, "--checkpoint-dir", str(ckpt),
                                   "--checkpoint-every", "10", "--resume", "auto")
    assert proc.returncode == PeerLost.exit_code, proc.stderr[-3000:]
    assert BOUND_S <= took < BOUND_S + 5, (took, proc.stderr[-3000:])
    line = next(l for l in proc.stderr.splitlines() if l.startswith(f"jaxpar: {strategy} stopped at step"))
    assert (f"no step finished for {BOUND_S} s (--collective-timeout {BOUND_S}; steps took" in line
            and f"rank 1 on {os.uname().nodename} has been silent for" in line), line
    assert re.search(r"Ending the job \(exit status 75\)\. To go on, run the same command again: "
                     r"--resume auto continues from the latest checkpoint \(step [1-9]\d* in "
                     + re.escape(str(ckpt)) + r"\)\.$", line), line[-300:]


def _beacons_open(pid: int) -> bool:
    """Whether process `pid` holds a UDP socket: its watchdog has joined and sends beacons."""
    try:
        held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        rows = [line.split() for name in ("udp", "udp6")
                for line in open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]]
    except OSError:
        return False
    return any(f"socket:[{row[9]}]" in held for row in rows)  # column 9: the socket's inode


@needs_mpiexec
def test_a_rank_silent_before_the_loop_ends_the_job_within_the_bound(tmp_path):
    """Rank 1 stopped once its watchdog joined, while the CNN's programs still compile: rank 0
    would wait in MPI for ever before its first step; it ends the job at the bound, naming rank 1
    and that no step had started."""
    proc = subprocess.Popen(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "experiments", "train",
         "--strategy", "mpi-allreduce", "--model", "cnn", *SYNTHETIC, "--steps", "50",
         "--collective-timeout", str(BOUND_S), "--out", str(tmp_path / "out")],
        cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline, victim = time.monotonic() + 60, None
        while victim is None or not _beacons_open(victim):
            assert time.monotonic() < deadline and proc.poll() is None, "rank 1's watchdog never started"
            victim = victim or _rank_pid(proc.pid, 1)
            time.sleep(0.02)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == PeerLost.exit_code, err[-3000:]
    assert BOUND_S <= took < BOUND_S + 5, (took, err[-3000:])
    assert (f"jaxpar: mpi-allreduce stopped before its first step: rank 1 on {os.uname().nodename} "
            f"has been silent for {BOUND_S} s (last heard before its loop)") in err, err[-3000:]
