"""Divergence stops the run: a non-finite loss ends training at that step with exit 3, the
result says `status: diverged`, and no checkpoint is written from a non-finite state."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from experiments.__main__ import run
from jaxpar import checkpoint, train
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import Diverged

EXPLODING = ["--dataset", "synthetic", "--model", "mlp",
             "--optimizer", "sgd", "--lr", "1e6", "--lr-schedule", "constant", "--steps", "200",
             "--no-progress"]


def test_sgd_at_lr_1e6_stops_within_a_few_steps_with_exit_3(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(["train", *EXPLODING, "--out", str(out)]) == Diverged.exit_code
    err = capsys.readouterr().err
    assert "training diverged at step" in err and "Lower --lr (it was 1e+06)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "diverged"
    assert 1 <= result["metrics"]["diverged_at_step"] <= 10
    assert result["metrics"]["steps"] < 200


def test_no_checkpoint_from_a_non_finite_state_and_resume_takes_the_last_good_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    code = run(["train", *EXPLODING, "--out", str(tmp_path / "out"), "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "1"])
    assert code == Diverged.exit_code
    stopped = json.loads((tmp_path / "out" / "result.json").read_text())["metrics"]["diverged_at_step"]
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert saved and max(saved) < stopped
    arrays, meta = checkpoint.load_checkpoint(str(ckpt))
    assert meta["step"] == max(saved)  # what --resume takes
    assert all(np.isfinite(a).all() for a in arrays.values() if np.issubdtype(a.dtype, np.floating))


def test_a_state_gone_non_finite_is_not_saved(tmp_path, monkeypatch):
    """Parameters turned NaN by a step whose own loss was still finite: the checkpoint due
    then is refused, not written."""
    monkeypatch.setattr(train, "finite", lambda tree: False)
    cfg = with_options(TrainConfig(), dataset="synthetic", model="mlp", width=16, depth=1, steps=3,
                       progress=False, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    with pytest.raises(Diverged, match="model's parameters is not finite") as stop:
        train.fit(cfg)
    assert stop.value.result.status == "diverged"
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()]


def test_finite():
    assert train.finite({"a": jax.numpy.ones(3), "b": (jax.numpy.zeros(2),)})
    assert not train.finite({"a": jax.numpy.array([1.0, np.nan])})
    assert not train.finite({"a": jax.numpy.array([np.inf])})


def test_waiting_every_few_steps_logs_every_step(monkeypatch):
    """On an accelerator the loop waits every 10 steps: the steps in between still count in
    the running sums and the time (as when it waits every step)."""
    cfg = with_options(TrainConfig(), dataset="synthetic", model="mlp", width=16, depth=1,
                       steps=12, progress=False, val_size=0)
    every_step = train.fit(cfg).result
    monkeypatch.setattr(train, "sync_interval", lambda: 5)
    windows = train.fit(cfg).result
    assert windows.metrics["final_loss"] == pytest.approx(every_step.metrics["final_loss"], rel=1e-6)
    assert windows.metrics["steps"] == 12
