"""C++ sources that XLA:CPU calls (FFI custom calls), built by the machine's compiler on first use.

    path = native.build_library(SOURCE, flags=["-ldnnl"])   # the cached library, or native.Unavailable

Built once per source, flags and jaxlib version into $JAXPAR_CACHE or ~/.cache/jaxpar (a few
seconds), written under a temporary name and renamed, so processes building at once never load
a half-written library. Used by jaxpar/parallel/transport/p2p.py (messages between processes) and
jaxpar/models/onednn.py (oneDNN's convolutions).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from jaxpar import data as datalib

BUILD_TIMEOUT_S = 300


class Unavailable(RuntimeError):
    """A native library cannot be built or loaded here (the message says why)."""


def build_library(source: Path, flags: tuple[str, ...] = ()) -> Path:
    """`source` compiled into a shared library in the cache; `flags` go after the source
    (include folders, libraries to link)."""
    # imports JAX: only when a library is built
    import jax
    import jaxlib

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise Unavailable(f"no C++ compiler (c++ or g++; or set CXX) to build {source.name}")
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()
                         + jaxlib.__version__.encode()).hexdigest()[:16]
    out = Path(datalib.cache_root()) / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.part")
    command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
               f"-I{jax.ffi.include_dir()}", str(source), *flags, "-o", str(partial)]
    try:
        built = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"building {source.name} failed ({' '.join(command)}): {e}") from e
    if built.returncode:
        partial.unlink(missing_ok=True)
        raise Unavailable(f"building {source.name} failed ({' '.join(command)}): "
                          f"{built.stderr[-500:]}")
    os.replace(partial, out)
    return out


def register(library: Path, targets: dict[str, str]) -> ctypes.CDLL:
    """Load `library` and register its FFI handlers with XLA:CPU: {target name: symbol}."""
    # imports JAX: only when a library is registered
    import jax

    try:
        lib = ctypes.cdll.LoadLibrary(str(library))
    except OSError as e:
        raise Unavailable(f"loading {library.name} failed: {e}") from e
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib
