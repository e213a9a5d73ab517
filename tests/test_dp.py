"""Data parallelism, every way: each strategy equals `single` on the same global batch
(DESIGN.md's protocol), counts its communication exactly, and survives hundreds of steps."""

import functools

import jax
import numpy as np
import pytest
from jax import lax

import equivalence as eq
from conftest import requires_devices
from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.config import ConfigError
from jaxpar.mesh import DATA, MeshError
from jaxpar.optim import make_optimizer
from jaxpar.parallel import STRATEGIES
from jaxpar.parallel.dp_shard_map import DPShardMap
from jaxpar.train import build_model, fit

DP = ["dp-pmap", "dp-shard-map", "dp-auto", "fsdp", "local-sgd"]
ADAM_TOL = 1e-4  # Adam divides by sqrt(v): rounding in tiny gradients is amplified


@functools.lru_cache(maxsize=None)
def reference(optimizer="sgd", batch_size=64, steps=5, lr=0.1):
    return eq.run(eq.config(optimizer=optimizer, batch_size=batch_size, lr=lr), steps=steps)


@requires_devices(8)
@pytest.mark.parametrize("strategy", DP)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_equals_single_on_8_devices(strategy, optimizer):
    got = eq.run(eq.config(strategy=strategy, optimizer=optimizer), steps=5, devices=8)
    eq.assert_equivalent(reference(optimizer), got)


@pytest.mark.parametrize("strategy", DP)
@pytest.mark.parametrize("devices", [2, 4])
def test_equals_single_on_smaller_meshes(strategy, devices):
    got = eq.run(eq.config(strategy=strategy), steps=5, devices=devices)
    eq.assert_equivalent(reference(), got)


@requires_devices(8)
@pytest.mark.parametrize("strategy", ["dp-shard-map", "dp-auto", "fsdp", "dp-pmap"])
def test_adam_equals_single_at_stated_tolerance(strategy):
    ref = reference("adam", lr=1e-3)
    got = eq.run(eq.config(strategy=strategy, optimizer="adam", lr=1e-3), steps=5, devices=8)
    eq.assert_equivalent(ref, got, tol=ADAM_TOL)


@requires_devices(8)
@pytest.mark.parametrize("strategy", ["dp-pmap", "dp-shard-map", "dp-auto", "fsdp"])
def test_uneven_batch_of_100_on_8_devices_equals_unpadded_run(strategy):
    ref = reference(batch_size=100)
    got = eq.run(eq.config(strategy=strategy, batch_size=100), steps=5, devices=8)
    eq.assert_equivalent(ref, got)


@requires_devices(8)
@pytest.mark.parametrize("strategy,k", [("dp-shard-map", 4), ("dp-auto", 2), ("fsdp", 2),
                                        ("dp-pmap", 2)])
def test_accumulation_equals_the_large_batch(strategy, k):
    got = eq.run(eq.config(strategy=strategy, accumulate=k), steps=5, devices=8)
    eq.assert_equivalent(reference(), got)


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
    ratio = np.linalg.norm(jax.tree.leaves(got.grads)[0]) / np.linalg.norm(jax.tree.leaves(reference().grads)[0])
    assert ratio > 4  # about N = 8 times too large
    with pytest.raises(AssertionError, match="gradients"):
        eq.assert_equivalent(reference(), got)


def test_local_sgd_equals_its_sequential_emulation():
    n, k, steps, bs = 4, 3, 6, 64
    cfg = eq.config(strategy="local-sgd", sync_every=k, optimizer="momentum", lr=0.05)
    global_batches = eq.batches(bs, steps)
    got = eq.run(cfg, steps=steps, devices=n, global_batches=global_batches)

    # Emulation: n independent single-device runs, each on its own shard, averaged every k.
    tx = make_optimizer(cfg.optim, steps)
    graphdef, params, model_state = steplib.split_model(build_model(cfg))
    replicas = [steplib.init_state(params, model_state, tx) for _ in range(n)]
    for t, batch in enumerate(global_batches):
        shards = [{key: v[i * bs // n:(i + 1) * bs // n] for key, v in batch.items()} for i in range(n)]
        replicas = [steplib.train_step(graphdef, tx, r, s)[0] for r, s in zip(replicas, shards)]
        if (t + 1) % k == 0:
            mean = jax.tree.map(lambda *p: sum(p) / n, *[r.params for r in replicas])
            replicas = [r.replace(params=mean) for r in replicas]
    eq.assert_tree_close(jax.device_get(replicas[0].params), got.params)


def _compiled_stats(strategy_name, devices=8, **options):
    from jaxpar import measure

    t = eq.run(eq.config(strategy=strategy_name, **options), steps=1, devices=devices)
    batch = t.strategy.place_batch(eq.batches(64, 1)[0])
    compiled, _ = t.strategy.compile("step", t.state, batch)
    return t.strategy.accounting(measure.program_stats(compiled), t.state)


@requires_devices(8)
@pytest.mark.parametrize("strategy", ["dp-shard-map", "dp-pmap", "fsdp", "local-sgd"])
def test_explicit_collectives_equal_theory_exactly(strategy):
    acc = _compiled_stats(strategy, sync_every=2)
    theory = acc["collective_bytes_theory"]
    assert acc["collective_bytes_per_step"] == theory["total"]
    for op, nbytes in acc["collective_bytes_by_op"].items():
        assert nbytes == theory.get(op), (op, acc["collective_bytes_by_op"], theory)


@requires_devices(8)
def test_dp_auto_reports_measured_beside_theory():
    acc = _compiled_stats("dp-auto")
    grad_bytes = acc["collective_bytes_theory"]["total"]
    # The compiler chooses its own collectives; it must at least all-reduce the gradient once.
    assert grad_bytes <= acc["collective_bytes_per_step"] <= 2 * grad_bytes
    assert acc["collective_bytes_theory"]["ring_bytes_per_device"] == int(2 * 7 / 8 * (grad_bytes - 12))


@requires_devices(8)
def test_fsdp_keeps_one_nth_of_the_state_per_device():
    full = _compiled_stats("dp-auto")["state_bytes_per_device"]
    sharded = _compiled_stats("fsdp")["state_bytes_per_device"]
    assert sharded <= full / 8 + 1024, (sharded, full)


@requires_devices(8)
def test_hundreds_of_collective_steps_do_not_deadlock():
    cfg = eq.config(strategy="dp-shard-map", width=16, depth=1, batch_size=32, steps=300,
                    synthetic_size=2000, val_size=100, epochs=1)
    out = fit(cfg)
    assert out.result.metrics["steps"] == 300 and np.isfinite(out.result.metrics["final_loss"])


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
    eq.assert_equivalent(reference(), got)


def test_bad_accumulate_names_the_flag():
    with pytest.raises(ConfigError, match="--accumulate"):
        eq.run(eq.config(strategy="dp-shard-map", accumulate=0), steps=1, devices=2)


def test_axis_names_are_constants():
    assert meshlib.DATA == "data"
