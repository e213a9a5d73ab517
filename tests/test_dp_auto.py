"""`dp-auto` (XLA places the all-reduce) equals `single` by the equivalence protocol.

On several meshes, optimizers, uneven batches and accumulation; the compiler's collective
bytes are reported beside theory."""

import pytest

import equivalence as eq
from conftest import requires_devices

NAME = "dp-auto"


@requires_devices(8)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_equals_single_on_8_devices(optimizer):
    got = eq.run(eq.config(strategy=NAME, optimizer=optimizer), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(optimizer), got)


@pytest.mark.parametrize("devices", [2, 4])
def test_equals_single_on_smaller_meshes(devices):
    eq.assert_equivalent(eq.reference(), eq.run(eq.config(strategy=NAME), steps=5, devices=devices))


@requires_devices(8)
def test_adam_equals_single_at_stated_tolerance():
    got = eq.run(eq.config(strategy=NAME, optimizer="adam", lr=1e-3), steps=5, devices=8)
    eq.assert_equivalent(eq.reference("adam", lr=1e-3), got, tol=eq.ADAM_TOL)


@requires_devices(8)
def test_uneven_batch_of_100_on_8_devices_equals_unpadded_run():
    got = eq.run(eq.config(strategy=NAME, batch_size=100), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(batch_size=100), got)


@requires_devices(8)
def test_accumulation_equals_the_large_batch():
    got = eq.run(eq.config(strategy=NAME, accumulate=2), steps=5, devices=8)
    eq.assert_equivalent(eq.reference(), got)


@requires_devices(8)
def test_dp_auto_reports_measured_beside_theory():
    acc = eq.accounting(NAME)
    grad_bytes = acc["collective_bytes_theory"]["total"]
    # The compiler chooses its own collectives; it must at least all-reduce the gradient once.
    assert grad_bytes <= acc["collective_bytes_per_step"] <= 2 * grad_bytes
    assert acc["collective_bytes_theory"]["ring_bytes_per_device"] == int(2 * 7 / 8 * (grad_bytes - 12))
