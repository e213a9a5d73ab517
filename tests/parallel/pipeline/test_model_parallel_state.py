"""Model-parallel strategies move the *whole* state: optimizer state and evaluation too.

After a few momentum steps the optimizer state (momentum's trace, parameter-shaped) in the
reference layout equals `single`'s, and an evaluation batch gives `single`'s metric sums.
(The equivalence tests compare parameters and gradients; these catch a layout that
scrambles optimizer state or an eval path that differs from the training one.)"""

import functools

import jax
import pytest

import equivalence as eq
from conftest import requires_devices

OPTIONS = dict(model="stack-mlp", width=32, depth=4, batch_size=16, lr=0.02, optimizer="momentum")
CASES = [("tensor", "data=2,tensor=2", 4), ("tensor-auto", "tensor=2", 2),
         ("layer-split", "stage=2", 2)]


@functools.lru_cache(maxsize=None)
def reference():
    return eq.run(eq.config(**OPTIONS), steps=3)


@requires_devices(4)
@pytest.mark.parametrize("strategy,mesh,devices", CASES)
def test_optimizer_state_and_eval_equal_single(strategy, mesh, devices):
    ref = reference()
    got = eq.run(eq.config(strategy=strategy, mesh=mesh, **OPTIONS), steps=3, devices=devices)
    s = got.strategy
    state = s.state_to_reference(got.state)
    eq.assert_tree_close(jax.device_get(ref.state.opt_state), state.opt_state, what="optimizer state")
    assert int(state.step) == 3

    batch = eq.batches(OPTIONS["batch_size"], 1, seed=1)[0]
    want = jax.device_get(ref.strategy.eval_step(ref.state, ref.strategy.place_batch(batch)))
    have = jax.device_get(s.eval_step(got.state, s.place_batch(batch)))
    eq.assert_tree_close(want, have, what="eval metric sums")
