"""Test set-up: 8 simulated CPU devices, chosen once before JAX's backend starts.

Tests that need another device count run in a subprocess (`run_cli`); tests that need more
devices than present skip with a reason that says how to get them.
"""

import os
import subprocess
import sys
from pathlib import Path

import jaxpar  # noqa: F401  (sets XLA_FLAGS before JAX's backend starts, as the CLI does)
import jax

N_DEVICES = int(os.environ.get("JAXPAR_TEST_DEVICES", "8"))
jax.config.update("jax_num_cpu_devices", N_DEVICES)

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# tests/mpi runs only under an MPI launcher (mpiexec -n 2 ... pytest tests/mpi, see Makefile):
# one device per rank, and a world of size 1 would prove nothing.
if not (os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")):
    collect_ignore = ["mpi"]


def requires_devices(n: int):
    """Skip unless `n` devices exist (set JAXPAR_TEST_DEVICES=n to simulate more)."""
    return pytest.mark.skipif(
        len(jax.devices()) < n,
        reason=f"needs {n} devices; run with JAXPAR_TEST_DEVICES={n} to simulate them")


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m experiments ARGS` in a fresh process (its own device count), bounded in time."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
