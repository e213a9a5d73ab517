"""Device meshes: the axis names, `--mesh` parsing, CPU-device simulation.

Axis names live here and nowhere else (docs/design.md): code says `DATA`, never "data".

    make_mesh({DATA: -1, TENSOR: 2})   # -1 = whatever devices are left
"""

from __future__ import annotations

import math
import os

import numpy as np

from jaxpar.errors import MeshError  # noqa: F401  (re-exported)

DATA = "data"
TENSOR = "tensor"
STAGE = "stage"
AXES = (DATA, TENSOR, STAGE)
# On devices of several processes, the axes that talk most sit within a process (its devices
# share memory or a fast link), the rest across processes, as clusters do: tensor (two
# all-reduces per block, each step) first, then data (one gradient all-reduce per step);
# stage (point-to-point activations) is the one to cross processes.
WITHIN_FIRST = (TENSOR, DATA, STAGE)


# XLA:CPU's flag that turns its intra-op thread pool off (`--single-thread` ranks set it).
SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"


def single_threaded() -> bool:
    """True when XLA:CPU runs this process's programs on one thread (SINGLE_THREAD_FLAG)."""
    return SINGLE_THREAD_FLAG.lstrip("-") in os.environ.get("XLA_FLAGS", "")


# XLA:CPU hands 3x3 convolutions to YNNPACK by default, which runs each on one thread: on this
# project's 2-core machine a convolution of the default CNN (128x14x14x32 -> 64) took 4.1 ms
# forward, 4.0 input gradient and 8.3 kernel gradient there, against 2.2, 2.4 and 3.2 ms in
# XLA's own (Eigen) convolution over the intra-op pool; on one thread Eigen's were 4.3, 4.5 and
# 4.9 ms. The CNN step: 22.7 -> 14.4-18 ms, ResNet-8 85 -> 73 ms, the MLP (no convolutions)
# unchanged. YNNPACK keeps the rest of what XLA gives it (dots, reductions).
EIGEN_CONVOLUTIONS_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"


def accelerator_plugins() -> list[str]:
    """The accelerator backends JAX will find here (its PJRT plugins: jax[cuda13]'s
    jax_cuda13_plugin, ROCm's; a TPU's libtpu), found without starting any backend: JAX looks
    for plugins as modules of the `jax_plugins` namespace and as `jax_plugins` entry points."""
    # only to ask how jaxlib builds XLA:CPU's convolutions
    import importlib.metadata
    import importlib.util
    import pkgutil

    found = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins  # a namespace package, present only where a plugin is installed

        found += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    if importlib.util.find_spec("libtpu") is not None:
        found.append("libtpu")
    return sorted(set(found))


def cpu_backend_expected() -> bool:
    """Whether JAX's default backend in this process will be the CPU, decided before it starts
    (XLA reads XLA_FLAGS once, when it does): JAX_PLATFORMS names cpu first, or it names nothing
    and no accelerator plugin is installed. CPU-only settings (XLA:CPU flags, one pinned thread
    per rank) are made only then: on a GPU machine they would hold back the host. A machine with
    a GPU plugin but no GPU falls back to the CPU without them; JAX_PLATFORMS=cpu brings them."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_plugins()


def eigen_cpu_convolutions() -> None:
    """Run XLA:CPU convolutions on its multi-threaded Eigen path (EIGEN_CONVOLUTIONS_FLAG),
    unless XLA_FLAGS already says what YNNPACK fuses, or the backend will not be the CPU
    (`cpu_backend_expected`). Only before JAX's backend starts (XLA reads XLA_FLAGS once):
    `import jaxpar` calls it, so the CLI, the studies' processes and the tests get it; a
    program that started JAX before importing jaxpar keeps XLA's default."""
    flags = os.environ.get("XLA_FLAGS", "")
    if cpu_backend_expected() and "xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {EIGEN_CONVOLUTIONS_FLAG}".strip()


def cores_available() -> int:
    """The cores this process may run on (its affinity), which XLA sizes its thread pool to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def simulate_cpu_devices(n: int | None) -> None:
    """Ask XLA for `n` CPU devices. Must run before JAX's backend starts (first array op).

    Simulated devices share the machine's cores: they prove correctness and communication
    volume, not speed.
    """
    if n is None:
        return
    if n < 1:
        raise MeshError(f"--devices must be >= 1, got {n}")
    # imports JAX: mesh is read before the device count is set
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # backend already started with another count
        have = len(jax.devices())
        if have != n:
            raise MeshError(
                f"--devices {n} asked for after JAX started with {have} device(s); "
                "set it before any JAX work (the CLI does this for you)") from e


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,tensor=2' -> {'data': 2, 'tensor': 2}; '' -> {}."""
    axes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, size = part.partition("=")
        if not sep or name not in AXES:
            raise MeshError(
                f"--mesh {spec!r}: each entry is AXIS=SIZE with AXIS one of {', '.join(AXES)}")
        try:
            axes[name] = int(size)
        except ValueError:
            raise MeshError(f"--mesh {spec!r}: size of {name!r} must be an integer") from None
        if axes[name] == 0 or axes[name] < -1:
            raise MeshError(f"--mesh {spec!r}: sizes are >= 1, or -1 for the rest")
    return axes


def resolve_axes(axes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Fill in the one -1 axis and check the sizes multiply to `n_devices`."""
    fixed = math.prod(s for s in axes.values() if s != -1)
    free = [a for a, s in axes.items() if s == -1]
    if len(free) > 1:
        raise MeshError(f"--mesh: at most one axis may be -1, got {', '.join(free)}")
    if free:
        if n_devices % fixed:
            raise MeshError(
                f"--mesh: fixed axes use {fixed} devices, which does not divide the {n_devices} "
                "present; change --mesh or --devices")
        axes = {**axes, free[0]: n_devices // fixed}
    total = math.prod(axes.values())
    if total != n_devices:
        raise MeshError(
            f"--mesh {format_mesh(axes)} needs {total} devices but {n_devices} are in use; make the "
            f"sizes multiply to {n_devices}, or set --devices {total}")
    return axes


def make_mesh(axes: dict[str, int], devices=None):
    """A `jax.sharding.Mesh` over `devices` (default: all) with the given axis sizes.

    Built with `Mesh(...)` rather than `jax.make_mesh`, whose Explicit axes make unsharded
    `shard_map` arguments fail.
    """
    # imports JAX: after the CPU devices are simulated
    import jax
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    if not axes:
        axes = {DATA: len(devices)}
    wanted = math.prod(s for s in axes.values() if s != -1)
    if wanted > len(devices):
        raise MeshError(
            f"--mesh {format_mesh(axes)} needs {wanted} devices but only {len(devices)} are "
            f"present; pass --devices {wanted} (simulated CPU devices) or shrink --mesh")
    axes = resolve_axes(axes, len(devices))
    grid = np.array(devices, dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes))


def format_mesh(axes: dict[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in axes.items())


def mesh_shape(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def arrange(axes: dict[str, int]) -> dict[str, int]:
    """`axes` ordered outermost first so that `WITHIN_FIRST`'s order holds: a mesh over
    devices numbered process by process keeps its last (innermost) axes within a process."""
    return {a: axes[a] for a in sorted(axes, key=lambda a: -WITHIN_FIRST.index(a))}


def process_layout(axes: dict[str, int], per_process: int) -> dict[str, str]:
    """Where each axis of size > 1 lies on a mesh of `axes` (outermost first) over devices
    numbered process by process, `per_process` each: 'within' a process, 'across'
    processes, or 'both' (split between the two)."""
    where, inner = {}, 1
    for axis in reversed(list(axes)):
        size = axes[axis]
        if size > 1:
            if per_process % (inner * size) == 0:
                where[axis] = "within"
            elif inner % per_process == 0:
                where[axis] = "across"
            else:
                where[axis] = "both"
        inner *= size
    return {a: where[a] for a in axes if a in where}


def describe_layout(axes: dict[str, int], processes: int, per_process: int) -> str:
    """One sentence: which axes sit within a process and which across processes."""
    where = process_layout(axes, per_process)
    parts = [f"{', '.join(a for a in where if where[a] == kind)} {text}"
             for kind, text in (("within", "within each process"), ("across", "across processes"),
                                ("both", "both within and across processes"))
             if kind in where.values()]
    return (f"mesh {format_mesh(axes)} on {processes} processes x {per_process} device(s): "
            f"{'; '.join(parts) or 'one device'}")
