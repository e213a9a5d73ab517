"""Measurements of compiled programs (`jaxpar/profiling/measure.py`): bytes, FLOPs and memory.

Collective bytes from HLO with loop trip counts and conditional branches; FLOPs and memory
added up over a strategy's programs."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.profiling import measure


def _program(n_dev: int, trips: int):
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("d",))

    def body(c, _):
        return c + jax.lax.psum(c * c, "d"), None

    def f(x):
        c, _ = jax.lax.scan(body, x, None, length=trips)
        return jax.lax.psum(x, "d") + jax.lax.psum(c.sum(), "d")

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))
    return g.lower(jnp.ones((2 * n_dev, 3))).compile()


def test_collective_bytes_multiply_loop_bodies_by_trip_count():
    stats = measure.program_stats(_program(4, trips=5))
    # per device: a [2,3] f32 psum in a 5-trip loop (24 B x 5), then [2,3] + a scalar (28 B)
    assert stats["collective_bytes"] == {"all-reduce": 5 * 24 + 28, "total": 5 * 24 + 28}
    assert stats["has_loops"]


def test_all_gather_and_reduce_scatter_count_operand_bytes():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))

    def f(x):
        full = jax.lax.all_gather(x, "d", tiled=True)          # operand: this shard [2,3]
        return jax.lax.psum_scatter(full, "d", tiled=True)     # operand: [8,3]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    got = measure.collective_bytes(g.lower(jnp.ones((8, 3))).compile().as_text())
    assert got["all-gather"] == 2 * 3 * 4
    assert got["reduce-scatter"] == 8 * 3 * 4


def test_shape_bytes():
    assert measure.shape_bytes("(f32[2,3]{1,0}, s32[], bf16[4])") == 24 + 4 + 8


def test_state_bytes_per_device_is_the_fullest_devices():
    from jax.sharding import NamedSharding

    from jaxpar.step import TrainState

    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices), ("d",))
    sharded = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))  # 32 B each
    # Stages on different devices (layer-split): device 0 holds 400 B, device 1 200 B.
    state = TrainState(step=jnp.zeros((), jnp.int32),
                       params=(jax.device_put(jnp.ones(100), devices[0]),
                               jax.device_put(jnp.ones(50), devices[1]), sharded),
                       opt_state=(), model_state={})
    assert measure.state_bytes_per_device(state) == 400 + 32  # not the 632 B summed over devices
    replicated = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P()))
    assert measure.state_bytes_per_device(state.replace(params=(replicated, sharded))) == 128 + 32


def test_programs_count_every_device_or_every_stage_program():
    spmd = measure.Program("spmd", _program(4, trips=5), devices=4)
    stage = measure.Program("stage", jax.jit(lambda x: x @ x).lower(jnp.ones((8, 8))).compile())
    programs = measure.Programs("step", 0.5, (spmd, stage))
    # an SPMD program's cost analysis is one device's share: the step runs it on all of them;
    # a stage program runs on its one device (layer-split)
    assert programs.flops == 4 * spmd.stats["flops"] + stage.stats["flops"] > 0
    assert programs.collective_bytes == {"all-reduce": 5 * 24 + 28, "total": 5 * 24 + 28}
    for field in ("argument_bytes", "temp_bytes"):
        assert programs.memory[field] == max(spmd.stats["memory"][field], stage.stats["memory"][field])
    assert programs.has_loops and programs.part("stage") is stage


def test_collectives_in_a_conditional_branch_count_once_every_k_runs():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))

    def f(step, x):  # the average of local-sgd: taken when step % 3 == 0
        x = jax.lax.cond(step % 3 == 0, lambda p: jax.lax.pcast(jax.lax.pmean(p, "d"), "d", to="varying"),
                         lambda p: p, x)
        return x + jax.lax.psum(x.sum(), "d")  # and one scalar every run

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")))
    text = g.lower(jnp.zeros((), jnp.int32), jnp.ones((8, 3))).compile().as_text()
    assert measure.collective_bytes(text) == {"all-reduce": 24 + 4, "total": 28}
    assert measure.collective_bytes(text, branch_every=3) == {"all-reduce": 24 // 3 + 4, "total": 12}


def test_an_mpi_receive_counts_the_bytes_it_returns():
    """mpi4jax's recv has only the ordering token as operand: its bytes are its result's;
    send and sendrecv count their data operand."""
    recv = ('  %recv_mpi.6 = (f32[24,32]{1,0}, token[]) custom-call(%Arg_0.5), '
            'custom_call_target="mpi_recv_ffi", operand_layout_constraints={token[]}, '
            'custom_call_has_side_effect=true')
    send = ('  %send_mpi.2 = token[] custom-call(%add, %recv_mpi.6), custom_call_target="mpi_send_ffi", '
            'operand_layout_constraints={f32[24,32]{1,0}, token[]}, custom_call_has_side_effect=true')
    text = "ENTRY %main (Arg_0.5: token[]) -> token[] {\n" + recv + "\n" + send + "\n}\n"
    assert measure.collective_bytes(text) == {"mpi_recv": 3072, "mpi_send": 3072, "total": 6144}
