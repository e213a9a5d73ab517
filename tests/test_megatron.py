"""The Megatron split (`jaxpar/parallel/megatron.py`): which parameter splits how, and what cannot.

Its numbers are checked end to end by test_tensor.py and test_hybrid.py (equivalence with
`single`, all-reduce bytes equal to theory); these pin the layout rules themselves.

    python -m pytest -q tests/test_megatron.py
"""

import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE, TENSOR
from jaxpar.models import make_model
from jaxpar.parallel import megatron


def test_column_layers_split_outputs_and_row_layers_inputs():
    for layer in ("up", "query", "key", "value"):
        assert megatron.leaf_spec(layer, "kernel") == P(None, TENSOR)
        assert megatron.leaf_spec(layer, "bias") == P(TENSOR)
    for layer in ("down", "out"):
        assert megatron.leaf_spec(layer, "kernel") == P(TENSOR, None)
        assert megatron.leaf_spec(layer, "bias") == P()  # added once, after the psum
    assert megatron.leaf_spec("ln1", "scale") == P()


def test_leading_axes_come_first():  # hybrid's blocks stacked [L, ...] over STAGE
    assert megatron.leaf_spec("up", "kernel", lead=(STAGE,)) == P(STAGE, None, TENSOR)
    assert megatron.leaf_spec("down", "kernel", lead=(STAGE,)) == P(STAGE, TENSOR, None)
    assert megatron.leaf_spec("down", "bias", lead=(STAGE,)) == P(STAGE)


@pytest.mark.parametrize("model,options,degree,needle", [
    ("stack-mlp", dict(width=32, depth=1), 3, "--width 32"),
    ("vit", dict(width=32, depth=1), 8, "4 heads"),
])
def test_what_does_not_split_names_the_option(model, options, degree, needle):
    built = make_model(model, seed=0, **options)
    with pytest.raises(ConfigError, match=needle):
        megatron.check_divisible(built, degree, "tensor")
    megatron.check_divisible(built, 2, "tensor")  # and what does, passes
