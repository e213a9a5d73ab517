"""Sentences in docs/ that say "tested", each checked exactly as worded (the byte claims are in
tests/parallel/test_theory_bytes.py). Change a claim and its test together."""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from conftest import requires_devices
from equivalence import batches, config
from experiments.__main__ import run
from jaxpar.optim import make_optimizer
from jaxpar.train import build_model, make_strategy

# docs/studies/hparam.md: "vmapped and one-by-one losses agree within 1e-6 a step".
HPARAM_LOSS_AGREEMENT = 1e-6


def temp_bytes(devices: int, **options) -> int:
    """XLA's temporary memory of the compiled training step on the fullest device."""
    cfg = config(**options)
    strategy = make_strategy(cfg)
    mesh = strategy.make_mesh(jax.devices()[:devices])
    state = strategy.init(build_model(cfg), make_optimizer(cfg.optim, total_steps=1), mesh)
    programs = strategy.compile("step", state, strategy.place_batch(batches(cfg.data.batch_size, 1)[0]))
    return programs.memory["temp_bytes"]


@requires_devices(2)
def test_1f1b_needs_less_temporary_memory_than_gpipe_even_with_remat():
    """docs/strategies.md (pipelines, the SPMD formulation): at S = 2, M = 16, stack-mlp width
    64 x 4 blocks, batch 128, 1F1B's temporary memory is below GPipe's and below GPipe with
    --remat. (The host-driven formulation holds residuals as outputs between programs: its
    activation memory is tested in tests/parallel/pipeline/test_pipeline.py.)"""
    shape = dict(strategy="pipeline", mesh="stage=2", microbatches=16, model="stack-mlp",
                 width=64, depth=4, batch_size=128, pipeline_impl="spmd")
    gpipe = temp_bytes(2, schedule="gpipe", **shape)
    remat = temp_bytes(2, schedule="gpipe", remat=True, **shape)
    one_f = temp_bytes(2, schedule="1f1b", **shape)
    assert one_f < remat < gpipe, (one_f, remat, gpipe)


def test_hparam_vmapped_losses_agree_with_one_by_one_at_the_stated_tolerance(tmp_path):
    """docs/studies/hparam.md: in the quick mode every trial's loss at every step agrees
    between the vmapped program and the trial run alone within 1e-6, absolute and relative."""
    out = tmp_path / "hparam"
    assert run(["hparam", "--quick", "--out", str(out)]) == 0
    groups = json.loads((out / "hparam.json").read_text())["metrics"]["groups"]
    for g in groups:
        par, seq = np.array(g["losses_vmapped"]), np.array(g["losses_sequential"])
        assert par.shape == seq.shape and par.size > 0
        diff = np.abs(par - seq)
        assert diff.max() <= HPARAM_LOSS_AGREEMENT, diff.max()
        assert (diff / np.abs(seq)).max() <= HPARAM_LOSS_AGREEMENT


def test_the_strategies_study_model_has_the_stated_parameter_count():
    """docs/studies/strategies.md and the README: stack-mlp width 256 x 8 blocks has 4.41 M parameters
    (52.9 MB of parameters and Adam's two moments: 3 x 4 B each)."""
    cfg = config(model="stack-mlp", width=256, depth=8)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(build_model(cfg), nnx.Param)))
    assert count == 4_408_074
    assert abs(3 * 4 * count / 1e6 - 52.9) < 0.05
