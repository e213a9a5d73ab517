"""A model's stages as one SPMD program holds them (`jaxpar/parallel/pipeline/padded.py`): flat padded
vectors that round-trip, and stage functions that chain into the model.

    python -m pytest -q tests/parallel/pipeline/test_padded.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equivalence as eq
from jaxpar import step as steplib
from jaxpar.parallel.pipeline.hybrid import split_dim
from jaxpar.parallel.layout import leaves
from jaxpar.parallel.pipeline.spmd.layout import REP, SPLIT, PaddedStages as Stages
from jaxpar.train import build_model


def built(**options):
    cfg = eq.config(**options)
    return build_model(cfg), steplib.split_model(build_model(cfg))


@pytest.mark.parametrize("options,starts", [
    (dict(model="cnn", width=None, depth=None, batch_norm=True), (0, 1, 2, 3)),
    (dict(model="resnet", width=None, depth=None), (0, 2)),
    (dict(model="mlp", width=32, depth=3), (0, 1)),
])
def test_stage_functions_chain_into_the_model(options, starts):
    """Stage after stage through the padded buffer gives the model's logits and batch-norm
    statistics (training mode)."""
    model, (graphdef, params, stats) = built(**options)
    stages = Stages(model, starts, rows=4)
    p, z = stages.params.pack(params), stages.state.pack(stats)
    images = eq.batches(4, 1)[0]["image"]
    h, new = images, {}
    for s in range(stages.S):
        h, z_s = stages.forward(s, {REP: jnp.asarray(p[REP][s, 0])}, {REP: jnp.asarray(z[REP][s, 0])}, h, True)
        new[s] = np.asarray(z_s[REP])
        assert h.shape == (4, stages.width)
    logits, model_stats = steplib.forward(graphdef, params, stats, images, True)
    np.testing.assert_allclose(h[:, :10], logits, rtol=1e-5, atol=1e-6)
    unpacked = stages.state.unpack({REP: np.stack([new[s] for s in range(stages.S)])[:, None]})
    eq.assert_tree_close(jax.device_get(model_stats), unpacked, what="batch-norm statistics")


def test_pack_unpack_round_trips_with_replicas_and_a_tensor_split():
    model, (_, params, _) = built(model="stack-mlp", width=16, depth=4)
    gems = Stages(model, (0, 2, 4), rows=2, replicas=lambda d: [d, 2 - d])
    packed = gems.params.pack(params)
    assert packed[REP].shape == (3, 2, gems.params.width[REP])
    assert (packed[REP][0, 1] == packed[REP][2, 0]).all()  # device 0's second copy: stage 2
    eq.assert_tree_close(params, gems.params.unpack(packed))
    hybrid = Stages(model, (0, 3), rows=2, split=split_dim, degree=2)
    packed = hybrid.params.pack(params)
    assert packed[SPLIT].shape[:3] == (2, 2, 1)
    eq.assert_tree_close(params, hybrid.params.unpack(packed))
    split = sum(x.size for path, x in leaves(params) if split_dim(path) is not None)
    assert sum(sz[SPLIT] for sz in hybrid.params.sizes) * 2 == split  # each device holds 1/T


def test_padding_is_what_the_largest_stage_and_boundary_leave_over():
    model, (_, params, _) = built(model="cnn", width=None, depth=None)
    stages = Stages(model, (0, 1, 2, 3), rows=8)
    sizes = [sz[REP] for sz in stages.params.sizes]  # conv1 | conv2 | fc1 | fc2
    assert sizes == [3 * 3 * 32 + 32, 3 * 3 * 32 * 64 + 64, 3136 * 128 + 128, 128 * 10 + 10]
    assert stages.params.padding_elements() == 4 * max(sizes) - sum(sizes)
    assert stages.boundaries == [14 * 14 * 32, 7 * 7 * 64, 128] and stages.width == 14 * 14 * 32
    assert stages.padding_bytes_per_send() == [(6272 - n) * 8 * 4 for n in stages.boundaries]
