"""`tensor` (the Megatron split written out in shard_map) equals `single`; bytes equal theory.

By the equivalence protocol; its all-reduce bytes equal Megatron's theory exactly; parameter
bytes per device shrink about 1/T; indivisible widths and unsplittable models are clear
errors."""

import pytest

import equivalence as eq
import tensor_cases as tc
from conftest import requires_devices
from jaxpar.errors import ConfigError

CASES = [("stack-mlp", "tensor=4"), ("stack-mlp", "data=2,tensor=2"),
         ("vit", "tensor=2"), ("vit", "tensor=4")]


@requires_devices(4)
@pytest.mark.parametrize("model,mesh", CASES)
def test_tensor_matches_single(model, mesh):
    got = tc.run_and_compare("tensor", model, mesh)
    measured, theory = tc.step_collective_bytes(got)
    assert measured == theory  # explicit collectives: theory exactly
    tc.assert_blocks_split(got)


@requires_devices(4)
def test_width_not_divisible_is_a_config_error():
    cfg = eq.config(model="stack-mlp", strategy="tensor", mesh="tensor=3", width=32, depth=2)
    with pytest.raises(ConfigError, match="--width"):
        eq.run(cfg, steps=1, devices=3)


def test_unsplittable_model_is_a_config_error():
    cfg = eq.config(model="mlp", strategy="tensor", mesh="tensor=1")
    with pytest.raises(ConfigError, match="--model"):
        eq.run(cfg, steps=1, devices=1)
