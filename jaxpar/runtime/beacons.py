"""Who is still there: every process of a job sends each other a small UDP datagram a few
times a second (its rank and the last step it finished, or PREPARING before its training loop)
and notes when it last heard each.

The watchdog (`jaxpar.runtime.watchdog`) reads this when a wait runs past its bound, to name
the ranks and hosts that went silent (a cut link, a lost host) or the ranks behind (alive, but
stuck before the step the others wait in). UDP, not a connection: nothing to reset or
reconnect after a flap, nothing that blocks; the datagrams take the same links as the job's
own traffic (each process advertises its address on the route to rank 0's host).

    peers = Beacons.join(rank, size, exchange)   # a collective: every process at the same point
    peers.send(step); peers.receive(timeout_s)   # the watchdog's thread, a few times a second
    peers.silent(now, after_s)                   # [(rank, seconds silent)], longest first
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

_FORMAT = struct.Struct("!8siq")  # job nonce, rank, last finished step
PREPARING = -1  # the step a process sends before its loop starts (compiling, restoring)


def route_to(host: str) -> str:
    """This machine's address on the route to `host` (UDP connect: picks the route, sends
    nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


@dataclass
class Beacons:
    """This process's datagram socket and what it last heard from every other process."""

    rank: int
    hosts: list[str]                        # every process's hostname, by rank
    addresses: list[tuple[str, int]]        # every process's beacon address, by rank
    nonce: bytes                            # rank 0's: datagrams of another job are ignored
    sock: socket.socket
    heard: dict[int, float] = field(default_factory=dict)   # rank -> monotonic time last heard
    steps: dict[int, int] = field(default_factory=dict)     # rank -> last step it finished (or PREPARING)

    @classmethod
    def join(cls, rank: int, size: int, exchange: Callable[[str], list[str]]) -> Beacons:
        """Open this process's socket and learn every other's address: `exchange(text)` returns
        every process's text by rank (an MPI allgather, or jax.distributed's key-value store)."""
        hosts = exchange(socket.gethostname())
        local = cls._local_address(hosts)
        family = socket.AF_INET6 if ":" in local else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        sock.setblocking(False)
        mine = f"{os.urandom(8).hex()} {local} {sock.getsockname()[1]}"
        every = [text.split() for text in exchange(mine)]
        now = time.monotonic()
        return cls(rank, hosts, [(a, int(p)) for _, a, p in every], bytes.fromhex(every[0][0]), sock,
                   heard={r: now for r in range(size) if r != rank},
                   steps={r: PREPARING for r in range(size) if r != rank})

    @staticmethod
    def _local_address(hosts: list[str]) -> str:
        """One host: the loopback. Several: this host's address on the route to rank 0's host,
        the interface the job's own traffic takes (an emulated host's eth0); where rank 0's
        name does not resolve, the address of this host's own name."""
        if len(set(hosts)) == 1:
            return "127.0.0.1"
        for name in (hosts[0], socket.gethostname()):
            try:
                return route_to(socket.gethostbyname(name))
            except OSError:
                continue
        return "127.0.0.1"

    def send(self, step: int) -> None:
        """One datagram to every other process (one that cannot be sent is skipped: a link
        that is down refuses it at once)."""
        packet = _FORMAT.pack(self.nonce, self.rank, step)
        for peer, address in enumerate(self.addresses):
            if peer != self.rank:
                try:
                    self.sock.sendto(packet, address)
                except OSError:
                    pass

    def receive(self, timeout_s: float, also: int | None = None) -> bool:
        """Read every datagram that arrives within `timeout_s`. Returns early, True, when the
        descriptor `also` becomes readable (the abort guard's notice)."""
        deadline = time.monotonic() + timeout_s
        watched = [self.sock] + ([also] if also is not None else [])
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(watched, [], [], left)
            if also is not None and also in ready:
                return True
            if self.sock in ready:
                self._drain()
        return False

    def _drain(self) -> None:
        while True:
            try:
                packet = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(packet) != _FORMAT.size:
                continue
            nonce, rank, step = _FORMAT.unpack(packet)
            if nonce == self.nonce and rank in self.heard:
                self.heard[rank] = time.monotonic()
                self.steps[rank] = step

    def silent(self, now: float, after_s: float) -> list[tuple[int, float]]:
        """(rank, seconds since last heard) of the processes not heard for `after_s`, the
        longest silent first."""
        quiet = [(r, now - t) for r, t in self.heard.items() if now - t > after_s]
        return sorted(quiet, key=lambda q: -q[1])

    def preparing(self, now: float, after_s: float) -> list[int]:
        """The processes heard within `after_s` that have not reached their loop yet."""
        return [r for r, s in self.steps.items() if s == PREPARING and now - self.heard[r] <= after_s]

    def where(self, rank: int) -> str:
        """'rank R on host H' for messages."""
        return f"rank {rank} on {self.hosts[rank]}"

    def close(self) -> None:
        self.sock.close()
