"""What a lent GPU node lacks, carried to it with the working tree: it has no network.

The node (Python 3.12, jax + CUDA plugin, flax, optax, orbax, torch, mpi4py; docs/machines.md)
lacks oneDNN's wheels, so `--conv-impl auto` would fall back to the slower "cpu" forms on its
CPU and the CPU rows would not measure what this machine measures; and it lacks mpi4jax, so the
rank points are skipped. `prepare` downloads them here into an ignored folder that the device
tool's `carry` sends; on the node, experiments/infra/measure_node.sh runs `install` and `check`
before measuring anything.

    python -m experiments.infra.node_carry prepare [--carry .node-carry] [--no-mpi]   # here, online
    python -m experiments.infra.node_carry size [--carry .node-carry]    # tree + carry <= 64 MiB?
    python -m experiments.infra.node_carry install [--carry .node-carry] # on the node (pip --no-deps)
    python -m experiments.infra.node_carry check                         # on the node: auto -> onednn?

oneDNN's library wheel ships libdnnl.so three times over (a wheel holds no links): `prepare`
keeps libdnnl.so.3, the one jaxpar links and loads, byte for byte as upstream's RECORD hashes it,
and drops the two copies, so the wheels take 13 MB instead of 39 (the tree is ~15 MB). MPI is
best effort: MPICH's wheel, nanobind and mpi4jax's sources are carried and mpi4jax is built on
the node with its C compiler; where that fails, `install` says so and the rank points are
skipped. This module imports nothing of jaxpar at the top: `check` must set JAX_PLATFORMS
before jaxpar's import reads it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from experiments.cli import node_carry_arguments

CARRY = ".node-carry"           # ignored (.gitignore); the device tool's `carry` names it
LIMIT_BYTES = 64 * 2**20        # what one device call takes: the tree and every carried path
MANIFEST = "MANIFEST.json"
NODE_PYTHON = "3.12"
# Wheels' platform tags a manylinux x86-64 node with glibc >= 2.28 runs.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# The MPI side, pinned to the versions `make test` builds and tests here.
MPI_WHEELS = ("mpich==5.0.2", "nanobind==3.1.0", "wheel==0.48.0")
MPI4JAX = "mpi4jax==0.9.1.post2"
KEPT_LIBRARY = "libdnnl.so.3"   # the soname: what jaxpar/models/onednn.py links and loads
PIP_TIMEOUT_S = 600
MPI4JAX_BUILD_TIMEOUT_S = 90    # of the node's device time: a failed build must not eat it
FIX = ("run `python -m experiments.infra.node_carry prepare` on a machine with network, pass "
       f"{CARRY} in the device tool's carry, and let experiments/infra/measure_node.sh install it")


class CarryError(Exception):
    """A carry that cannot be prepared, installed or used; the message names the fix."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- here: prepare, size ---------------------------------------------------------------------
def _pip_download(folder: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CarryError(f"pip download ran past {PIP_TIMEOUT_S} s ({' '.join(args[-3:])}); "
                         "check the network to PyPI and run prepare again") from None
    if done.returncode:
        raise CarryError(f"pip download failed ({' '.join(args[-3:])}): {done.stderr[-800:]}")


def _wheels(folder: Path, requirements: tuple[str, ...]) -> None:
    """Binary wheels of `requirements` for the node's Python and platform."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    _pip_download(folder, "--only-binary=:all:", "--python-version", NODE_PYTHON, *platforms,
                  *requirements)


def trim_library_wheel(wheel: Path) -> dict:
    """Rewrite `wheel` (onednn-cpu-gomp's) with one copy of the library, KEPT_LIBRARY, and its
    RECORD without the copies dropped; returns what was done, for the manifest."""
    upstream = sha256(wheel)
    trimmed = wheel.with_suffix(".trim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        dropped = [n for n in names if "/lib/libdnnl.so" in n and not n.endswith("/" + KEPT_LIBRARY)]
        if not any(n.endswith("/lib/" + KEPT_LIBRARY) for n in names):
            raise CarryError(f"{wheel.name} holds no lib/{KEPT_LIBRARY}; oneDNN's wheel changed")
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if line.split(",")[0] not in dropped).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(trimmed, wheel)
    return {"wheel": wheel.name, "upstream_sha256": upstream, "kept": KEPT_LIBRARY,
            "dropped": [n.rsplit("/", 1)[1] for n in dropped]}


def prepare(carry: Path, mpi: bool = True) -> dict:
    """Download what the node lacks into `carry` (replaced whole, never left half-made)."""
    # imports JAX: the pin is onednn.py's, asked only when preparing
    from jaxpar.models.onednn import ONEDNN_PACKAGES, VERSION

    part = carry.with_name(carry.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    (part / "onednn").mkdir(parents=True)
    _wheels(part / "onednn", tuple(f"{p}=={VERSION}" for p in ONEDNN_PACKAGES))
    library = next((part / "onednn").glob(ONEDNN_PACKAGES[1].replace("-", "_") + "-*.whl"))
    trimmed = trim_library_wheel(library)
    if mpi:
        (part / "mpi").mkdir()
        _wheels(part / "mpi", MPI_WHEELS)
        # Its sources alone (it ships none other); its build needs are the node's own.
        _pip_download(part / "mpi", f"--no-binary={MPI4JAX.split('==')[0]}", MPI4JAX)
    files = {p.relative_to(part).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(part.rglob("*")) if p.is_file()}
    manifest = {"prepared": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": NODE_PYTHON,
                "onednn": VERSION, "trimmed": trimmed, "mpi": mpi, "files": files}
    (part / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(carry, ignore_errors=True)
    os.replace(part, carry)
    return manifest


def tree_bytes(root: Path) -> int:
    """The bytes the device tool sends besides the carry: tracked files and untracked ones
    git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout.decode().split("\0")
    return sum((root / name).stat().st_size for name in listed if name and (root / name).is_file())


def size(carry: Path, root: Path = Path(".")) -> tuple[int, int]:
    """(the tree's bytes, the carry's bytes): what one device call sends, against LIMIT_BYTES."""
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    return tree_bytes(root), carried


# --- on the node: install, check -------------------------------------------------------------
def read_manifest(carry: Path) -> dict:
    """The carry's manifest, every file in it present with its bytes; CarryError naming the fix."""
    try:
        manifest = json.loads((carry / MANIFEST).read_text())
    except (OSError, ValueError):
        raise CarryError(f"{carry} holds no prepared carry ({MANIFEST} missing or damaged): "
                         f"{FIX}") from None
    for name, info in manifest["files"].items():
        path = carry / name
        if not path.is_file() or sha256(path) != info["sha256"]:
            raise CarryError(f"{path} is missing or differs from {MANIFEST}: {FIX}")
    if not any(n.startswith("onednn/") for n in manifest["files"]):
        raise CarryError(f"{carry} carries no oneDNN wheels: {FIX}")
    return manifest


def _installed(wheel: Path) -> bool:
    """Whether the package of `wheel` is installed here at the wheel's version."""
    name, version = wheel.name.split("-")[:2]
    try:
        return importlib.metadata.version(name.replace("_", "-")) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def _pip_install(paths: list[Path], env: dict | None = None, timeout: float = PIP_TIMEOUT_S,
                 extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """pip install of `paths` into this Python, from those files alone (no index, no deps)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
           "--quiet", *extra, *map(str, paths)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def install_carry(carry: Path) -> list[str]:
    """Install the carried oneDNN wheels (pip --no-deps, from the files alone) and, where they
    build, MPICH and mpi4jax; a line per step. CarryError when oneDNN cannot be installed."""
    read_manifest(carry)
    wheels = sorted((carry / "onednn").glob("*.whl"))
    missing = [w for w in wheels if not _installed(w)]
    if missing:
        done = _pip_install(missing)
        if done.returncode:
            raise CarryError(f"pip could not install the carried oneDNN wheels: {done.stderr[-800:]}")
    lines = [f"oneDNN: {'installed' if missing else 'already installed'} "
             f"({', '.join(w.name for w in wheels)})"]
    return lines + [install_mpi(carry / "mpi")]


def install_mpi(folder: Path) -> str:
    """MPICH's wheel and mpi4jax built from its carried sources, best effort: one line saying
    what happened (rank points need them; the rest of the measurement does not)."""
    try:
        importlib.metadata.version("mpi4jax")
        return "mpi4jax: already installed"
    except importlib.metadata.PackageNotFoundError:
        pass
    sdist = sorted(folder.glob("mpi4jax-*.tar.gz"))
    if not sdist:
        return "mpi4jax: not carried (prepared with --no-mpi): the rank points are skipped"
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "mpi4jax: not built (no C compiler on this node): the rank points are skipped"
    wheels = [w for w in sorted(folder.glob("*.whl")) if not _installed(w)]
    if wheels and (done := _pip_install(wheels)).returncode:
        return f"mpi4jax: not built (MPICH's wheel did not install: {done.stderr[-300:]})"
    with tempfile.TemporaryDirectory() as no_cuda:  # a CPU build: rank points run on the CPU
        env = {"MPI4JAX_BUILD_MPICC": str(Path(sys.executable).parent / "mpicc"), "CUDA_PATH": no_cuda}
        try:
            done = _pip_install(sdist, env, MPI4JAX_BUILD_TIMEOUT_S, ("--no-build-isolation",))
        except subprocess.TimeoutExpired:
            return f"mpi4jax: not built (its build ran past {MPI4JAX_BUILD_TIMEOUT_S} s)"
    if done.returncode:
        return f"mpi4jax: not built from its carried sources: {done.stderr.strip()[-300:]}"
    probe = subprocess.run([sys.executable, "-c", "import mpi4jax"], capture_output=True, text=True,
                           timeout=120)
    return ("mpi4jax: built from its carried sources" if probe.returncode == 0 else
            f"mpi4jax: built but does not import: {probe.stderr.strip()[-300:]}")


def check() -> str:
    """One line naming oneDNN's version and ISA when `--conv-impl auto` resolves to oneDNN on
    this machine's CPU; CarryError naming the fix otherwise. JAX_PLATFORMS must be "cpu"
    before jaxpar is imported (its import reads it), as `main` sets it."""
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        raise CarryError("check the CPU: run it with JAX_PLATFORMS=cpu (experiments/infra/measure_node.sh does)")
    # imports JAX: the node's check only, after JAX_PLATFORMS is set
    from jaxpar.models import layers, onednn

    resolved = layers.resolve_conv_impl("auto")
    if resolved != "onednn":
        raise CarryError(f"--conv-impl auto resolves to {resolved!r} on this CPU, not oneDNN "
                         f"({onednn.unavailable()}); the CPU rows would measure another "
                         f"convolution than every other machine's: {FIX} (and give the node a C++ "
                         "compiler, c++ or $CXX, to build jaxpar's custom calls)")
    used = onednn.used()
    return f"--conv-impl auto resolves to onednn on this CPU: oneDNN {used['version']} ({used['isa']})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.infra.node_carry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    node_carry_arguments(parser, CARRY)
    args = parser.parse_args(argv)
    carry = Path(args.carry)
    try:
        if args.command == "prepare":
            manifest = prepare(carry, mpi=not args.no_mpi)
            print(f"prepared {carry}: {len(manifest['files'])} file(s)")
            return report_size(carry)
        if args.command == "size":
            return report_size(carry)
        if args.command == "install":
            print("\n".join(install_carry(carry)))
            return 0
        os.environ["JAX_PLATFORMS"] = "cpu"
        print(check())
        return 0
    except CarryError as e:
        print(f"node_carry {args.command}: {e}", file=sys.stderr)
        return 2


def report_size(carry: Path) -> int:
    """Print the tree's and the carry's size against LIMIT_BYTES; 1 when over."""
    if not (carry / MANIFEST).is_file():
        print(f"{carry} is not prepared: {FIX}", file=sys.stderr)
        return 2
    tree, carried = size(carry)
    total = tree + carried
    print(f"tree {tree / 2**20:.1f} MiB + carry {carried / 2**20:.1f} MiB = {total / 2**20:.1f} MiB "
          f"of the {LIMIT_BYTES / 2**20:.0f} MiB a device call takes")
    return 0 if total <= LIMIT_BYTES else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
