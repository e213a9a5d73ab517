"""Launch-level MPI checks (`jaxpar/runtime/distributed.py`) that run under plain pytest.

A failing or killed rank ends a 2-rank job quickly (the failing one with a message naming
it), a missing mpi4jax says how to install the `mpi` extra, checkpoints of multi-process runs
resume (on the same ranks, or on one process under another strategy). The model-parallel
equivalence tests on 4 ranks and on 2 ranks of 2 devices each: tests/test_mpi_worlds.py.

    python -m pytest -q tests/test_mpi_launch.py
"""

import builtins
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TEST_XLA_FLAGS
from cross_host import CROSS_HOST, WHY_NO_HOSTS
from experiments.points.mpi import mpiexec
from jaxpar.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = mpiexec()  # the launcher of this venv's MPICH, as the studies use
needs_mpiexec = pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                                   reason="needs the `mpi` extra in this venv (make test installs it)")


# A rank's pytest: no cache folder, and none of the plugins no rank uses (importing
# Hypothesis's alone took a second of CPU in each of the suite's dozen rank processes).
RANK_PYTEST = [sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "-p", "no:anyio"]


def mpi_env(**extra) -> dict:
    """The environment of a launched job: CPU only, unbuffered, the suite's compile flags only."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **extra}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return env


def test_missing_mpi4jax_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_mpi4jax(name, *args, **kwargs):
        if name.startswith("mpi4jax"):
            raise ImportError("No module named 'mpi4jax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpi4jax)
    monkeypatch.delitem(sys.modules, "mpi4jax", raising=False)
    from jaxpar.parallel.mpi import common as mpi_common

    with pytest.raises(ConfigError, match="mpi` extra"):
        mpi_common.import_mpi()


def test_a_launch_of_a_one_process_strategy_is_refused_naming_those_that_can(monkeypatch):
    from experiments.points.run import distributed_mode
    from jaxpar.config import TrainConfig, with_options
    from jaxpar.parallel import STRATEGIES

    monkeypatch.setenv("PMI_SIZE", "2")  # as under mpiexec -n 2
    with pytest.raises(ConfigError, match="cannot run across processes") as error:
        distributed_mode(with_options(TrainConfig(), strategy="single"))
    able = str(error.value).split("can: ")[1].split(", ")
    assert able == [n for n, cls in STRATEGIES.items() if cls.multiprocess or cls.uses_mpi]
    # All but `single` (one device) and `gems` (not yet tested on a mesh over processes).
    assert set(STRATEGIES) - set(able) == {"single", "gems"}
    assert distributed_mode(with_options(TrainConfig(), strategy="hybrid")) == "auto"
    assert distributed_mode(with_options(TrainConfig(), strategy="mpi-pipeline")) == "none"


@pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                    reason="needs the `mpi` extra in this venv (make test installs it)")
def test_failing_rank_ends_the_job_quickly():
    env = mpi_env(JAXPAR_FAIL_RANK="1")
    start = time.monotonic()
    proc = subprocess.run(
        ["timeout", "120", str(MPIEXEC), "-n", "2", sys.executable, "-m", "experiments", "train",
         "--strategy", "mpi-allreduce", "--dataset", "synthetic", "--model", "mlp", "--width", "16",
         "--steps", "3", "--batch-size", "16", "--no-progress", "--out", "/tmp/jaxpar-fail-test"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    assert proc.returncode not in (0, 124), proc.stdout + proc.stderr
    assert elapsed < 90
    assert "rank 1 of 2 failed" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                    reason="needs the `mpi` extra in this venv (make test installs it)")
def test_checkpoint_resume_under_mpirun_is_bitwise(tmp_path):
    """2 ranks, dp-auto under jax.distributed: resuming from step 10 ends where the
    uninterrupted run ends, bit for bit."""
    from jaxpar import checkpoint

    env = mpi_env()

    def launch(ckpt, *extra):
        args = ["--strategy", "dp-auto", "--dataset", "synthetic", "--synthetic-size", "4000",
                "--val-size", "0", "--model", "mlp", "--width", "32", "--depth", "1",
                "--batch-size", "32", "--steps", "20", "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "10", "--no-progress", "--out", str(tmp_path / "out"), *extra]
        proc = subprocess.run(["timeout", "200", str(MPIEXEC), "-n", "2", sys.executable, "-m",
                               "mpi4py", "-m", "experiments", "train", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    launch(tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "20")  # as if the job died after step 10's checkpoint
    assert "resumed from step 10" in launch(tmp_path / "cut", "--resume").stdout
    want, _ = checkpoint.load_checkpoint(str(tmp_path / "full"))
    got, meta = checkpoint.load_checkpoint(str(tmp_path / "cut"))
    assert meta["step"] == 20 and want.keys() == got.keys()
    for key in want:
        assert (want[key] == got[key]).all(), key


@pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                    reason="needs the `mpi` extra in this venv (make test installs it)")
@pytest.mark.parametrize("strategy", ["mpi-allreduce", "dp-auto"])
def test_a_bad_option_is_reported_once_per_job(tmp_path, strategy):
    env = mpi_env()
    start = time.monotonic()
    proc = subprocess.run(
        ["timeout", "120", str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
         "experiments", "train", "--strategy", strategy, "--dataset", "synthetic", "--lr", "nan",
         "--steps", "1", "--no-progress", "--out", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode not in (0, 124), proc.stderr[-2000:]
    assert time.monotonic() - start < 60
    assert proc.stderr.count("--lr nan is not valid") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@needs_mpiexec
def test_the_mpi_suite_on_two_ranks():
    """tests/mpi on 2 ranks of one device each, the world the suite's multi-process tests are
    written for (launched from here, so that it runs beside the other pytest worker's files).
    Where emulated hosts can be made, the tests that tests/experiments/infra/test_cluster.py runs across them
    are left to it (`cross_host`): each runs once."""
    elsewhere = [] if WHY_NO_HOSTS is not None else [a for t in CROSS_HOST for a in ("--deselect", t)]
    proc = subprocess.run(
        ["timeout", "-s", "KILL", "600", str(MPIEXEC), "-n", "2", *RANK_PYTEST, "tests/mpi", *elsewhere],
        cwd=ROOT, env=mpi_env(JAXPAR_EXPECT_RANKS="2"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " failed" not in proc.stdout and " passed" in proc.stdout


STACK_RUN = ["--model", "stack-mlp", "--width", "32", "--depth", "4", "--dataset", "synthetic",
             "--synthetic-size", "2000", "--val-size", "0", "--batch-size", "32", "--optimizer", "sgd",
             "--lr", "0.01", "--lr-schedule", "constant", "--no-progress"]


@needs_mpiexec
@pytest.mark.parametrize("strategy", ["pipeline", "mpi-pipeline"])
def test_two_rank_pipeline_checkpoint_resumes_on_one_process_with_single(tmp_path, strategy):
    """A checkpoint of a pipeline on 2 ranks (`pipeline`: stage=2 over one jax.distributed
    mesh; `mpi-pipeline`: a stage per rank, rank 0 writing), its state gathered from both,
    resumed by `single` in one process ends where the uninterrupted 2-rank run ends."""
    import equivalence as eq
    from jaxpar import checkpoint

    run = [*STACK_RUN, "--steps", "20", "--checkpoint-every", "10"]
    proc = subprocess.run(
        ["timeout", "-s", "KILL", "300", str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
         "experiments", "train", "--strategy", strategy, *run, "--checkpoint-dir",
         str(tmp_path / "full"), "--out", str(tmp_path / "out")],
        cwd=ROOT, env=mpi_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((tmp_path / "out/result.json").read_text())["strategy"]["devices"] == 2
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "20")  # as if the job died after step 10's checkpoint
    proc = subprocess.run(
        ["timeout", "-s", "KILL", "300", sys.executable, "-m", "experiments", "train", "--strategy",
         "single", *run, "--checkpoint-dir", str(tmp_path / "cut"), "--resume",
         "--out", str(tmp_path / "one")], cwd=ROOT, env=mpi_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and "resumed from step 10" in proc.stdout, proc.stderr[-2000:]
    want, _ = checkpoint.load_checkpoint(str(tmp_path / "full"))
    got, meta = checkpoint.load_checkpoint(str(tmp_path / "cut"))
    assert meta["step"] == 20 and want.keys() == got.keys()
    eq.assert_tree_close(want, got, what="state at step 20")


def wait_for_steps(proc, events: Path, steps: int, marker: str = '"step"', within: float = 240,
                   poll: float = 0.5) -> None:
    """Until the job's --events file has logged `steps` lines holding `marker`; the job ending
    first, or `within` seconds passing, fails the test with its stderr's tail."""
    deadline = time.monotonic() + within
    while not (events.exists() and events.read_text().count(marker) >= steps):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(poll)


def _descendant(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's id
    return False


def _rank_pid(job: int, rank: int) -> int | None:
    """The process of `rank` among the descendants of `job` (this test's mpiexec)."""
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if (entry.name.isdigit() and f"PMI_RANK={rank}".encode() in environ
                    and b"experiments" in (entry / "cmdline").read_bytes()
                    and _descendant(int(entry.name), job)):
                return int(entry.name)
        except OSError:
            continue  # gone, or not ours to read
    return None


@needs_mpiexec
def test_a_killed_rank_ends_the_job_within_seconds(tmp_path):
    """SIGKILL one rank of a 2-rank `pipeline` run in the middle of training: the other does
    not wait on it forever, the job ends within seconds with an error."""
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "experiments", "train",
         "--strategy", "pipeline", *STACK_RUN, "--steps", "100000", "--events", str(events),
         "--out", str(tmp_path / "out")],
        cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        wait_for_steps(proc, events, 3)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 30
        assert proc.returncode != 0, err[-2000:]
    finally:
        if proc.poll() is None:  # only what this test started: its own mpiexec's session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
