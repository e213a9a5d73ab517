"""The in-program point-to-point messages (`jaxpar.parallel.p2p`): built from p2p.cc, an array
sent by one program arrives whole in another's, a receive with nothing coming ends with a
message instead of waiting forever, and a machine without a compiler is told why. Between
processes they run under mpiexec (tests/mpi/test_model_parallel.py: `pipeline` and
`layer-split` with one stage per rank) and across emulated hosts (tests/test_cluster.py).

    python -m pytest -q tests/test_p2p.py
"""

import socket
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import native
from jaxpar.parallel import p2p


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
        native.build(p2p.SOURCE)
    assert not list(tmp_path.glob("*.so"))  # nothing half-written left behind
