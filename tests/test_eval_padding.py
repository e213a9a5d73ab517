"""Evaluation works on every mesh with the default --eval-batch-size: batches that do not
split over the data shards (or the last, short batch) are padded with weight-0 rows, and the
metrics equal `single`'s."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar import data as datalib
from jaxpar.optim import make_optimizer
from jaxpar.results import load
from jaxpar.train import build_model, evaluate, make_strategy
from test_mpi_launch import MPIEXEC, mpi_env

ROOT = Path(__file__).resolve().parent.parent


def evaluated(cfg, devices: int) -> dict[str, float]:
    """Loss and accuracy over 1,001 examples (the default eval batch 1000 does not split over
    3 shards, and leaves a last batch of 1), after 2 training steps of batch 96."""
    strategy = make_strategy(cfg)
    mesh = strategy.make_mesh(jax.devices()[:devices])
    state = strategy.init(build_model(cfg), make_optimizer(cfg.optim, 2), mesh)
    for batch in eq.batches(cfg.data.batch_size, 2):
        state, sums = strategy.step(state, strategy.place_batch(batch))
        jax.device_get(sums)  # one collective step in flight
    split = datalib.synthetic(1001, seed=5)
    return evaluate(strategy, state, split, cfg.data.eval_batch_size)


@requires_devices(6)
@pytest.mark.parametrize("strategy,mesh,devices", [
    ("tensor", "data=3,tensor=2", 6), ("tensor-auto", "data=3,tensor=2", 6),
    ("hybrid", "data=3,stage=2", 6), ("pipeline", "stage=2", 2),
    ("layer-split", "stage=2", 2), ("dp-shard-map", "data=3", 3), ("local-sgd", "data=3", 3)])
def test_default_eval_batch_evaluates_like_single_on_any_mesh(strategy, mesh, devices):
    base = eq.config(model="stack-mlp", width=32, depth=2, batch_size=96, microbatches=2)
    assert base.data.eval_batch_size == 1000  # the default, which 3 shards do not divide
    ref = evaluated(base, 1)
    got = evaluated(eq.with_options(base, strategy=strategy, mesh=mesh), devices)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert got["accuracy"] == ref["accuracy"]


@pytest.mark.skipif(not MPIEXEC.exists() or shutil.which("timeout") is None,
                    reason="needs the `mpi` extra in this venv (make test installs it)")
def test_three_mpi_ranks_with_the_default_eval_batch_equal_single(tmp_path):
    env = mpi_env()
    args = ["--dataset", "synthetic", "--synthetic-size", "2000", "--val-size", "500", "--model",
            "mlp", "--width", "32", "--depth", "1", "--batch-size", "96", "--steps", "4",
            "--optimizer", "sgd", "--lr", "0.1", "--lr-schedule", "constant", "--no-progress"]

    def launch(prefix, strategy, out):
        start = time.monotonic()
        proc = subprocess.run(["timeout", "300", *prefix, sys.executable, "-m", "mpi4py", "-m",
                               "experiments", "train", "--strategy", strategy, *args, "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert time.monotonic() - start < 280
        return load(out / "result.json")

    ref = launch([], "single", tmp_path / "single")
    got = launch([str(MPIEXEC), "-n", "3"], "mpi-allreduce", tmp_path / "mpi")
    assert got.env["mpi_ranks"] == 3
    for key in ("test_loss", "val_loss", "final_loss"):
        np.testing.assert_allclose(got.metrics[key], ref.metrics[key], rtol=1e-5, err_msg=key)
    for key in ("test_accuracy", "val_accuracy"):
        assert got.metrics[key] == ref.metrics[key], key
