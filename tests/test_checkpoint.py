"""Checkpoints: a run killed with SIGKILL and resumed ends bitwise where the uninterrupted run
ends; checkpoints move between strategies and meshes; damaged ones are skipped; bad
--resume input is refused before anything is written."""

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import equivalence as eq
from conftest import ROOT, run_cli
from jaxpar.checkpoint import Checkpoints

TINY = ["--dataset", "synthetic", "--synthetic-size", "2000", "--val-size", "200", "--model", "mlp",
        "--width", "32", "--depth", "1", "--batch-size", "32", "--optimizer", "momentum",
        "--lr", "0.05", "--no-progress"]


def final_leaves(directory):
    manager = Checkpoints(directory, read_only=True)
    return manager.steps()[-1], manager.read_leaves(manager.steps()[-1])


def kill_when_checkpoint_exists(args, directory: Path, at_least: int, timeout=120):
    """Start a slowed-down run, SIGKILL it once a checkpoint of step >= at_least is complete."""
    env = {**os.environ, "JAXPAR_TEST_STEP_DELAY_S": "0.05", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "experiments", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            done = [int(p.name) for p in directory.glob("*") if p.name.isdigit()]
            if done and max(done) >= at_least:
                proc.kill()
                proc.wait(10)
                return max(done)
            if proc.poll() is not None:
                pytest.fail(f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
        pytest.fail("no checkpoint appeared in time")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("strategy,devices", [("single", 1), ("dp-shard-map", 8), ("fsdp", 4)])
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, strategy, devices):
    args = [*TINY, "--strategy", strategy, "--devices", str(devices), "--steps", "60",
            "--checkpoint-every", "10"]
    whole = run_cli("train", *args, "--checkpoint-dir", str(tmp_path / "whole"), "--out", str(tmp_path / "r1"))
    assert whole.returncode == 0, whole.stderr
    killed_at = kill_when_checkpoint_exists([*args, "--checkpoint-dir", str(tmp_path / "cut"),
                                             "--out", str(tmp_path / "r2")], tmp_path / "cut", 20)
    assert killed_at < 60
    resumed = run_cli("train", *args, "--checkpoint-dir", str(tmp_path / "cut"), "--resume",
                      "--out", str(tmp_path / "r2"))
    assert resumed.returncode == 0, resumed.stderr
    (s1, a), (s2, b) = final_leaves(tmp_path / "whole"), final_leaves(tmp_path / "cut")
    assert s1 == s2 == 60
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_checkpoint_from_8_devices_resumes_on_2_under_another_strategy(tmp_path):
    sgd = [*TINY, "--optimizer", "sgd", "--lr-schedule", "constant", "--checkpoint-every", "10"]
    first = run_cli("train", *sgd, "--strategy", "dp-shard-map", "--devices", "8", "--steps", "10",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    moved = run_cli("train", *sgd, "--strategy", "fsdp", "--devices", "2", "--steps", "20",
                    "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--out", str(tmp_path / "a"))
    assert moved.returncode == 0, moved.stderr
    ref = run_cli("train", *sgd, "--strategy", "single", "--steps", "20",
                  "--checkpoint-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "b"))
    assert ref.returncode == 0, ref.stderr
    (_, got), (_, want) = final_leaves(tmp_path / "ck"), final_leaves(tmp_path / "ref")
    eq.assert_tree_close(want, got)


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path):
    env = {**os.environ, "JAXPAR_TEST_STEP_DELAY_S": "0.05"}
    proc = subprocess.Popen([sys.executable, "-m", "experiments", "train", *TINY, "--steps", "400",
                             "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "r")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "r").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(8)  # past compilation, into the steps
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "--resume" in err and "Traceback" not in err
    steps = Checkpoints(tmp_path / "ck", read_only=True).steps()
    assert steps and 0 < steps[-1] < 400


def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path):
    t = eq.run(eq.config(), steps=1)
    ref = t.strategy.state_to_reference(t.state)
    manager = Checkpoints(tmp_path)
    for step in (5, 10):
        manager.save(step, ref, {"config": {}, "history": []})
    manager.wait()
    biggest = max((p for p in (tmp_path / "10").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, meta = Checkpoints(tmp_path).restore_latest(ref)
    assert any(str(tmp_path / "10") in str(w.message) for w in caught)
    assert meta["history"] == []
    restored, _ = Checkpoints(tmp_path).restore(5, ref)
    eq.assert_tree_close(ref.params, restored.params, tol=0)


@pytest.mark.parametrize("setup,needle", [("empty", "holds no jaxpar checkpoint"),
                                          ("foreign", "holds no jaxpar checkpoint"),
                                          ("other-width", "model options"),
                                          ("no-dir", "--checkpoint-dir")])
def test_bad_resume_is_refused_and_nothing_is_written(tmp_path, setup, needle):
    ck = tmp_path / "ck"
    ck.mkdir()
    if setup == "foreign":
        (ck / "notes.txt").write_text("not a checkpoint")
    if setup == "other-width":
        saved = run_cli("train", *TINY, "--steps", "5", "--checkpoint-dir", str(ck), "--out", str(tmp_path / "a"))
        assert saved.returncode == 0, saved.stderr
    before = sorted(str(p) for p in ck.rglob("*"))
    args = ["train", *TINY, "--steps", "5", "--resume", "--out", str(tmp_path / "b")]
    if setup != "no-dir":
        args += ["--checkpoint-dir", str(ck)]
    if setup == "other-width":
        args += ["--width", "48"]
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(str(p) for p in ck.rglob("*")) == before
    assert not (tmp_path / "b" / "result.json").exists()
