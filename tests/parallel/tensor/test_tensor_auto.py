"""`tensor-auto` (the Megatron split as PartitionSpecs, plain jit) equals `single`.

By the equivalence protocol; the compiler's collective bytes are reported beside theory;
parameter bytes per device shrink about 1/T; indivisible head counts are clear errors."""

import pytest

import equivalence as eq
import tensor_cases as tc
from conftest import requires_devices
from jaxpar.errors import ConfigError

CASES = [("stack-mlp", "tensor=2"), ("stack-mlp", "data=2,tensor=2"),
         ("vit", "tensor=2"), ("vit", "data=2,tensor=2"), ("cnn", "tensor=2"), ("resnet", "tensor=2")]


@requires_devices(4)
@pytest.mark.parametrize("model,mesh", CASES)
def test_tensor_auto_matches_single(model, mesh):
    got = tc.run_and_compare("tensor-auto", model, mesh)
    measured, theory = tc.step_collective_bytes(got)
    print(f"{model} {mesh}: tensor-auto measured {measured} B, theory {theory} B")
    assert measured > 0  # the compiler's choice, reported beside theory
    (tc.assert_split_as_specified if model in ("cnn", "resnet") else tc.assert_blocks_split)(got)


@requires_devices(8)
def test_heads_not_divisible_is_a_config_error():
    cfg = eq.config(model="vit", strategy="tensor-auto", mesh="tensor=8", depth=1)
    with pytest.raises(ConfigError, match="heads"):
        eq.run(cfg, steps=1, devices=8)
