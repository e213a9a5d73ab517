"""Launches through a real (single-node) SLURM cluster (`experiments/infra/slurm.py`): `srun -n 2`
of an MPI strategy and of two jax.distributed ones (each rank's view, the result equal to
`single`), a job killed mid-run and requeued by SLURM with `--resume auto` ending where an
uninterrupted run ends, the same for a job a silent task ended (jaxpar's watchdog: exit 75,
and the job script requeues itself), a lost coordinator said in a sentence, and no daemon
left afterwards.

Needs root and Debian's slurm-wlm and munge (`make test` installs them as root); skipped
with the reason otherwise.

    python -m pytest -q tests/experiments/infra/test_slurm.py
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.infra import slurm
from jaxpar.config import TrainConfig, with_options
from jaxpar.train import fit
from test_mpi_launch import ROOT, mpi_env



@pytest.fixture(scope="module", autouse=True)
def _one_machine_wide_file_at_a_time(machine_wide):
    """One emulated cluster / SLURM at a time (`conftest.machine_wide`)."""



needs_slurm = pytest.mark.skipif(slurm.missing() is not None, reason=str(slurm.missing()))

RUN = dict(dataset="synthetic", synthetic_size=2000, val_size=0, model="mlp", width=32, depth=1,
           batch_size=32, steps=5, optimizer="sgd", lr_schedule="constant", progress=False)


def flags(options: dict) -> list[str]:
    """The command-line flags of `options` (TrainConfig field names)."""
    out = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return out


def test_a_batch_script_is_one_process_and_srun_many(monkeypatch):
    """A batch script has SLURM_NTASKS and SLURM_PROCID of its own; only srun's tasks
    (SLURM_STEP_NUM_TASKS) are a multi-process launch."""
    from jaxpar.runtime import distributed

    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert distributed.launcher() is None and distributed.mpi_rank() == (0, 1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert distributed.launcher() == "slurm" and distributed.mpi_rank() == (1, 2)


def _daemons() -> list[str]:
    """SLURM and munge processes still running (any, not only ours: none should be)."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if entry.name.isdigit() and name in (*slurm.DAEMONS, "slurmstepd") and slurm.alive(int(entry.name)):
            left.append(f"{name} {entry.name}")
    return left


@pytest.fixture(scope="module")
def env():
    """A single-node SLURM cluster for this file's tests; afterwards no daemon is left."""
    try:
        yield {**mpi_env(), "SLURM_CONF": slurm.up()["SLURM_CONF"]}
    finally:
        slurm.down()
        deadline = time.monotonic() + 10  # a job step's slurmstepd ends after its daemon
        while _daemons() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _daemons() == [] and not slurm.HOME.exists()


@pytest.fixture(scope="module")
def single_loss():
    """`single`'s final loss on RUN, in this process: what every launch must end with."""
    return fit(with_options(TrainConfig(), **RUN, strategy="single")).result.metrics["final_loss"]


def srun(env, *argv, mpi: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(["srun", "-n", "2", *(["--mpi=pmi2"] if mpi else []), *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


VIEW = """import json, os, socket
from jaxpar.runtime import distributed
distributed.setup("auto", single_threaded=False)
import jax
print(json.dumps({"launcher": distributed.launcher(), "slurm_rank": int(os.environ["SLURM_PROCID"]),
                  "rank": jax.process_index(), "processes": jax.process_count(),
                  "mesh": [d.process_index for d in jax.devices()]}), flush=True)
"""
MPI_VIEW = """import json, os
from mpi4py import MPI
print(json.dumps({"slurm_rank": int(os.environ["SLURM_PROCID"]), "rank": MPI.COMM_WORLD.rank,
                  "processes": MPI.COMM_WORLD.size}), flush=True)
"""


def views(proc) -> list[dict]:
    return sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda v: v["rank"])


@needs_slurm
def test_srun_mpi_strategy(env, tmp_path, single_loss):
    """srun --mpi=pmi2: the ranks are SLURM's tasks 0 and 1 in one MPI world of 2, and
    mpi-allreduce over them ends with `single`'s loss."""
    seen = views(srun(env, sys.executable, "-c", MPI_VIEW, mpi=True))
    assert seen == [{"slurm_rank": r, "rank": r, "processes": 2} for r in (0, 1)]
    srun(env, sys.executable, "-m", "mpi4py", "-m", "experiments", "train", "--strategy",
         "mpi-allreduce", *flags(RUN), "--out", str(tmp_path), mpi=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["strategy"]["processes"] == 2 and result["env"]["mpi_ranks"] == 2
    assert result["metrics"]["final_loss"] == pytest.approx(single_loss, rel=1e-5)


@needs_slurm
@pytest.mark.parametrize("strategy", ["dp-auto", "fsdp"])
def test_srun_jax_distributed(env, tmp_path, single_loss, strategy):
    """Plain srun (jax.distributed from SLURM's environment): each rank is its SLURM task, the
    global mesh holds a device of each, and the strategy ends with `single`'s loss."""
    if strategy == "dp-auto":  # one look at the ranks' view is enough
        seen = views(srun(env, sys.executable, "-c", VIEW))
        assert seen == [{"launcher": "slurm", "slurm_rank": r, "rank": r, "processes": 2,
                         "mesh": [0, 1]} for r in (0, 1)]
    srun(env, sys.executable, "-m", "experiments", "train", "--strategy", strategy, *flags(RUN),
         "--out", str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["env"]["process_count"] == 2
    assert result["strategy"]["process_layout"]["processes"] == 2
    assert result["metrics"]["final_loss"] == pytest.approx(single_loss, rel=1e-5)


JOB = """#!/bin/sh
#SBATCH --requeue --open-mode=append -n 1
exec {python} -m experiments train {flags} --checkpoint-every 50 --resume auto \\
    --checkpoint-dir {dir}/ckpt --out {dir}/out
"""


def _job(env, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def _start_requeued(env, job: str, deadline: float) -> None:
    """Start a requeued job now rather than after the 2 minutes SLURM holds it back (its
    BeginTime), once its last run has ended (PENDING) and a second more: slurmd revokes that
    run's credential with one-second resolution, and refuses a start within the same second
    ('Killing non-startable batch job: Job credential revoked', seen here: the job FAILED)."""
    while _job(env, job)["JobState"] not in ("PENDING", "COMPLETED"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True,
                   capture_output=True)


@needs_slurm
def test_a_requeued_job_resumes_and_ends_like_an_uninterrupted_run(env, tmp_path):
    """One job script with --resume auto: SLURM requeues the job mid-run (scontrol requeue
    ends it: SIGTERM, on which the run saves and exits, SIGKILL after KillWait), the job
    starts again, continues from the checkpoint and ends with the loss of a run never
    interrupted."""
    run = {**RUN, "steps": 1000, "synthetic_size": 600, "batch_size": 16, "strategy": "single"}
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(python=sys.executable, flags=" ".join(flags(run)), dir=tmp_path))
    job = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "job.log"), str(script)],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    ckpt, deadline = tmp_path / "ckpt", time.monotonic() + 240
    while not any(p.name.isdigit() for p in ckpt.glob("*")):
        assert time.monotonic() < deadline and _job(env, job)["JobState"] in ("PENDING", "RUNNING"), \
            (tmp_path / "job.log").read_text()[-2000:]
        time.sleep(0.1)
    subprocess.run(["scontrol", "requeue", job], env=env, check=True, capture_output=True)
    _start_requeued(env, job, deadline)
    while (state := _job(env, job))["JobState"] != "COMPLETED" or state["Restarts"] != "1":
        assert time.monotonic() < deadline and state["JobState"] not in ("FAILED", "CANCELLED"), state
        time.sleep(0.2)
    log = (tmp_path / "job.log").read_text()
    result = json.loads((tmp_path / "out/result.json").read_text())
    assert result["metrics"]["resumed_from_step"], log[-2000:]
    assert "resumed from step" in log and "--resume auto continues it" in log
    uninterrupted = fit(with_options(TrainConfig(), **run)).result.metrics["final_loss"]
    assert result["metrics"]["final_loss"] == uninterrupted


def fault_job(python: str, flags: str) -> str:
    """The job script of docs/faults.md that goes on after a fault, run as it is written there
    but on one node (-n 2) and with this run's command (its folders relative, as there)."""
    doc = (ROOT / "docs" / "faults.md").read_text()
    script = next(block for block in re.findall(r"```bash\n(.*?)```", doc, re.S) if "scontrol requeue" in block)
    command = re.search(r"python -m experiments train .*?--out results/cnn", script, re.S).group(0)
    script = script.replace(command, f"{python} -m experiments train {flags} --collective-timeout 5 "
                                     "--checkpoint-every 50 --resume auto --checkpoint-dir ckpt/cnn --out results/cnn")
    return script.replace("--nodes=2 --ntasks-per-node=1", "-n 2")


def _controller_log(job: str) -> str:
    """slurmctld's lines about `job` (what it did with the job and why)."""
    log = slurm.HOME / "slurmctld.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return "\n".join(line for line in lines if f"JobId={job}" in line or f"job {job}" in line)[-3000:]


def _task(marker: str, rank: int) -> int | None:
    """The Python process of SLURM task `rank` whose environment holds `marker`."""
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if (entry.name.isdigit() and marker.encode() in environ
                    and f"SLURM_PROCID={rank}".encode() in environ
                    and b"experiments" in (entry / "cmdline").read_bytes()
                    and (entry / "comm").read_text().startswith("python")):  # not a shell around it
                return int(entry.name)
        except OSError:
            continue
    return None


@needs_slurm
def test_a_job_a_silent_task_ended_is_requeued_and_ends_like_an_uninterrupted_run(env, tmp_path):
    """The fault script of docs/faults.md, `dp-auto` on 2 tasks: task 1 stopped (SIGSTOP: alive and
    silent) after the first checkpoint; task 0's watchdog ends the step within the bound,
    exit 75 naming task 1; the job requeues itself, starts again, continues from the
    checkpoint and ends with the loss of a run never interrupted."""
    run = {**RUN, "steps": 400, "synthetic_size": 600, "batch_size": 16, "strategy": "dp-auto"}
    script = tmp_path / "job.sh"
    script.write_text(fault_job(sys.executable, " ".join(flags(run))))
    marker = f"JAXPAR_TEST_JOB={tmp_path}"
    job = subprocess.run(["sbatch", "--parsable", "-D", str(tmp_path), "-o", str(tmp_path / "job.log"), str(script)],
                         cwd=ROOT, env={**env, "JAXPAR_TEST_JOB": str(tmp_path)}, capture_output=True,
                         text=True, check=True).stdout.strip()
    ckpt, deadline = tmp_path / "ckpt" / "cnn", time.monotonic() + 300
    while not any(p.name.isdigit() for p in ckpt.glob("*")) or _task(marker, 1) is None:
        assert time.monotonic() < deadline and _job(env, job)["JobState"] in ("PENDING", "RUNNING"), \
            (tmp_path / "job.log").read_text()[-2000:]
        time.sleep(0.2)
    os.kill(_task(marker, 1), signal.SIGSTOP)
    while _job(env, job)["Restarts"] != "1":
        assert time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-2000:]
        time.sleep(0.2)
    _start_requeued(env, job, deadline)
    while (state := _job(env, job))["JobState"] != "COMPLETED":
        assert time.monotonic() < deadline and state["JobState"] not in ("FAILED", "CANCELLED"), \
            f"{state['JobState']} (exit {state.get('ExitCode')}):\n{(tmp_path / 'job.log').read_text()[-3000:]}" \
            f"\nslurmctld:\n{_controller_log(job)}"
        time.sleep(0.2)
    log = (tmp_path / "job.log").read_text()
    assert re.search(r"^jaxpar: dp-auto stopped at step \d+: no step finished for \d+ s "
                     r"\(--collective-timeout 5;.*rank 1 on \S+ has been silent", log, re.M), log[-3000:]
    assert "task 0: Exited with exit code 75" in log
    result = json.loads((tmp_path / "results/cnn/result.json").read_text())
    assert result["metrics"]["resumed_from_step"] >= 50 and result["metrics"]["steps"] == 400
    uninterrupted = fit(with_options(TrainConfig(), **{**run, "strategy": "single"})).result.metrics["final_loss"]
    assert result["metrics"]["final_loss"] == pytest.approx(uninterrupted, rel=1e-5)


@needs_slurm
def test_a_lost_coordinator_is_said_in_a_sentence_and_its_stack_goes_to_the_log(env, tmp_path):
    """`srun -n 2` of `dp-auto` (no -K), task 0 (the coordinator) killed mid-run: task 1's
    jax.distributed client aborts (XLA: 'Terminating process ...', a C++ stack). Instead, task
    1 says it lost the coordinator, rank 0, in a sentence and exits 75; XLA's lines are in its
    log (OUT/logs/rank-1.log), not on the terminal."""
    events, out = tmp_path / "events.jsonl", tmp_path / "out"
    with open(tmp_path / "srun.log", "w") as log:
        proc = subprocess.Popen(["srun", "-n", "2", sys.executable, "-m", "experiments", "train",
                                 "--strategy", "dp-auto", *flags({**RUN, "steps": 100000}),
                                 "--collective-timeout", "5", "--events", str(events), "--out", str(out)],
                                cwd=ROOT, env={**env, "JAXPAR_TEST_JOB": str(tmp_path)}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not (events.exists() and events.read_text().count('"event": "step"') >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "srun.log").read_text()[-2000:]
            time.sleep(0.2)
        os.kill(_task(f"JAXPAR_TEST_JOB={tmp_path}", 0), signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = (tmp_path / "srun.log").read_text()
    assert "task 1: Exited with exit code 75" in said, said[-3000:]
    assert re.search(r"^jaxpar \(rank 1 on \S+\): dp-auto stopped at step \d+: .*rank 0 on ", said, re.M), said[-3000:]
    assert "Check failure stack trace" not in said and "Terminating process" not in said
    assert "Terminating process" in (out / "logs" / "rank-1.log").read_text()
