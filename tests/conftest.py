"""Test set-up: 8 simulated CPU devices, chosen once before JAX's backend starts.

Tests that need another device count run in a subprocess (`run_cli`); tests that need more
devices than present skip with a reason that says how to get them.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# One XLA compilation cache for the whole test session, its subprocesses included (they
# inherit the environment): the suite compiles the same small programs many times over (each
# strategy's reference `single`, the quick studies' points), and compiling is most of its
# time on 2 cores. Fresh per session, so no stale executable outlives a change; every
# program is cached, however quick to compile.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The suite compiles far more than it runs (small models, a few steps each), so it builds its
# programs the quick way: XLA:CPU's elemental emitters instead of its MLIR fusion emitters, LLVM
# at optimisation level 0 (measured on 2 cores: test_layer_split, test_gems and test_hybrid
# 2:04 with the level alone, 1:12 with both; the whole suite 21:55 -> 16:10 -> 10:22), and each
# program's code generated as one LLVM module rather than split into parts for a thread pool
# (the parts' set-up cost more than the threads gave back with two workers on 2 cores: a small
# program's compile took half the CPU time, test_every_schedule's CNN and stack-mlp cases 91 ->
# 72 CPU seconds). Results move only by rounding, and every comparison is between programs
# built alike: subprocesses inherit XLA_FLAGS, and the MPI launches that replace it pass
# TEST_XLA_FLAGS. Benchmarks and studies keep XLA's defaults, as do the commands
# tests/test_install_light.py runs (a bench step and the machine command, compiled the default
# way). XLA aborts on a flag it does not know, so a jaxlib without one of the switches is asked
# first (once: subprocesses inherit the answer).
FAST_COMPILE = "--xla_backend_optimization_level=0"
SWITCHES = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_knows(*flags: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"},
                           timeout=120)
    return probe.returncode == 0


def _known_switches() -> list[str]:
    """SWITCHES this jaxlib knows: all of them at once (one probe), else each asked alone."""
    return list(SWITCHES) if _xla_knows(*SWITCHES) else [f for f in SWITCHES if _xla_knows(f)]


if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):  # else a parent test process chose
    wanted = [FAST_COMPILE, *_known_switches()]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *wanted]).strip()
TEST_XLA_FLAGS = " ".join(f for f in (FAST_COMPILE, *SWITCHES) if f in os.environ["XLA_FLAGS"].split())

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


@pytest.fixture(scope="module")
def machine_wide():
    """Held for the whole module by the files that use machine-wide state (one emulated
    cluster, one SLURM cluster): under `pytest -n 2 --dist loadfile` (make test) their files
    may land on different workers, and they take turns. Bounded: a file that waits past
    15 minutes fails, naming the lock."""
    import fcntl
    import time

    with open(Path(tempfile.gettempdir()) / "jaxpar-tests-machine-wide.lock", "w") as lock:
        deadline = time.monotonic() + 900
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{lock.name} held by another test process for 15 minutes")
                time.sleep(1)
        yield


def pytest_collection_modifyitems(config, items):
    import scheduling

    scheduling.sort_longest_first(items)


@pytest.hookimpl(optionalhook=True)  # only where pytest-xdist is loaded
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile`: the units and order of tests/scheduling.py."""
    if config.getvalue("dist") == "loadfile":
        import scheduling

        return scheduling.LongestFirst(config, log)
    return None
