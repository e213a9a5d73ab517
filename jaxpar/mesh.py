"""Device meshes: the axis names, `--mesh` parsing, CPU-device simulation.

Axis names live here and nowhere else (docs/design.md): code says `DATA`, never "data".

    make_mesh({DATA: -1, TENSOR: 2})   # -1 = whatever devices are left
"""

from __future__ import annotations

import math

import numpy as np

from jaxpar.errors import MeshError  # noqa: F401  (re-exported)

DATA = "data"
TENSOR = "tensor"
STAGE = "stage"
AXES = (DATA, TENSOR, STAGE)


def simulate_cpu_devices(n: int | None) -> None:
    """Ask XLA for `n` CPU devices. Must run before JAX's backend starts (first array op).

    Simulated devices share the machine's cores: they prove correctness and communication
    volume, not speed.
    """
    if n is None:
        return
    if n < 1:
        raise MeshError(f"--devices must be >= 1, got {n}")
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
