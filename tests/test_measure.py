"""Collective accounting from compiled HLO, loop trip counts included."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar import measure


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


def test_step_flops_count_every_device_or_every_stage_program():
    # an SPMD program's cost analysis is one device's share: the step runs it on all of them
    assert measure.step_flops(10.0, {}, 4) == 40.0
    # layer-split: one program per stage, each on one device, summed by its accounting
    assert measure.step_flops(10.0, {"flops_all_stage_programs": 25.0}, 4) == 25.0
