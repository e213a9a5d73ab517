"""`hybrid` (data x tensor x stage on one mesh) equals `single`; its blocks split 1/(S T).

Stages are cut from the model's layers (by FLOPs, or --stage-boundaries), each stage's split
leaves kept as a [stage, tensor] vector, its replicated rest as a [stage] vector.

For the stack-mlp and the ViT (the Megatron split `tensor` uses); bad shapes name the option.

    python -m pytest -q tests/parallel/pipeline/test_hybrid.py
"""

import functools

import jax
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar.errors import ConfigError

BASE = dict(model="stack-mlp", width=32, depth=4, batch_size=32, lr=0.01)
VIT = dict(model="vit", width=32, depth=2, batch_size=16, lr=0.01)  # 4 heads: 2 per device


@functools.lru_cache(maxsize=None)
def reference(model="stack-mlp"):
    return eq.run(eq.config(**(BASE if model == "stack-mlp" else VIT)), steps=5)


@requires_devices(8)
@pytest.mark.parametrize("mesh,micro,schedule,devices,impl", [
    ("data=2,tensor=2,stage=2", 2, "gpipe", 8, "spmd"),
    ("data=2,tensor=2,stage=2", 4, "1f1b", 8, "spmd"),
    ("tensor=2,stage=4", 8, "1f1b", 8, "spmd"),
    ("data=2,tensor=2,stage=2", 2, "gpipe", 8, "mpmd"),
    ("data=2,tensor=2,stage=2", 4, "1f1b", 8, "mpmd"),
    ("tensor=2,stage=4", 8, "1f1b", 8, "mpmd"),
])
def test_hybrid_equals_single(mesh, micro, schedule, devices, impl):
    cfg = eq.config(strategy="hybrid", mesh=mesh, microbatches=micro, schedule=schedule,
                    pipeline_impl=impl, **BASE)
    got = eq.run(cfg, steps=5, devices=devices)
    assert got.strategy.describe()["implementation"] == impl
    eq.assert_equivalent(reference(), got)


@requires_devices(4)
@pytest.mark.parametrize("impl", ["spmd", "mpmd"])
def test_hybrid_vit_equals_single(impl):
    cfg = eq.config(strategy="hybrid", mesh="tensor=2,stage=2", microbatches=2, pipeline_impl=impl, **VIT)
    eq.assert_equivalent(reference("vit"), eq.run(cfg, steps=5, devices=4))


@requires_devices(8)
def test_host_driven_stages_keep_the_split_on_their_sub_mesh():
    """mpmd: each stage's block kernels are split over its TENSOR devices, the batch rows over
    its DATA devices, and no device holds another stage's parameters."""
    cfg = eq.config(strategy="hybrid", mesh="data=2,tensor=2,stage=2", microbatches=2,
                    stage_boundaries=(3,), pipeline_impl="mpmd", **BASE)
    got = eq.run(cfg, steps=1, devices=8)
    width, stages = BASE["width"], got.strategy.runtime.placement.submeshes
    for s, first_block in enumerate((0, 2)):  # stem, block0, block1 | block2, block3, head
        up = got.state.params[s]["blocks"][first_block]["up"]["kernel"]
        assert up.sharding.device_set == set(stages[s].devices.flat)
        assert up.addressable_shards[0].data.shape == (width, 4 * width // 2)
        whole = sum(x.nbytes for x in jax.tree.leaves(got.state.params[s]))
        assert got.strategy.describe()["stage_param_bytes"][s] < whole


@requires_devices(8)
def test_block_kernels_are_split_over_stage_and_tensor():
    # stem, block0, block1 | block2, block3, head: two blocks a stage
    cfg = eq.config(strategy="hybrid", mesh="data=2,tensor=2,stage=2", microbatches=2,
                    stage_boundaries=(3,), pipeline_impl="spmd", **BASE)
    got = eq.run(cfg, steps=1, devices=8)
    split = got.state.params["split"]  # [stage, tensor, copy, elements]
    width = BASE["width"]
    up, down = width * 4 * width + 4 * width, 4 * width * width  # the split leaves of a block
    assert split.addressable_shards[0].data.size * 4 == split.size == 4 * (up + down)


@pytest.mark.parametrize("options,needle", [
    (dict(model="mlp", width=32, depth=2), "--model stack-mlp or vit"),
    (dict(width=33), "--width"),
    (dict(microbatches=3), "--batch-size"),
])
def test_bad_shapes_name_the_option(options, needle):
    cfg = eq.config(strategy="hybrid", mesh="tensor=2,stage=2", **{**BASE, "microbatches": 2, **options})
    with pytest.raises(ConfigError, match=needle):
        eq.run(cfg, steps=1, devices=4)
