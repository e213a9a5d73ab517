"""`fsdp` (ZeRO-3, explicit all-gather and reduce-scatter): its collectives equal theory and
it keeps 1/N of the state per device.

The equivalence protocol for every data-parallel strategy is in test_dp_common.py."""

import equivalence as eq
from conftest import requires_devices

NAME = "fsdp"


@requires_devices(8)
def test_explicit_collectives_equal_theory_exactly():
    eq.assert_explicit_collectives_equal_theory(eq.accounting(NAME))


@requires_devices(8)
def test_fsdp_keeps_one_nth_of_the_state_per_device():
    full = eq.accounting("dp-auto")["state_bytes_per_device"]
    sharded = eq.accounting(NAME)["state_bytes_per_device"]
    assert sharded <= full / 8 + 1024, (sharded, full)
