"""Two forms of the all-gathers and reduce-scatters of the CNN's tensor split, chosen per
mesh the way `--conv-impl` chooses convolutions: the same results, different collectives.

- `NATIVE`: `lax.all_gather`, `lax.psum_scatter` and `lax.psum`, one XLA collective each.
- `PERMUTE`: the same results from `lax.ppermute` alone, N - 1 permutes of one shard each on
  an N-device axis (each device sends every other device its shard directly, as a ring's
  steps would, and places or adds what arrives by the sender's index); their transposes
  are permutes too.

Why: across jax.distributed processes on CPU, XLA's gloo all-gather and all-reduce cost a
few milliseconds whatever their size, its permutes and reduce-scatters a fraction of one.
Measured (jax 0.10.2, 2 processes of one CPU device, 4 KB per device, median of 30 calls):
all-gather 3.9 ms, all-reduce 1.6 ms, reduce-scatter 0.21 ms, permute + add 0.28 ms; at
1 MB 3.9, 3.5, 1.9 and 2.0 ms (the profile's `distributed` entries show the same ~4 ms
floor). The CNN's split runs three all-gathers a step (two forward, the reduce-scatter's
transpose backward) and the loss denominator's all-reduce: `PERMUTE` replaces them there.
Within one process XLA's own collectives are the fast ones, so `NATIVE` stays the choice
(and on GPUs, where NCCL's are). Tried and left native: `fsdp`'s parameter gathers in this
form across 2 processes (58-78 ms a step against 64-84 ms, within the machine's spread).
These were measured before jaxpar put gloo's polling thread under SCHED_IDLE
(`jaxpar/runtime/gloo_poller.py`: a 4 KB psum across 2 pinned processes 4.0 -> 0.2 ms); since, the
CNN's 2-rank step measured 28.3-29.3 ms with `PERMUTE` against 30.8-30.9 with `NATIVE` (two
alternations, one session): `PERMUTE` stays.

    comm = choose(mesh)                          # PERMUTE across CPU processes, else NATIVE
    h = comm.all_gather(h, TENSOR, axis=0)       # inside shard_map, tiled like lax.all_gather
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Comm(NamedTuple):
    name: str
    all_gather: Callable      # (x, axis_name, axis) -> the shards concatenated along `axis`
    psum_scatter: Callable    # (x, axis_name, axis) -> this device's block of the sum
    total: Callable           # (x, axis_name) -> the sum over the axis, typed varying


def _shift(axis_name, k: int) -> list[tuple[int, int]]:
    """Every device sends to the device k places after it."""
    n = lax.axis_size(axis_name)
    return [(j, (j + k) % n) for j in range(n)]


def _permute_all_gather(x: jax.Array, axis_name, axis: int) -> jax.Array:
    n, i, size = lax.axis_size(axis_name), lax.axis_index(axis_name), x.shape[axis]
    out = jnp.zeros((*x.shape[:axis], n * size, *x.shape[axis + 1:]), x.dtype)
    out = lax.dynamic_update_slice_in_dim(out, x, i * size, axis)
    for k in range(1, n):
        theirs = lax.ppermute(x, axis_name, _shift(axis_name, k))  # from device i - k
        out = lax.dynamic_update_slice_in_dim(out, theirs, ((i - k) % n) * size, axis)
    return out


def _permute_psum_scatter(x: jax.Array, axis_name, axis: int) -> jax.Array:
    n, i = lax.axis_size(axis_name), lax.axis_index(axis_name)
    size = x.shape[axis] // n
    block = lambda j: lax.dynamic_slice_in_dim(x, j * size, size, axis)  # noqa: E731
    out = block(i)
    for k in range(1, n):  # device j sends device j + k its block of j's partial sums
        out = out + lax.ppermute(block((i + k) % n), axis_name, _shift(axis_name, k))
    return out


def _permute_total(x: jax.Array, axis_name) -> jax.Array:
    n = lax.axis_size(axis_name)
    return sum((lax.ppermute(x, axis_name, _shift(axis_name, k)) for k in range(1, n)), start=x)


NATIVE = Comm(
    "native",
    lambda x, axis_name, axis: lax.all_gather(x, axis_name, axis=axis, tiled=True),
    lambda x, axis_name, axis: lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True),
    lambda x, axis_name: lax.psum(x, axis_name))

PERMUTE = Comm("permute", _permute_all_gather, _permute_psum_scatter, _permute_total)


def choose(mesh) -> Comm:
    """`PERMUTE` on a CPU mesh spanning several processes (gloo's slow all-gather and
    all-reduce), `NATIVE` otherwise."""
    devices = list(mesh.devices.flat)
    processes = {d.process_index for d in devices}
    return PERMUTE if len(processes) > 1 and devices[0].platform == "cpu" else NATIVE
