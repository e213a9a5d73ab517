"""`dp-auto` (XLA places the all-reduce): the compiler's collective bytes beside theory.

The equivalence protocol for every data-parallel strategy is in test_dp_common.py."""

import equivalence as eq
from conftest import requires_devices

NAME = "dp-auto"


@requires_devices(8)
def test_dp_auto_reports_measured_beside_theory():
    acc = eq.accounting(NAME)
    grad_bytes = acc["collective_bytes_theory"]["total"]
    # The compiler chooses its own collectives; it must at least all-reduce the gradient once.
    assert grad_bytes <= acc["collective_bytes_per_step"] <= 2 * grad_bytes
    assert acc["collective_bytes_theory"]["ring_bytes_per_device"] == int(2 * 7 / 8 * (grad_bytes - 12))
