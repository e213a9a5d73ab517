"""`dp-pmap` (the legacy `jax.pmap` API): its psum of gradients equals theory.

The equivalence protocol for every data-parallel strategy is in test_dp_common.py."""

import equivalence as eq
from conftest import requires_devices

NAME = "dp-pmap"


@requires_devices(8)
def test_explicit_collectives_equal_theory_exactly():
    eq.assert_explicit_collectives_equal_theory(eq.accounting(NAME))
