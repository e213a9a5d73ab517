"""The Megatron split (`jaxpar/parallel/tensor/megatron.py`): which parameter splits how, and what cannot.

Its numbers are checked end to end by test_tensor.py and test_hybrid.py (equivalence with
`single`, all-reduce bytes equal to theory); these pin the layout rules themselves.

    python -m pytest -q tests/parallel/tensor/test_megatron.py
"""

import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.mesh import TENSOR
from jaxpar.models import make_model
from jaxpar.parallel.tensor import megatron


def test_column_layers_split_outputs_and_row_layers_inputs():
    for layer in ("up", "query", "key", "value"):
        assert megatron.leaf_spec(layer, "kernel") == P(None, TENSOR)
        assert megatron.leaf_spec(layer, "bias") == P(TENSOR)
    for layer in ("down", "out"):
        assert megatron.leaf_spec(layer, "kernel") == P(TENSOR, None)
        assert megatron.leaf_spec(layer, "bias") == P()  # added once, after the psum
    assert megatron.leaf_spec("ln1", "scale") == P()


def test_any_models_leaves_split_by_their_path():
    # a block's Linear layers as above, wherever the block sits
    assert megatron.param_spec(("blocks", 3, "up", "kernel")) == P(None, TENSOR)
    assert megatron.param_spec(("blocks", 3, "ln1", "scale")) == P()
    # a ResNet block's conv pair by channels: the first conv (and its BN) by output, the second by input
    assert megatron.param_spec(("blocks", 0, "conv1", "kernel")) == P(None, None, None, TENSOR)
    assert megatron.param_spec(("blocks", 0, "bn1", "mean")) == P(TENSOR)
    assert megatron.param_spec(("blocks", 0, "conv2", "kernel")) == P(None, None, TENSOR, None)
    assert megatron.param_spec(("blocks", 0, "conv2", "bias")) == P()  # added once, after the psum
    # the CNN: conv2 (and bn2) by output channels, fc1 by output features, fc2 by input rows
    assert megatron.param_spec(("conv2", "kernel")) == P(None, None, None, TENSOR)
    assert megatron.param_spec(("conv2", "bias")) == P(TENSOR)
    assert megatron.param_spec(("bn2", "var")) == P(TENSOR)
    assert megatron.param_spec(("fc1", "kernel")) == P(None, TENSOR)
    assert megatron.param_spec(("fc1", "bias")) == P(TENSOR)
    assert megatron.param_spec(("fc2", "kernel")) == P(TENSOR, None)
    for replicated in (("conv1", "kernel"), ("bn1", "scale"), ("fc2", "bias"),
                       ("blocks", 1, "proj_conv", "kernel"), ("blocks", 1, "bn2", "scale"),
                       ("stem_conv", "kernel")):
        assert megatron.param_spec(replicated) == P()


@pytest.mark.parametrize("model,options,degree,needle", [
    ("stack-mlp", dict(width=32, depth=1), 3, "--width 32"),
    ("vit", dict(width=32, depth=1), 8, "4 heads"),
    ("cnn", {}, 3, "64-channel"),
    ("resnet", {}, 32, "divisor of 16"),
])
def test_what_does_not_split_names_the_option(model, options, degree, needle):
    built = make_model(model, seed=0, **options)
    with pytest.raises(ConfigError, match=needle):
        megatron.check_divisible(built, degree, "tensor")
    megatron.check_divisible(built, 2, "tensor")  # and what does, passes
