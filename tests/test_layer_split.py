"""`layer-split` equals `single` by the equivalence protocol; its stage programs compile once.

For stack-mlp and vit on two stage counts each; state round-trips through the reference
layout; compiling covers every stage program and their FLOPs and memory."""

import jax
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar import measure
from jaxpar.errors import ConfigError

MODELS = {"stack-mlp": dict(width=32, depth=4, lr=0.02), "vit": dict(width=32, depth=4, lr=0.02)}
CASES = [("stack-mlp", 2), ("stack-mlp", 4), ("vit", 2), ("vit", 4)]


@pytest.fixture(scope="module")
def refs():
    return {m: eq.run(eq.config(model=m, **kw)) for m, kw in MODELS.items()}


@requires_devices(4)
@pytest.mark.parametrize("model,stages", CASES)
def test_layer_split_matches_single(refs, model, stages):
    cfg = eq.config(model=model, strategy="layer-split", mesh=f"stage={stages}", **MODELS[model])
    got = eq.run(cfg, devices=stages)
    eq.assert_equivalent(refs[model], got)
    s = got.strategy
    assert s.describe()["stages"] == stages
    # parameters and optimizer state round-trip through the single-device layout
    ref_state = s.state_to_reference(got.state)
    eq.assert_tree_close(ref_state, s.state_to_reference(s.state_from_reference(ref_state)))
    # the blocks are divided: each device holds 1/S of the block parameters
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
    total = nbytes(got.params["blocks"])
    assert [nbytes(p["blocks"]) for p in got.state.params] == [total // stages] * stages


@requires_devices(2)
def test_compile_covers_every_stage_program():
    cfg = eq.config(model="stack-mlp", strategy="layer-split", mesh="stage=2", width=32, depth=2)
    got = eq.run(cfg, steps=1, devices=2)
    s = got.strategy
    batch = s.place_batch(eq.batches(64, 1)[0])
    programs = s.compile("step", got.state, batch)
    assert programs.seconds > 0 and programs.parts
    counts = dict(s.trace_counts)
    state, sums = s.step(got.state, batch)
    jax.device_get(sums)
    assert dict(s.trace_counts) == counts  # compiled executables ran: no retrace
    assert {"step:train_fwd0", "step:bwd0", "step:last", "step:update0", "step:update1"} <= set(s.compiled)
    # memory per device: the fullest device and the largest stage program, not stage 0's first
    acc = s.accounting(programs, state)
    temps = [measure.program_stats(c)["memory"]["temp_bytes"]
             for name, c in s.compiled.items() if name.startswith("step:")]
    assert acc["memory_per_device"]["temp_bytes"] == max(temps)
    # FLOPs: every stage program's, not the first one's times the devices (bench uses this)
    assert programs.flops == sum(
        measure.program_stats(c)["flops"] for name, c in s.compiled.items() if name.startswith("step:"))
    assert len(acc["memory_per_stage"]) == 2
    # stage 0's residuals, held from its forward program to its backward, count as activations
    assert acc["activation_bytes_per_device"] >= s.compiled["step:train_fwd0"].memory_analysis().output_size_in_bytes
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
    per_stage = [nbytes(p) + nbytes(o) for p, o in zip(state.params, state.opt_state)]
    assert acc["state_bytes_per_device"] == max(per_stage) < sum(per_stage)


@requires_devices(4)
def test_blocks_must_divide_into_stages():
    cfg = eq.config(model="stack-mlp", strategy="layer-split", mesh="stage=4", width=32, depth=2)
    with pytest.raises(ConfigError, match="--depth"):
        eq.run(cfg, steps=1, devices=4)


def test_unsplittable_model_is_a_config_error():
    cfg = eq.config(model="mlp", strategy="layer-split", mesh="stage=1")
    with pytest.raises(ConfigError, match="--model"):
        eq.run(cfg, steps=1, devices=1)
