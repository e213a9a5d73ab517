"""XLA:CPU's per-execution buffers reuse memory instead of faulting fresh pages in each step
(jaxpar/host_memory.py), as `import jaxpar` (conftest's first import) set it up.

    python -m pytest -q tests/test_host_memory.py
"""

import resource

import jax
import jax.numpy as jnp
import pytest

from jaxpar import host_memory


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not host_memory.state().startswith("kept"),
                    reason=f"malloc not set here: {host_memory.state()}")
def test_a_large_temporary_does_not_fault_every_execution():
    # A 49 MB temporary (the matrix the dot reads): above glibc's largest mmap threshold, so
    # without the settings each call maps it afresh and the kernel zero-fills it, a fault
    # per 4 KiB page.
    step = jax.jit(lambda x: jnp.dot(jnp.tanh(jnp.outer(x, x)), x).sum())
    x = jnp.linspace(0.0, 1.0, 3500, dtype=jnp.float32)
    step(x).block_until_ready()
    step(x).block_until_ready()
    before = minor_faults()
    for _ in range(5):
        step(x).block_until_ready()
    per_call = (minor_faults() - before) / 5
    assert per_call < 1000, f"{per_call:.0f} page faults per execution (a fresh block each: ~12,000)"
