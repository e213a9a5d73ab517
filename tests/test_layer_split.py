"""`layer-split`: equal to `single` for the stack-mlp and the ViT on two stage counts, one
trace per stage program, 1/S of the blocks per device, the activation traffic of theory, and
clear errors for models that do not divide into stages."""

import functools

import jax
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar import profile
from jaxpar.config import ConfigError
from jaxpar.mesh import MeshError

MODELS = {"stack-mlp": dict(model="stack-mlp", width=32, depth=4, batch_size=16, lr=0.02,
                       optimizer="momentum"),
          "vit": dict(model="vit", width=16, depth=4, batch_size=8)}
FLOOR = {"stack-mlp": 0.0, "vit": 1e-2}  # the ViT's key-bias gradient is zero up to rounding
MESHES = ["stage=2", "stage=4"]


@functools.lru_cache(maxsize=None)
def reference(model):
    return eq.run(eq.config(**MODELS[model]), steps=5)


@functools.lru_cache(maxsize=None)
def trace(model, mesh):
    devices = int(mesh.split("=")[1])
    return eq.run(eq.config(strategy="layer-split", mesh=mesh, **MODELS[model]), steps=5, devices=devices)


@requires_devices(4)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", MODELS)
def test_equals_single(model, mesh):
    got = trace(model, mesh)
    eq.assert_equivalent(reference(model), got, floor=FLOOR[model])
    # every stage program traced once over 5 steps (and the gradients call)
    assert set(got.strategy.trace_counts.values()) == {1}, got.strategy.trace_counts


@requires_devices(4)
def test_blocks_and_traffic_per_stage():
    t = trace("stack-mlp", "stage=4")
    compiled, _ = t.strategy.compile("step", t.state, t.strategy.place_batch(eq.batches(16, 1)[0]))
    acc = t.strategy.accounting(profile.program_stats(compiled), t.state)
    assert acc["block_param_bytes_per_stage"] == [acc["block_param_bytes_total"] // 4] * 4
    assert acc["collective_bytes_per_step"] == 0
    # 16 examples x width 32 x f32, 3 boundaries, forward and backward
    assert acc["activation_transfer_bytes_per_step"] == acc["activation_transfer_bytes_theory"] == 2 * 3 * 16 * 32 * 4
    # stem on the first device, head on the last
    assert acc["param_bytes_per_stage"][0] > acc["param_bytes_per_stage"][3] > acc["param_bytes_per_stage"][1]


@requires_devices(4)
def test_optimizer_state_converts_to_the_reference_layout():
    # momentum's trace is parameter-shaped: after the run it must equal single's, and
    # survive a round trip through the reference layout
    ref, got = reference("stack-mlp"), trace("stack-mlp", "stage=2")
    state = got.strategy.state_to_reference(got.state)
    eq.assert_tree_close(jax.device_get(ref.state.opt_state), state.opt_state, what="optimizer state")
    back = got.strategy.state_to_reference(got.strategy.state_from_reference(state))
    eq.assert_tree_close(state, back, tol=0, what="round trip")


@requires_devices(4)
def test_eval_step_equals_single():
    t = trace("stack-mlp", "stage=2")
    batch = eq.batches(16, 1, seed=1)[0]
    got = jax.device_get(t.strategy.eval_step(t.state, t.strategy.place_batch(batch)))
    ref = reference("stack-mlp")
    want = jax.device_get(ref.strategy.eval_step(ref.state, ref.strategy.place_batch(batch)))
    eq.assert_tree_close(want, got, what="eval sums")


@requires_devices(4)
@pytest.mark.parametrize("options,error,needle", [
    (dict(model="stack-mlp", width=32, depth=3, mesh="stage=2"), ConfigError, "--depth"),
    (dict(model="mlp", width=32, mesh="stage=2"), ConfigError, "--model"),
    (dict(model="stack-mlp", width=32, depth=4, mesh="stage=2,tensor=2"), MeshError, "--mesh"),
])
def test_models_that_do_not_split_name_the_option(options, error, needle):
    with pytest.raises(error, match=needle):
        eq.run(eq.config(strategy="layer-split", batch_size=8, **options), steps=1, devices=2)
