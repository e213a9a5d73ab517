"""Launch-level MPI checks (`jaxpar/distributed.py`) that run under plain pytest.

A failing rank ends a 2-rank job quickly with a message naming it, and a missing mpi4jax
says how to install the `mpi` extra.

    python -m pytest -q tests/test_mpi_launch.py
"""

import builtins
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def test_missing_mpi4jax_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_mpi4jax(name, *args, **kwargs):
        if name.startswith("mpi4jax"):
            raise ImportError("No module named 'mpi4jax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpi4jax)
    monkeypatch.delitem(sys.modules, "mpi4jax", raising=False)
    from jaxpar.parallel import mpi_common

    with pytest.raises(ConfigError, match="mpi` extra"):
        mpi_common.import_mpi()


@pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                    reason="needs the `mpi` extra in this venv (make test installs it)")
def test_failing_rank_ends_the_job_quickly():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXPAR_FAIL_RANK": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
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

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)

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
    want, _ = checkpoint.load(str(tmp_path / "full"))
    got, meta = checkpoint.load(str(tmp_path / "cut"))
    assert meta["step"] == 20 and want.keys() == got.keys()
    for key in want:
        assert (want[key] == got[key]).all(), key


@pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                    reason="needs the `mpi` extra in this venv (make test installs it)")
@pytest.mark.parametrize("strategy", ["mpi-allreduce", "dp-auto"])
def test_a_bad_option_is_reported_once_per_job(tmp_path, strategy):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
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
