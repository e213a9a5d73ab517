"""glibc's malloc told to keep freed memory, so XLA:CPU's per-step buffers stop costing page faults.

XLA:CPU allocates each execution's temporaries as one block (ResNet-8's step at batch 128: 68 MB),
from the thread that starts the execution. glibc serves a block that large with a fresh `mmap`
(above its mmap threshold, which it never raises past 32 MB; and from a thread's own arena,
whose heaps hold at most 64 MB) and returns it with `munmap` when the step ends, so every step
the kernel maps and zero-fills it again: 16,563 page faults per ResNet step, measured, and
~13 ms of a ~75 ms step on this project's 2-core machine. `keep_freed_memory` makes every thread
allocate from the main heap (one arena), never by mmap, and keep up to `KEEP_BYTES` freed at its
top, as PyTorch's CPU guides get by preloading jemalloc or tcmalloc: 0 faults a step after the
first. The heap still grows by a fresh block in a few early calls, then stops (a 49 MB temporary,
300 calls: 1-4 such calls, all in the first 70; fewer with 10 ms idle after each call, so
likely a call allocating before the last one's block is freed). Set JAXPAR_MALLOC=default to
leave glibc's settings alone.

It must run before the threads that allocate (JAX's) first call malloc: `import jaxpar` calls
it, on a CPU backend only (`mesh.cpu_backend_expected`).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30
_state = "glibc defaults"


def keep_freed_memory() -> str:
    """Apply the settings (once per process) and return what holds now (`state`)."""
    global _state
    if os.environ.get("JAXPAR_MALLOC") == "default":
        _state = "glibc defaults (JAXPAR_MALLOC=default)"
        return _state
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = all(libc.mallopt(param, value) == 1 for param, value in (
            (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_BYTES)))
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to change
        done = False
    _state = "kept (one arena, no mmap, 1 GiB kept on free)" if done else "allocator defaults (not glibc)"
    return _state


def state() -> str:
    """How this process's malloc is set, for results' environment."""
    return _state
