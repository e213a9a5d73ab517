"""What every data-parallel strategy shares (`parallel/dp_common.py`): mesh, padding, errors.

The data-only mesh, padding to the devices and accumulation chunks, and errors that name
the flag."""

import jax
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar.errors import ConfigError, MeshError
from jaxpar.parallel import STRATEGIES


@requires_devices(8)
@pytest.mark.parametrize("spec,needle", [("data=16", "--devices 16"), ("data=3", "--mesh"),
                                         ("data=4,tensor=2", "--mesh")])
def test_bad_mesh_names_the_flag(spec, needle):
    strategy = STRATEGIES["dp-shard-map"](eq.config(strategy="dp-shard-map", mesh=spec))
    with pytest.raises(MeshError, match=needle):
        strategy.make_mesh(jax.devices()[:8])


def test_accumulation_chunks_that_do_not_divide_the_batch_are_padded():
    # 64 rows, 2 devices, 3 chunks: padded to 66 with weight-0 rows; still the same result
    got = eq.run(eq.config(strategy="dp-shard-map", accumulate=3), steps=5, devices=2)
    eq.assert_equivalent(eq.reference(), got)


def test_bad_accumulate_names_the_flag():
    with pytest.raises(ConfigError, match="--accumulate"):
        eq.run(eq.config(strategy="dp-shard-map", accumulate=0), steps=1, devices=2)
