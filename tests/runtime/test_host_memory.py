"""XLA:CPU's per-execution buffers reuse memory instead of faulting fresh pages in each step
(jaxpar/runtime/host_memory.py, set by `import jaxpar`). Each measurement runs in a fresh process, as
a training process starts (a long-lived test worker's heap is fragmented by earlier tests).

    python -m pytest -q tests/runtime/test_host_memory.py
"""

import os
import subprocess
import sys

# A 49 MB temporary (the matrix the dot reads): above glibc's largest mmap threshold, so
# without the settings each call maps it afresh and the kernel zero-fills it, a fault per
# 4 KiB page (~12,000 a call).
PROGRAM = """
import resource, statistics
import jaxpar, jax, jax.numpy as jnp
from jaxpar.runtime import host_memory
step = jax.jit(lambda x: jnp.dot(jnp.tanh(jnp.outer(x, x)), x).sum())
x = jnp.linspace(0.0, 1.0, 3500, dtype=jnp.float32)
step(x).block_until_ready(); step(x).block_until_ready()
faults = []
for _ in range(CALLS):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(host_memory.state(), "|", statistics.median(faults))
"""
CALLS = 15


def faults_per_call(malloc: str) -> tuple[str, float]:
    """What the process's malloc settings were and the median page faults of a call: kept, the
    heap still grows by a fresh block in a few early calls (host_memory.py), so not the mean."""
    env = {**os.environ, "JAXPAR_MALLOC": malloc, "JAX_PLATFORMS": "cpu"}
    program = PROGRAM.replace("CALLS", str(CALLS))
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    state, faults = out.split(" | ")
    return state, float(faults)


def test_a_large_temporary_faults_once_not_every_execution():
    state, kept = faults_per_call("keep")
    default_state, default = faults_per_call("default")
    assert state.startswith("kept") and default_state.startswith("glibc defaults")
    assert default > 5000, f"without the settings {default:.0f} faults a call: the test no longer sees the block"
    assert kept < 0.01 * default, f"{kept:.0f} page faults a call kept against {default:.0f} with glibc's defaults"
