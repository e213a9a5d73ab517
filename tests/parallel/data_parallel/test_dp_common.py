"""What every data-parallel strategy shares (`parallel/dp_common.py`): the equivalence
protocol, mesh, padding, errors.

Every strategy of the data-parallel family (read from the registry, so a new one is tested
without a line here) equals `single` on 8, 4 and 2 devices with SGD and momentum; those that
average gradients also with Adam, on an uneven batch and with accumulation (local-sgd
averages weights instead: its own tests compare it with its emulation). Then the data-only
mesh, padding to the devices and accumulation chunks, and errors that name the flag."""

import jax
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar.errors import ConfigError, MeshError
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.data_parallel.local_sgd import LocalSGD

DATA_PARALLEL = [n for n, cls in STRATEGIES.items() if cls.family == "data parallel"]
GRADIENT_AVERAGING = [n for n in DATA_PARALLEL if not issubclass(STRATEGIES[n], LocalSGD)]


@requires_devices(8)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_equals_single_on_8_devices(strategy, optimizer):
    got = eq.run(eq.config(strategy=strategy, optimizer=optimizer), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(optimizer), got)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_equals_single_on_smaller_meshes(strategy, devices):
    eq.assert_equivalent(eq.reference(), eq.run(eq.config(strategy=strategy), steps=5, devices=devices))


@requires_devices(8)
@pytest.mark.parametrize("optimizer", ["adagrad", "rmsprop"])
def test_adaptive_optimizers_equal_single_with_sharded_state(optimizer):
    """AdaGrad's and RMSProp's accumulators sharded by fsdp, at Adam's stated tolerance."""
    got = eq.run(eq.config(strategy="fsdp", optimizer=optimizer, lr=1e-3), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(optimizer, lr=1e-3), got, tol=eq.ADAM_TOL)


@requires_devices(8)
@pytest.mark.parametrize("strategy", GRADIENT_AVERAGING)
def test_adam_equals_single_at_stated_tolerance(strategy):
    got = eq.run(eq.config(strategy=strategy, optimizer="adam", lr=1e-3), steps=5, devices=8)
    eq.assert_equivalent(eq.reference("adam", lr=1e-3), got, tol=eq.ADAM_TOL)


@requires_devices(8)
@pytest.mark.parametrize("strategy", GRADIENT_AVERAGING)
def test_uneven_batch_of_100_on_8_devices_equals_unpadded_run(strategy):
    got = eq.run(eq.config(strategy=strategy, batch_size=100), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(batch_size=100), got)


@requires_devices(8)
@pytest.mark.parametrize("strategy,k", [(n, 4 if n == "dp-shard-map" else 2) for n in GRADIENT_AVERAGING])
def test_accumulation_equals_the_large_batch(strategy, k):
    got = eq.run(eq.config(strategy=strategy, accumulate=k), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(), got)


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
