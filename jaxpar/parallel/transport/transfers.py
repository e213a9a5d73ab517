"""Point-to-point array transfers between processes on a CPU backend (`jax.experimental.transfer`).

XLA:CPU has no cross-host `device_put`. A collective-permute over the two devices' mesh moves
an array, but it is a program both processes queue and run together: the sender's next
slot waits until the receiver reaches the same point of its own queue, so host-driven
pipeline stages took turns (CNN, 2 ranks: 56-58 ms against one rank's 49.5). Each process
here runs a transfer server instead; the sender offers the array (`await_pull`, which returns
at once and serves it when it is computed) and the receiver pulls it, getting at once an
array its next program can be dispatched on. Neither process waits for the other's queue.
(A pipeline with one stage per process sends inside its one program per process instead:
`p2p`, `pipeline.host.column`; these moves remain for the host walk's other uses and layouts.)

Every process calls `move_across` at the same points (as `processes.move` requires), so the
transfers' ids, a counter, agree without a message. Servers start at the first transfer and
swap addresses through one `process_allgather`.

    y = transfers.move_across(x, src, dst)  # on src's process offered (None), on dst's pulled
    transfers.settle()                       # before a collective: every transfer arrived
"""

from __future__ import annotations

import datetime
import functools

import jax

from jaxpar.parallel.transport import addresses

# Passed to each pull and to `settle`'s barrier. The pull's own timeout did not end a wait
# here (an id never offered: still waiting 30 s after a 2 s timeout); what bounds a wait for
# a rank that died or went silent is the watchdog (--collective-timeout, `runtime.watchdog`),
# behind it jax.distributed's heartbeat timeout and the launcher (`distributed`).
PULL_TIMEOUT = datetime.timedelta(minutes=5)
_count = 0  # transfers so far: the next one's id
_pulled: list[jax.Array] = []  # pulled here since the last `settle`
_settled = 0  # `_count` at the last `settle`


def wanted() -> bool:
    """Transfers replace the collective-permute on the CPU backend (on GPUs a permute rides
    NCCL, device to device)."""
    return jax.default_backend() == "cpu"


def move_across(x: jax.Array, src, dst):
    """`x` (on device `src`) on device `dst` of another process: offered by `src`'s process,
    pulled by `dst`'s; None on every other process, which only counts the transfer."""
    global _count
    _addresses()  # the first call, on every process together, swaps the servers' addresses
    uuid, _count = _count, _count + 1
    here = jax.process_index()
    if src.process_index == here:
        _server().await_pull(uuid, [x])
        return None
    if dst.process_index != here:
        return None
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(dst))
    (y,) = _connection(src.process_index).pull(uuid, [spec],
                                               timeout=datetime.datetime.now() + PULL_TIMEOUT)
    _pulled.append(y)
    return y


def settle() -> None:
    """Return once every transfer so far has arrived, on every process; all call it at the
    same point, before queueing anything that may wait for the others (a collective).

    XLA:CPU starts a program once its inputs are ready, not in the order dispatched: a
    collective could start, hold the threads while it waits for the other processes, and
    the array another process is still pulling from here would never be served (seen: 2
    devices per process, a walk, then `fetch`). Each process waits for what it pulled, then
    all meet at a barrier of the coordination service (no device program)."""
    global _settled
    if _count == _settled:
        return
    jax.block_until_ready(_pulled)
    _pulled.clear()
    from jax._src import distributed  # the coordination service's barrier is not public API

    distributed.global_state.client.wait_at_barrier(f"jaxpar_transfers_{_count}",
                                                    int(PULL_TIMEOUT.total_seconds() * 1000))
    _settled = _count


def count() -> int:
    """Transfers this process has taken part in or counted: equal on every process."""
    return _count


@functools.lru_cache(maxsize=None)
def _server():
    """This process's server, on the interface that reaches the coordinator (emulated or
    real hosts reach each other there)."""
    # JAX's transfer servers: only between processes on CPU
    from jax.experimental import transfer

    host = addresses.local_address()
    return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


@functools.lru_cache(maxsize=None)
def _addresses() -> tuple[str, ...]:
    """Every process's server address, by process index (a collective: all call it first
    together, from the first transfer)."""
    return addresses.exchange(_server().address())


@functools.lru_cache(maxsize=None)
def _connection(process: int):
    return _server().connect(_addresses()[process])
