"""`pipeline` (GPipe and 1F1B) equals `single`; its communication and memory match theory.

Bad shapes name the option to change."""

import functools

import jax
import numpy as np
import pytest

import equivalence as eq
from jaxpar.errors import ConfigError, MeshError

STACK = dict(model="stack-mlp", width=32, depth=4, batch_size=32, lr=0.01)
VIT = dict(model="vit", width=32, depth=4, batch_size=16, lr=0.01)


@functools.lru_cache(maxsize=None)
def reference(model):
    return eq.run(eq.config(**(STACK if model == "stack-mlp" else VIT)), steps=5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (2, 2)])
def test_stack_mlp_equals_single(schedule, stages, micro):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", microbatches=micro,
                    schedule=schedule, **STACK)
    eq.assert_equivalent(reference("stack-mlp"), eq.run(cfg, steps=5, devices=stages))


@pytest.mark.parametrize("schedule,stages", [("gpipe", 2), ("1f1b", 2), ("1f1b", 4)])
def test_vit_equals_single(schedule, stages):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", microbatches=4, schedule=schedule, **VIT)
    eq.assert_equivalent(reference("vit"), eq.run(cfg, steps=5, devices=stages))


def test_remat_changes_memory_not_results():
    cfg = eq.config(strategy="pipeline", mesh="stage=2", microbatches=4, remat=True, **STACK)
    eq.assert_equivalent(reference("stack-mlp"), eq.run(cfg, steps=5, devices=2))


def _accounting(schedule, micro=16, remat=False, stages=2):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", microbatches=micro, schedule=schedule,
                    remat=remat, model="stack-mlp", width=64, depth=4, batch_size=128)
    t = eq.run(cfg, steps=1, devices=stages, global_batches=eq.batches(128, 1))
    programs = t.strategy.compile("step", t.state, t.strategy.place_batch(eq.batches(128, 1)[0]))
    return t.strategy.accounting(programs, t.state), t


def test_1f1b_holds_less_activation_memory_than_gpipe():
    gpipe, _ = _accounting("gpipe")          # M = 16 >= 2S = 4
    remat, _ = _accounting("gpipe", remat=True)
    one_f, _ = _accounting("1f1b")
    assert one_f["activation_bytes_per_device"] < gpipe["activation_bytes_per_device"]
    assert remat["activation_bytes_per_device"] < gpipe["activation_bytes_per_device"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_collective_bytes_equal_the_schedule_theory(schedule):
    acc, _ = _accounting(schedule, micro=4)
    assert acc["collective_bytes_by_op"]["collective-permute"] == acc["collective_bytes_theory"]["collective-permute"]
    assert acc["collective_bytes_per_step"] == acc["collective_bytes_theory"]["total"]


def test_block_parameters_per_device_are_one_sth():
    _, t = _accounting("gpipe", micro=4, stages=4)
    blocks = t.state.params["blocks"]
    local = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(blocks))
    total = sum(x.nbytes for x in jax.tree.leaves(blocks))
    assert local * 4 == total


@pytest.mark.parametrize("options,needle", [
    (dict(depth=3, mesh="stage=2"), "--depth"),
    (dict(microbatches=5, mesh="stage=2"), "--microbatches"),
    (dict(model="mlp", width=32, depth=2, mesh="stage=2"), "--model"),
])
def test_bad_shapes_name_the_option(options, needle):
    base = {**STACK, **options}
    with pytest.raises(ConfigError, match=needle):
        eq.run(eq.config(strategy="pipeline", **base), steps=1, devices=2)


def test_pipeline_mesh_must_have_a_stage_axis():
    with pytest.raises(MeshError, match="--mesh stage"):
        eq.run(eq.config(strategy="pipeline", mesh="data=2", **STACK), steps=1, devices=2)


def test_describe_reports_schedule_and_bubble():
    cfg = eq.config(strategy="pipeline", mesh="stage=2", microbatches=4, schedule="1f1b", **STACK)
    d = eq.run(cfg, steps=1, devices=2).strategy.describe()
    assert d["slots"] == 2 * (4 + 2 - 1) and d["bubble_fraction"] == pytest.approx(1 / 5)
    assert np.isclose(d["bubble_theory"], 1 / 5)
