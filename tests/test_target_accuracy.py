"""--target-accuracy in the training loop (`jaxpar/train.py`): stop at the first validation.

The run stops at the first validation that reaches it, says so when the budget runs out
first, refuses values that cannot work, and keeps its time across --resume.

    python -m pytest -q tests/test_target_accuracy.py
"""

from __future__ import annotations

import shutil

import pytest

from jaxpar import checkpoint as ckptlib
from jaxpar.config import TrainConfig, with_options
from jaxpar.train import fit

# Validation accuracy of this run climbs 0.34 (step 3), 0.75 (6), 0.91 (9), 1.0 (12 on), at the
# learning rate pinned below (not the default, which may change with the main run's recipe).
TARGET = 0.9


def tiny(**kw) -> TrainConfig:
    base = dict(dataset="synthetic", synthetic_size=1200, val_size=200, batch_size=50, model="mlp",
                width=64, depth=1, epochs=2, eval_every=3, target_accuracy=TARGET, progress=False,
                lr=1e-3)
    return with_options(TrainConfig(), **{**base, **kw})


def test_stops_at_the_first_validation_that_reaches_the_target():
    result = fit(tiny()).result
    m, history = result.metrics, result.history
    assert m["reached_target"] is True
    assert m["steps_to_target"] == m["steps"] < 2 * 1000 // 50  # stopped well inside the budget
    assert m["steps_to_target"] % 3 == 0 and history[-1]["step"] == m["steps_to_target"]
    assert history[-1]["val_accuracy"] >= TARGET > max(h["val_accuracy"] for h in history[:-1])
    assert m["examples_to_target"] == m["steps_to_target"] * 50
    assert m["time_to_target_s"] == history[-1]["train_s"] > 0
    assert m["images_per_sec_to_target"] == pytest.approx(m["examples_to_target"] / m["time_to_target_s"])
    assert 0 <= m["test_accuracy"] <= 1  # the test split is still measured at the end


def test_budget_ending_first_is_not_reaching_it():
    m = fit(tiny(steps=8, eval_every=2, target_accuracy=1.0)).result.metrics
    assert m["reached_target"] is False and m["steps"] == 8
    assert m["steps_to_target"] is None and m["time_to_target_s"] is None


@pytest.mark.parametrize("flags,needle", [
    (["--target-accuracy", "1.5"], "--target-accuracy 1.5 is not valid: it must be a fraction in (0, 1]"),
    (["--target-accuracy", "0"], "--target-accuracy 0.0 is not valid: it must be a fraction in (0, 1]"),
    (["--target-accuracy", "0.8", "--val-size", "0"], "--val-size > 0")])
def test_bad_target_exits_2_with_the_rule_and_writes_nothing(tmp_path, capsys, flags, needle):
    from experiments.__main__ import run

    code = run(["train", "--dataset", "synthetic", "--synthetic-size", "600", "--val-size", "100",
                "--model", "mlp", "--width", "32", "--depth", "1", "--steps", "3", "--no-progress",
                *flags, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "r" / "result.json").exists()


def test_resume_keeps_steps_and_time_to_target(tmp_path):
    want = fit(tiny()).result
    directory = tmp_path / "ck"
    fit(tiny(checkpoint_dir=str(directory), checkpoint_every=3))  # saves 3, 6 and 9 (the stop)
    shutil.rmtree(directory / "9")  # as if killed after the checkpoint at step 6
    _, meta = ckptlib.load_checkpoint(str(directory))
    assert meta["step"] == 6 and meta["train_s"] > 0

    resumed = fit(tiny(checkpoint_dir=str(directory), checkpoint_every=3, resume=True)).result
    m = resumed.metrics
    assert m["resumed_from_step"] == 6 and m["reached_target"]
    assert m["steps_to_target"] == want.metrics["steps_to_target"] == 9
    # The clock carries on from the checkpoint: the 6 steps before it are counted.
    assert m["time_to_target_s"] > meta["train_s"] == resumed.history[1]["train_s"]
    assert [h["val_accuracy"] for h in resumed.history] == [h["val_accuracy"] for h in want.history]

    # Resuming a run that already reached its target trains nothing and reports the same.
    again = fit(tiny(checkpoint_dir=str(directory), checkpoint_every=3, resume=True)).result.metrics
    assert again["steps"] == 9 and again["resumed_from_step"] == 9
    assert again["time_to_target_s"] == m["time_to_target_s"]

    with pytest.raises(ckptlib.CheckpointError, match=r"--target-accuracy 0.9 \(now 0.8\)"):
        fit(tiny(checkpoint_dir=str(directory), checkpoint_every=3, resume=True, target_accuracy=0.8))
