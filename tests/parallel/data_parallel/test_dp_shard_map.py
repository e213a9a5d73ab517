"""`dp-shard-map`: its all-reduce equals theory, the protocol catches the shard_map gotcha
(a gradient N times too large), and hundreds of steps do not deadlock.

The equivalence protocol for every data-parallel strategy is in test_dp_common.py."""

import jax
import numpy as np
import pytest
from jax import lax

import equivalence as eq
from conftest import requires_devices
from jaxpar import step as steplib
from jaxpar.mesh import DATA
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.data_parallel.dp_shard_map import DPShardMap
from jaxpar.train import fit

NAME = "dp-shard-map"


@requires_devices(8)
def test_explicit_collectives_equal_theory_exactly():
    eq.assert_explicit_collectives_equal_theory(eq.accounting(NAME))


class _PmeanOfSummedGrads(DPShardMap):
    """The shard_map gotcha: grads w.r.t. replicated params are already summed over the
    axis; averaging them once more leaves them N times too large."""

    name = "buggy"

    def _grads(self, state, batch):
        denom = lax.psum(batch["weight"].sum(), DATA)
        grads, (model_state, sums) = steplib.grad_fn(state.params, self.graphdef,
                                                     state.model_state, batch, denom)
        grads = jax.tree.map(lambda g: lax.psum(g, DATA), grads)  # summed twice
        return grads, model_state, {**lax.psum({k: sums[k] for k in ("loss_sum", "correct")}, DATA),
                                    "count": denom}


@requires_devices(8)
def test_a_gradient_n_times_too_large_is_caught(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "buggy", _PmeanOfSummedGrads)
    got = eq.run(eq.config(strategy="buggy"), steps=2, devices=8)
    ratio = np.linalg.norm(jax.tree.leaves(got.grads)[0]) / np.linalg.norm(jax.tree.leaves(eq.reference().grads)[0])
    assert ratio > 4  # about N = 8 times too large
    with pytest.raises(AssertionError, match="gradients"):
        eq.assert_equivalent(eq.reference(), got)


@requires_devices(8)
def test_hundreds_of_collective_steps_do_not_deadlock():
    cfg = eq.config(strategy=NAME, width=16, depth=1, batch_size=32, steps=300,
                    synthetic_size=2000, val_size=100, epochs=1)
    out = fit(cfg)
    assert out.result.metrics["steps"] == 300 and np.isfinite(out.result.metrics["final_loss"])
