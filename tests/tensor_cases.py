"""What the `tensor` and `tensor-auto` tests share: models, references, the comparison.

The models they split, their `single` references, and the equivalence check that sets the
ViT's key bias (gradient zero in exact arithmetic) apart."""

import functools

import jax
import numpy as np

import equivalence as eq

# lr 0.02: the stack-mlp diverges at the protocol's default 0.1, and a diverging run is a
# weak comparison.
# cnn, resnet at batch 12: a channel-split sum rounds differently from the whole conv's, and
# a ReLU or max-pool input within that rounding of its threshold then decides the other way
# (batch norm magnifies the rounding first), sending a gradient elsewhere: on other batches
# such a tie moves the ResNet's gradient by up to 3e-3 and the CNN's by 3e-5 (float64 shows
# the split itself exact: test_tensor's float64 test). The protocol's 1e-5 is for rounding.
CONV = dict(width=None, depth=None, lr=0.02, batch_size=12)
MODELS = {"stack-mlp": dict(width=32, depth=4, lr=0.02), "vit": dict(depth=2, lr=0.02),
          "cnn": CONV, "resnet": CONV}


@functools.lru_cache(maxsize=None)
def reference(model: str) -> eq.Trace:
    return eq.run(eq.config(model=model, **MODELS[model]))


def devices_of(mesh: str) -> int:
    return int(np.prod([int(p.split("=")[1]) for p in mesh.split(",")]))


def _split_key_bias(trace):
    """The ViT's key bias has a mathematically zero gradient (softmax ignores a shift shared
    by all keys), so it is float noise around 0 and norm-relative error means nothing there:
    compare it absolutely and the rest by the protocol."""
    def pop(tree):
        tree = jax.tree.map(np.asarray, tree)
        noise = [blk["key"].pop("bias") for blk in tree.get("blocks", {}).values() if "key" in blk]
        return tree, noise
    return pop(trace.grads), pop(trace.params)


def run_and_compare(strategy: str, model: str, mesh: str) -> eq.Trace:
    """Run `strategy` on `mesh` and check it against `single` (the protocol, key bias apart);
    the state round-trips through the reference layout. Returns the run."""
    cfg = eq.config(model=model, strategy=strategy, mesh=mesh, **MODELS[model])
    got = eq.run(cfg, devices=devices_of(mesh))
    ref = reference(model)
    (rg, rg_noise), (rp, rp_noise) = _split_key_bias(ref)
    (gg, gg_noise), (gp, gp_noise) = _split_key_bias(got)
    eq.assert_tree_close(rg, gg, what="step-1 gradients")
    eq.assert_tree_close(rp, gp, what="parameters")
    np.testing.assert_allclose(got.losses, ref.losses, rtol=eq.TOL * 10)
    for a, b in zip(rg_noise + rp_noise, gg_noise + gp_noise):
        np.testing.assert_allclose(a, b, atol=1e-7)
    s = got.strategy
    ref_state = s.state_to_reference(got.state)
    eq.assert_tree_close(ref_state, s.state_to_reference(s.state_from_reference(ref_state)))
    eq.assert_tree_close(jax.device_get(ref.state.model_state), ref_state.model_state,
                         what="batch-norm statistics")  # {} without batch norm
    return got


def step_collective_bytes(got: eq.Trace) -> tuple[int, int]:
    """(measured, theory) collective bytes of the run's compiled step."""
    s = got.strategy
    batch = s.place_batch(eq.batches(s.config.data.batch_size, 1)[0])
    return s.compile("step", got.state, batch).collective_bytes["total"], s.theory()["total"]


def assert_split_as_specified(got: eq.Trace) -> None:
    """Parameter bytes per device: 1/T of every leaf the split divides, all of the rest."""
    from jaxpar.parallel.tensor.megatron import param_spec
    from jaxpar.parallel.layout import leaves
    t = got.strategy.describe()["tensor_degree"]
    want = sum(x.nbytes // (t if "tensor" in param_spec(path) else 1) for path, x in leaves(got.params))
    assert got.strategy.param_bytes == want


def assert_blocks_split(got: eq.Trace) -> None:
    """Block parameters split T ways per device, the rest replicated."""
    s = got.strategy
    t = s.describe()["tensor_degree"]
    full = sum(x.nbytes for x in jax.tree.leaves(got.params))
    blocks = sum(x.nbytes for x in jax.tree.leaves(got.params["blocks"]))
    assert full - blocks + blocks / t <= s.param_bytes < full - blocks + blocks / t + 0.1 * blocks
