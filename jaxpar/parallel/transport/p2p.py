"""Point-to-point messages between programs, sent and received by the compiled programs themselves.

A pipeline whose schedule is walked from the host dispatches some 40 programs and transfers a
step. With one core per rank (single-threaded ranks) that host work and the transfer servers'
threads took ~10 ms of each core a step beside the stages' 27 ms (CNN, 2 ranks, 1F1B:
docs/studies/scaling.md), and the step stayed at 1.2x one rank. Here each stage's whole step is one
program (`pipeline.host.column`; a process's, or one of several a process runs at once on its devices),
which sends each activation or gradient over a TCP connection (within a process, an in-memory
channel) and reads the next one itself: XLA FFI custom calls (p2p.cc), as mpi4jax's are for
MPI, without MPI. A send never waits for its receiver: it writes what the socket's buffer
takes at once and leaves the rest in the connection's outbox, which a thread of its own
writes out (a channel: copies it into its queue), so a pipeline's last stage can send each
gradient as soon as it has it, while activations still come the other way (a link carries
both directions at once); `flush` waits until the outbox is written out, so a step's
messages leave within the step. They are built by the C++ compiler the first time they are
needed (a few seconds; cached under $JAXPAR_CACHE or ~/.cache/jaxpar, per source and jaxlib
version);
without a compiler `unavailable()` says why and pipelines keep the host walk (`transfers`).

    links = p2p.connect({s - 1, s + 1})                # every process at the same point
    one, other = p2p.pair()                            # or two programs of one process:
    links = p2p.Links({1: one})                        #   in-memory channels
    done = links.send(x, peer, after=order)            # inside jit: a zero, to order later work
    y = links.receive(spec, peer, after=order)         # the next message from `peer`
    done = links.flush(after=order)                    # every connection's sends written out
    p2p.waited()                                       # (seconds in receives and flushes, receives)
    zero = p2p.stamp(order, mark)                      # inside jit: the clock read once order exists
    p2p.take_stamps()                                  # [(mark, ns), ...] taken since the last call

Every wait is bounded: connecting by `CONNECT_TIMEOUT_S`, each write and receive by the
sockets' `timeout_s()` (SO_SNDTIMEO / SO_RCVTIMEO; TCP_USER_TIMEOUT for data the peer never
acknowledges), a channel's receive and a flush by the same, after which the program fails
with a message naming the peer's silence. That is the watchdog's backstop (three times
--collective-timeout plus 10 s, `distributed.backstop_s`): the watchdog, which names the rank
and host that went silent, normally ends the job first, and a link that flaps for less than
the bound costs the connection nothing (TCP retransmits what was lost).
"""

from __future__ import annotations

import ctypes
import functools
import socket
import struct
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.runtime import distributed, native
from jaxpar.parallel.transport import addresses

SOURCE = Path(__file__).with_name("p2p.cc")
TIMEOUT_S: int | None = None  # one send, receive or flush; None: the watchdog's backstop
CONNECT_TIMEOUT_S = 60
BUFFER_BYTES = 4 << 20  # socket buffers: a micro-batch's activation fits (kernel caps apply)
_SEND, _RECV, _FLUSH = "jaxpar_p2p_send", "jaxpar_p2p_recv", "jaxpar_p2p_flush"
_CHAN_SEND, _CHAN_RECV = "jaxpar_chan_send", "jaxpar_chan_recv"
_STAMP = "jaxpar_stamp"


Unavailable = native.Unavailable  # the custom calls cannot be built or loaded here


def timeout_s() -> int:
    """Seconds one send, receive or flush may wait (`TIMEOUT_S`, else the watchdog's backstop)."""
    return TIMEOUT_S if TIMEOUT_S is not None else int(distributed.backstop_s())


def unavailable() -> str | None:
    """None when in-program messages work here; else why not (for `describe`)."""
    if jax.default_backend() != "cpu":
        return "not on a CPU backend (accelerators keep their collectives)"
    try:
        _library()
    except Unavailable as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The built custom calls, loaded and registered with XLA:CPU (once per process)."""
    lib = native.register(native.build_library(SOURCE), {_SEND: "JaxparSend", _RECV: "JaxparRecv", _FLUSH: "JaxparFlush",
                                                 _CHAN_SEND: "JaxparChanSend", _CHAN_RECV: "JaxparChanRecv",
                                                 _STAMP: "JaxparStamp"})
    lib.JaxparOutboxOpen.argtypes, lib.JaxparOutboxOpen.restype = [ctypes.c_int], ctypes.c_int64
    lib.JaxparOutboxClose.argtypes = [ctypes.c_int64]
    lib.JaxparChannelOpen.restype = ctypes.c_int64
    lib.JaxparChannelClose.argtypes = [ctypes.c_int64]
    lib.JaxparWaitedNs.restype = lib.JaxparReceives.restype = ctypes.c_int64
    lib.JaxparStampsTake.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.JaxparStampsTake.restype = lib.JaxparStampsKept.restype = ctypes.c_int64
    return lib


def waited() -> tuple[float, int] | None:
    """(seconds this process's programs have spent in socket receives and flushes so far,
    the socket receives they made): a rank of one thread idles meanwhile, its bubble and its
    messages' time on the wire. None where the library is not loaded (nothing was counted)."""
    if not _library.cache_info().currsize:
        return None
    lib = _library()
    return lib.JaxparWaitedNs() / 1e9, lib.JaxparReceives()


def stamp(after: jax.Array, mark: int) -> jax.Array:
    """Inside jit: a float32 zero once `after` is computed, the host's monotonic clock read
    then and kept with `mark` until `take_stamps` (tie later work to the zero to stamp before it)."""
    return jax.ffi.ffi_call(_STAMP, jax.ShapeDtypeStruct((), jnp.float32), has_side_effect=True)(
        after, mark=np.int64(mark))


def take_stamps() -> np.ndarray:
    """The stamps programs took since the last call, in the order taken: rows of (mark,
    nanoseconds on the host's monotonic clock, which every process of a host shares); empty
    where the library is not loaded."""
    if not _library.cache_info().currsize:
        return np.zeros((0, 2), np.int64)
    lib = _library()
    out = np.zeros(lib.JaxparStampsKept(), np.int64)
    taken = lib.JaxparStampsTake(out.ctypes.data, out.size)
    return out[:taken - taken % 2].reshape(-1, 2)


class Channel:
    """One direction of a link between two programs of this process: a queue in p2p.cc (a
    send copies its message in and returns; a receive gets the next, or waits for it as a
    future that the send completes, so it holds none of XLA's threads), closed when the
    last holder lets it go."""

    def __init__(self):
        self._lib = _library()
        self.id = self._lib.JaxparChannelOpen()

    def __del__(self):
        self._lib.JaxparChannelClose(self.id)


class Connection:
    """A TCP connection to another process: receives read its socket; sends go into its
    outbox in p2p.cc, whose thread writes them out (on a duplicate of the descriptor, closed
    by that thread once the outbox is closed: when the last holder lets this go)."""

    def __init__(self, sock: socket.socket):
        lib = _library()
        self.socket = sock
        self.outbox = lib.JaxparOutboxOpen(sock.fileno())
        if self.outbox < 0:
            raise OSError(-self.outbox, "p2p: could not duplicate the connection's descriptor")
        self._closed = weakref.finalize(self, lib.JaxparOutboxClose, self.outbox)


class Ends:
    """One end of an in-process link: the channel it sends on and the one it receives on."""

    def __init__(self, out: Channel, into: Channel):
        self.out, self.into = out, into


class Links:
    """Open links to some peers (a socket connected to another process, or an in-process
    `Ends`), used inside jitted functions (closed with them, when the strategy holding them
    goes)."""

    def __init__(self, ends: dict[int, socket.socket | Connection | Ends]):
        # kept open while programs that name their descriptors, outboxes and channels live
        self.ends = {peer: Connection(e) if isinstance(e, socket.socket) else e for peer, e in ends.items()}

    def renamed(self, names: dict) -> Links:
        """The same connections keyed by `names`' keys (name -> the peer it was keyed by)."""
        return Links({name: self.ends[peer] for name, peer in names.items()})

    def send(self, x: jax.Array, peer: int, after: jax.Array | None = None) -> jax.Array:
        """Inside jit: `x` to `peer`, once `after` is computed (sends in a program go in the
        order their `after`s chain them); a float32 zero once sent (tie later work to it)."""
        done = jax.ShapeDtypeStruct((), jnp.float32)
        after = jnp.zeros((), jnp.float32) if after is None else after
        end = self.ends[peer]
        if isinstance(end, Ends):
            return jax.ffi.ffi_call(_CHAN_SEND, done, has_side_effect=True)(
                x, after, channel=np.int64(end.out.id))
        return jax.ffi.ffi_call(_SEND, done, has_side_effect=True)(x, after, outbox=np.int64(end.outbox))

    def receive(self, spec, peer: int, after: jax.Array) -> jax.Array:
        """Inside jit: the next message from process `peer`, of `spec`'s shape and dtype,
        read once `after` is computed."""
        out, end = jax.ShapeDtypeStruct(spec.shape, spec.dtype), self.ends[peer]
        if isinstance(end, Ends):
            return jax.ffi.ffi_call(_CHAN_RECV, out, has_side_effect=True)(
                after, channel=np.int64(end.into.id), timeout_s=np.int64(timeout_s()))
        return jax.ffi.ffi_call(_RECV, out, has_side_effect=True)(after, fd=np.int64(end.socket.fileno()))

    def flush(self, after: jax.Array) -> jax.Array:
        """Inside jit: a float32 zero once every connection's messages sent before `after`
        are written out (the thread running it waits; channels have nothing to write)."""
        done = jnp.zeros((), jnp.float32)
        for end in self.ends.values():
            if isinstance(end, Connection):
                done = done + jax.ffi.ffi_call(_FLUSH, jax.ShapeDtypeStruct((), jnp.float32),
                                               has_side_effect=True)(
                    after, outbox=np.int64(end.outbox), timeout_s=np.int64(timeout_s()))
        return done


def connect(peers) -> Links:
    """One connection to each of `peers` (process indices). A collective: every process calls
    it at the same point, and process j lists i exactly when i lists j. The higher index
    connects, the lower accepts (a connection waits in the listener's backlog, so every
    process can make all its connections before it accepts)."""
    _library()
    me, peers = jax.process_index(), sorted(set(peers) - {jax.process_index()})
    host = addresses.local_address()
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    with socket.create_server((host.strip("[]"), 0), family=family, backlog=max(1, len(peers))) as listener:
        listener.settimeout(CONNECT_TIMEOUT_S)
        every = addresses.exchange(f"{host}:{listener.getsockname()[1]}")
        sockets = {}
        for peer in (p for p in peers if p < me):
            s = socket.create_connection(addresses.split(every[peer]), timeout=CONNECT_TIMEOUT_S)
            _for_custom_calls(s)
            s.sendall(struct.pack("!i", me))
            sockets[peer] = s
        for _ in (p for p in peers if p > me):
            s, _ = listener.accept()
            _for_custom_calls(s)  # blocking from here: the read below waits for all 4 bytes
            index = s.recv(4, socket.MSG_WAITALL)
            if len(index) < 4:
                raise ConnectionError("a peer process closed its connection while connecting")
            (peer,) = struct.unpack("!i", index)
            sockets[peer] = s
    return Links(sockets)


def pair() -> tuple[Ends, Ends]:
    """The two ends of a link between two programs of this process (on two of its devices,
    running at once): a channel each way, so a send never waits for its receiver."""
    there, back = Channel(), Channel()
    return Ends(there, back), Ends(back, there)


def _for_custom_calls(s: socket.socket) -> None:
    """Blocking (the custom calls read and write the descriptor directly), each call bounded
    by the kernel's timeouts (TCP_USER_TIMEOUT: data unacknowledged that long fails the
    connection, as a cut link's would), no Nagle delay, buffers that hold a message."""
    s.settimeout(None)
    timeval = struct.pack("ll", timeout_s(), 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1000 * timeout_s())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)
