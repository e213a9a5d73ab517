"""`fsdp` (ZeRO-3, explicit all-gather and reduce-scatter) equals `single`; 1/N state per device.

By the equivalence protocol on several meshes, optimizers, uneven batches and accumulation;
its collectives equal theory."""

import pytest

import equivalence as eq
from conftest import requires_devices

NAME = "fsdp"


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
def test_explicit_collectives_equal_theory_exactly():
    eq.assert_explicit_collectives_equal_theory(eq.accounting(NAME))


@requires_devices(8)
def test_fsdp_keeps_one_nth_of_the_state_per_device():
    full = eq.accounting("dp-auto")["state_bytes_per_device"]
    sharded = eq.accounting(NAME)["state_bytes_per_device"]
    assert sharded <= full / 8 + 1024, (sharded, full)
