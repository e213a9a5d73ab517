"""The in-program point-to-point messages (`jaxpar.parallel.transport.p2p`): built from p2p.cc, an array
sent by one program arrives whole in another's, a receive with nothing coming ends with a
message instead of waiting forever, and a machine without a compiler is told why. Between
processes they run under mpiexec (tests/mpi/test_model_parallel.py: `pipeline` and
`layer-split` with one stage per rank) and across emulated hosts (tests/experiments/infra/test_cluster.py).

    python -m pytest -q tests/parallel/transport/test_p2p.py
"""

import socket
import struct
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.runtime import native
from jaxpar.parallel.transport import p2p


@pytest.fixture
def pair():
    """Two connected TCP sockets on loopback, set up as `connect` sets up its links."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        p2p._for_custom_calls(s)
    yield a, b
    a.close()
    b.close()


def test_the_custom_calls_build_here():
    assert p2p.unavailable() is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_a_sent_array_arrives_whole(pair, dtype):
    out, into = p2p.Links({1: pair[0]}), p2p.Links({0: pair[1]})
    x = jnp.arange(3 * 50_000, dtype=dtype).reshape(3, 50_000)  # 600 KB: several socket reads

    @jax.jit
    def there_and_back(x):
        done = out.send(x * 2, 1)
        return into.receive(jax.ShapeDtypeStruct(x.shape, x.dtype), 0, after=done)

    np.testing.assert_array_equal(there_and_back(x), np.asarray(x) * 2)


def test_the_time_blocked_in_a_receive_is_counted(pair):
    """`waited`: a receive whose message comes 0.3 s later adds those 0.3 s (a rank of one
    thread idles meanwhile: bench's `p2p_waited_ms`) and one receive; a receive whose message
    is there adds next to nothing."""
    out, into = p2p.Links({1: pair[0]}), p2p.Links({0: pair[1]})
    x = jnp.ones((1000,), jnp.float32)
    receive = jax.jit(lambda o: into.receive(jax.ShapeDtypeStruct(x.shape, x.dtype), 0, after=o))
    send = jax.jit(lambda x: out.send(x, 1))
    jax.block_until_ready(receive.lower(jnp.zeros(())).compile())  # compiled before the clock
    (before, count) = p2p.waited()
    late = threading.Timer(0.3, lambda: jax.block_until_ready(send(x)))
    late.start()
    jax.block_until_ready(receive(jnp.zeros(())))
    late.join()
    waited = p2p.waited()[0] - before
    assert 0.25 < waited < 5.0 and p2p.waited()[1] == count + 1
    jax.block_until_ready(send(x))
    jax.block_until_ready(receive(jnp.zeros(())))  # already there
    assert p2p.waited()[0] - before - waited < 0.1 and p2p.waited()[1] == count + 2


def test_stamps_read_the_clock_inside_a_program_in_its_order(pair):
    """`stamp`: a program's stamps come back with their marks, in the order the program ran
    them (each after what it was given), on the host's monotonic clock, once: a receive whose
    message comes 0.3 s later lies between the stamps around it."""
    out, into = p2p.Links({1: pair[0]}), p2p.Links({0: pair[1]})
    x = jnp.ones((10,), jnp.float32)

    @jax.jit
    def stamped_receive(order):
        order = order + p2p.stamp(order, 7)
        got = into.receive(jax.ShapeDtypeStruct(x.shape, x.dtype), 0, after=order)
        return got + p2p.stamp(got.sum(), 8)

    jax.block_until_ready(stamped_receive.lower(jnp.zeros(())).compile())
    p2p.take_stamps()
    late = threading.Timer(0.3, lambda: jax.block_until_ready(jax.jit(lambda x: out.send(x, 1))(x)))
    late.start()
    before = time.monotonic_ns()
    jax.block_until_ready(stamped_receive(jnp.zeros(())))
    late.join()
    stamps = p2p.take_stamps()
    assert stamps[:, 0].tolist() == [7, 8]
    assert before <= stamps[0, 1] and stamps[1, 1] - stamps[0, 1] > 0.25e9
    assert len(p2p.take_stamps()) == 0  # taken once


def test_a_send_over_a_connection_never_waits_for_its_receiver_and_a_flush_waits_until_written(pair):
    """Between processes (`pair`: a TCP connection): 32 MB, more than both sockets' buffers
    hold, sent before anything reads (a send that waited would time out: SO_SNDTIMEO 5 s);
    a flush then waits until the receiver has read them, in order; a write that fails (the
    peer gone) fails the next flush with a message."""
    pair[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
    out, into = p2p.Links({1: pair[0]}), p2p.Links({0: pair[1]})
    x = jnp.arange(1 << 18, dtype=jnp.float32)  # 1 MB
    spec, count = jax.ShapeDtypeStruct(x.shape, x.dtype), 32

    @jax.jit
    def send_all(x):
        order = jnp.zeros((), jnp.float32)
        for i in range(count):
            order = order + out.send(x + i, 1, after=order)
        return order

    jax.block_until_ready(send_all(x))  # returned: every message is in the outbox
    flushed = threading.Thread(target=lambda: jax.block_until_ready(jax.jit(out.flush)(jnp.zeros(()))))
    flushed.start()
    flushed.join(0.5)
    assert flushed.is_alive()  # nothing read yet: the messages cannot all be written
    receive = jax.jit(lambda o: into.receive(spec, 0, after=o))
    for i in range(count):
        np.testing.assert_array_equal(receive(jnp.zeros(())), np.asarray(x) + i)
    flushed.join(30)
    assert not flushed.is_alive()

    pair[1].shutdown(socket.SHUT_RDWR)  # the peer gone: a write fails, and a flush says so
    with pytest.raises(Exception, match="send failed"):
        for _ in range(count):  # the first writes may still land in the kernel's buffers
            jax.block_until_ready(send_all(x))
            jax.block_until_ready(jax.jit(out.flush)(jnp.zeros(())))


def test_programs_of_one_process_exchange_through_channels_without_waiting_to_send():
    """Within a process (`pair`): a send returns before anything receives it (two queued,
    then read in order), and a receive with nothing coming fails after the timeout."""
    one, other = p2p.pair()
    out, into = p2p.Links({1: one}), p2p.Links({0: other})
    x = jnp.arange(3 * 50_000, dtype=jnp.float32).reshape(3, 50_000)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jax.jit
    def send_twice_then_receive(x):
        done = out.send(x, 1) + out.send(x * 2, 1)
        first = into.receive(spec, 0, after=done)
        return first, into.receive(spec, 0, after=first.ravel()[0] * 0 + done)

    first, second = send_twice_then_receive(x)
    np.testing.assert_array_equal(first, np.asarray(x))
    np.testing.assert_array_equal(second, np.asarray(x) * 2)


def test_a_channel_receive_with_nothing_coming_fails_with_a_message(monkeypatch):
    monkeypatch.setattr(p2p, "TIMEOUT_S", 1)
    into = p2p.Links({0: p2p.pair()[1]})
    wait = jax.jit(lambda o: into.receive(jax.ShapeDtypeStruct((4,), jnp.float32), 0, after=o))
    with pytest.raises(Exception, match="timed out"):
        jax.block_until_ready(wait(jnp.zeros(())))


def test_receives_waiting_before_their_sends_get_their_messages(monkeypatch):
    """A receive that finds no message waits as a future, holding no thread (XLA:CPU runs all
    simulated devices' programs on one pool of as many threads as cores); the send completes
    it. Here the programs of devices 1..7 wait before the one that sends to them all starts
    on device 0, and each gets its own message."""
    monkeypatch.setattr(p2p, "TIMEOUT_S", 20)
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 simulated devices")
    ends = [p2p.pair() for _ in devices[1:]]
    spec = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    waiting = []
    for d, (_, theirs) in enumerate(ends, start=1):
        into = p2p.Links({0: theirs})
        # Beside independent work, so XLA runs one of the two on a thread of its pool.
        receive = jax.jit(lambda a, into=into: (into.receive(spec, 0, after=a[0, 0]) + 1.0, a @ a))
        waiting.append(receive(jax.device_put(jnp.zeros((256, 256)), devices[d]))[0])
    out = p2p.Links({d: ours for d, (ours, _) in enumerate(ends, start=1)})

    @jax.jit
    def send_to_all(x):
        done = jnp.zeros(())
        for d in range(1, len(devices)):
            done = out.send(x * d, d, after=done)
        return done

    x = jax.device_put(jnp.ones((64, 64)), devices[0])
    jax.block_until_ready(send_to_all(x))
    for d, got in enumerate(waiting, start=1):
        np.testing.assert_array_equal(got, np.full((64, 64), d + 1.0))


def test_a_receive_waiting_on_a_channel_closed_under_it_fails_with_a_message(monkeypatch):
    monkeypatch.setattr(p2p, "TIMEOUT_S", 60)
    ends = p2p.pair()[1]
    into = p2p.Links({0: ends})
    wait = jax.jit(lambda o: into.receive(jax.ShapeDtypeStruct((4,), jnp.float32), 0, after=o))
    # Closed from another thread: a program this small runs on the calling thread.
    closing = threading.Timer(0.5, ends.into._lib.JaxparChannelClose, [ends.into.id])
    closing.start()
    with pytest.raises(Exception, match="closed while it waited"):
        jax.block_until_ready(wait(jnp.zeros(())))
    closing.join()


def test_a_receive_with_nothing_coming_fails_with_a_message(pair):
    pair[1].setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 1, 0))
    into = p2p.Links({0: pair[1]})
    wait = jax.jit(lambda o: into.receive(jax.ShapeDtypeStruct((4,), jnp.float32), 0, after=o))
    with pytest.raises(Exception, match="timed out"):
        jax.block_until_ready(wait(jnp.zeros(())))


def test_no_compiler_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(p2p.Unavailable, match="building p2p.cc failed"):
        native.build_library(p2p.SOURCE)
    assert not list(tmp_path.glob("*.so"))  # nothing half-written left behind


def test_sockets_wait_at_most_the_watchdogs_backstop():
    """Each send and receive (SO_SNDTIMEO, SO_RCVTIMEO) and data left unacknowledged
    (TCP_USER_TIMEOUT) are bounded by the watchdog's backstop, three times
    --collective-timeout plus 10 s: past the watchdog's own report, and past any flap it lets pass."""
    import socket
    import struct

    from jaxpar.runtime import distributed

    distributed.set_collective_timeout(10)
    try:
        assert p2p.timeout_s() == 40
        with socket.create_server(("127.0.0.1", 0)) as server, \
                socket.create_connection(server.getsockname()) as s:
            p2p._for_custom_calls(s)
            assert struct.unpack("ll", s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))[0] == 40
            assert struct.unpack("ll", s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16))[0] == 40
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 40_000
    finally:
        distributed.set_collective_timeout(30)
