"""Arrays on one jax.distributed global mesh: placing host data, moving between processes.

Under `jax.distributed` every process runs the same program on the devices it owns. These
helpers let a strategy written for one process run on such a mesh:

- `place`: host arrays -> arrays of any sharding; each process writes only its own shards
  (every rank reads the same data, so each takes its own rows or its own blocks);
- `move`: an array on one device -> another device, when they belong to different processes
  on CPU a point-to-point transfer (`transfers`: the CPU backend has no cross-host
  `device_put`), elsewhere a two-device collective-permute;
- `fetch_held`: host copies of arrays some of which live on other processes' devices only.

    state = place(ref_state, shardings)
    x = move(x, next_stage_device)
    params = fetch_held(state.params)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxpar.mesh import STAGE
from jaxpar.parallel import layout
from jaxpar.parallel.transport import addresses, transfers


def many() -> bool:
    """True when this run spans several processes (one jax.distributed global mesh)."""
    return jax.process_count() > 1


def place(tree, shardings):
    """Host (numpy or process-local) arrays -> arrays laid out by `shardings`.

    Args:
      tree: a pytree of arrays, the same global value on every process.
      shardings: one Sharding for every leaf, or a pytree of them matching `tree`.
    """
    if not many():
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: _place_one(x, shardings), tree)
    return jax.tree.map(_place_one, tree, shardings)


def _place_one(x, sharding):
    # make_array_from_callback asks only for this process's shards: a process never copies
    # rows or blocks that live on another process's devices.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                        dtype=host.dtype)


def owns(device) -> bool:
    """True when `device` belongs to this process."""
    return device.process_index == jax.process_index()


def home_device(x: jax.Array):
    """The one device a single-device array lives on."""
    (device,) = x.sharding.device_set
    return device


def move(tree, dst):
    """`tree`'s arrays (each on one device) on device `dst`; every process calls it at the
    same point.

    Within a process a `device_put`. Across processes on CPU a transfer (`transfers`: the
    two processes alone, neither waits for the other's queue), elsewhere a collective-permute
    over the mesh of the two devices, the processes of both taking part; a process that
    holds neither gets a handle (an array with no local shard), as its later calls only pass
    it on.
    """
    return jax.tree.map(lambda x: _move_one(x, dst), tree)


def _move_one(x: jax.Array, dst) -> jax.Array:
    src = home_device(x)
    if src == dst:
        return x
    if owns(src) and owns(dst):
        return jax.device_put(x, dst)
    if src.process_index == dst.process_index:
        return handle(x.shape, x.dtype, dst)  # within another process: its device_put
    if transfers.wanted():
        moved = transfers.move_across(x, src, dst)
        return moved if owns(dst) else handle(x.shape, x.dtype, dst)
    if not (owns(src) or owns(dst)):
        return handle(x.shape, x.dtype, dst)
    mesh = Mesh(np.array([src, dst]), (STAGE,))
    local = x if owns(src) else jnp.zeros(x.shape, x.dtype, device=dst)
    pair = jax.make_array_from_single_device_arrays(
        (2, *x.shape), NamedSharding(mesh, P(STAGE)), [local[None]])
    moved = _hop(mesh)(pair)
    return moved.addressable_shards[0].data[0] if owns(dst) else handle(x.shape, x.dtype, dst)


@functools.lru_cache(maxsize=4096)
def handle(shape, dtype, device) -> jax.Array:
    """An array on another process's `device`, with no data here (nothing is allocated).
    One per shape, dtype and device, made once: a walk across processes passes on hundreds
    a step (another process's programs' outputs), and each took ~0.05 ms to make (profiled)."""
    return jax.make_array_from_single_device_arrays(shape, SingleDeviceSharding(device), [],
                                                    dtype=dtype)


@functools.lru_cache(maxsize=None)
def _hop(mesh):
    """The program that sends the first device's slab to the second (cached per pair)."""
    return jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, STAGE, [(0, 1)]), mesh=mesh,
                                 in_specs=P(STAGE), out_specs=P(STAGE)))


def fetch_held(tree):
    """Host copy of `tree`, whose arrays are parts of the one global computation (each
    process holds a view of every array, with or without data): like `layout.host_copy`, and an
    array that only some processes hold is sent to all from the first of them. Every process
    calls it at the same point, and decides from the shardings alone, so all make the same
    collective calls in the same order."""
    if not many():
        return jax.device_get(tree)
    transfers.settle()  # the collectives below may wait for arrays other processes still pull

    def one(x):
        holders = sorted({d.process_index for d in x.sharding.device_set})
        if len(holders) == jax.process_count():
            return layout.host_copy(x)
        if not x.is_fully_replicated:
            raise NotImplementedError("an array split over some processes' devices only")
        owner = holders[0]
        value = np.asarray(x.addressable_shards[0].data) if owner == jax.process_index() else \
            np.zeros(x.shape, x.dtype)
        return addresses.every_process(value)[owner]

    return jax.tree.map(one, tree)
