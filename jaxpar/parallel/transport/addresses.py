"""Where this process is reachable by the others of a jax.distributed run, and swapping such
addresses: what `transfers` (the transfer servers) and `p2p` (in-program sockets) connect by.

    host = local_address()                 # "10.0.0.2" on an emulated host, "127.0.0.1" alone
    every = exchange(f"{host}:{port}")     # every process's, by process index (a collective)
    every_process(np.float64(x))           # any array of one shape on all, stacked
"""

from __future__ import annotations

import socket

import numpy as np

_ADDRESS_BYTES = 128


def local_address() -> str:
    """This host's address on the route to the jax.distributed coordinator (emulated or real
    hosts reach each other there; IPv6 in brackets)."""
    from jax._src import distributed  # the coordinator's address is not public API

    host = (distributed.global_state.coordinator_address or "127.0.0.1:0").rsplit(":", 1)[0]
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: picks the route, sends nothing
        address = probe.getsockname()[0]
    return f"[{address}]" if family == socket.AF_INET6 else address


def every_process(value: np.ndarray) -> np.ndarray:
    """Every process's `value` (one shape and dtype on all), stacked by process index. A
    collective: every process calls it at the same point."""
    # only under jax.distributed
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(value), tiled=False))


def exchange(address: str) -> tuple[str, ...]:
    """Every process's `address` (or any short text), by process index. A collective: every
    process calls it at the same point."""
    mine = np.zeros(_ADDRESS_BYTES, np.uint8)
    encoded = address.encode()[:_ADDRESS_BYTES]  # a longer text (a reason) is cut short
    mine[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    return tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in every_process(mine))


def split(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), the host without brackets."""
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)
