"""Live training for the demo without a browser: `train --events` writes the stream, one
`train` process per strategy reports through it, stop saves a checkpoint and resume continues
from it, a failing run's one-paragraph error is what the page shows.

    python -m pytest -q tests/experiments/demo/test_demo_live.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from experiments.demo import classify, live
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ResultsError
from jaxpar.parallel import STRATEGIES
from jaxpar.train import fit

SMALL = ("--synthetic-size", "1200", "--width", "32", "--depth", "1")


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_events_stream(tmp_path):
    events = tmp_path / "events.jsonl"
    config = with_options(TrainConfig(), dataset="synthetic", synthetic_size=800, val_size=100,
                          batch_size=32, model="mlp", width=32, depth=1, steps=30, eval_every=10,
                          progress=False, events=str(events), out=str(tmp_path / "out"))
    outcome = fit(config)
    records = read_events(events)
    kinds = [r["event"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds.count("step") == 30 and kinds.count("validation") == 3
    start = records[0]
    metrics = outcome.result.metrics
    for key in ("compile_s", "collective_bytes_per_step", "state_bytes_per_device", "memory_per_device"):
        assert start[key] == metrics[key], key
    assert start["total_steps"] == 30 and start["step"] == 0
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert steps[-1]["loss"] == pytest.approx(metrics["final_loss"])
    vals = [r for r in records if r["event"] == "validation"]
    assert [v["val_accuracy"] for v in vals] == [h["val_accuracy"] for h in outcome.result.history]
    assert records[-1]["result"] == str(tmp_path / "out" / "result.json")
    assert records[-1]["metrics"]["test_accuracy"] == metrics["test_accuracy"]
    times = [r["time"] for r in records]
    assert times == sorted(times)


def test_events_in_a_missing_folder_is_a_user_error(tmp_path):
    config = with_options(TrainConfig(), dataset="synthetic", synthetic_size=800, val_size=0,
                          batch_size=32, model="mlp", width=32, depth=1, steps=2, progress=False,
                          events=str(tmp_path / "missing" / "events.jsonl"))
    with pytest.raises(ResultsError, match="--events"):
        fit(config)


def test_strategies_for_reads_the_strategies():
    for model in ("mlp", "stack-mlp"):
        names = live.strategies_for(model)
        assert "single" in names
        for name, cls in STRATEGIES.items():
            takes = cls.models is None or model in cls.models
            assert (name in names) == (takes and not cls.uses_mpi), name


def wait(runs: live.LiveRuns, done, timeout: float = 240) -> list[live.Status]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = runs.poll()
        if done(statuses):
            return statuses
        time.sleep(0.2)
    runs.kill()
    pytest.fail(f"runs did not get there in {timeout} s: " +
                "; ".join(f"{s.strategy} {s.state} {s.error}" for s in runs.poll()))


def test_runs_side_by_side_and_a_failing_one(tmp_path):
    runs = live.LiveRuns(tmp_path)
    spec = live.RunSpec(model="mlp", dataset="synthetic", strategies=("single", "dp-shard-map", "tensor"),
                        devices=2, steps=40, batch_size=32, eval_every=20, val_size=200, extra=SMALL)
    group = runs.start(spec)
    statuses = wait(runs, lambda ss: not any(s.state in ("starting", "preparing", "training") for s in ss))
    by = {s.strategy: s for s in statuses}
    assert by["single"].state == by["dp-shard-map"].state == "finished"
    # The CLI's one paragraph, as the page shows it: no "error:" prefix, no traceback.
    assert by["tensor"].state == "failed"
    assert by["tensor"].error.startswith("--strategy tensor cannot place --model mlp")
    assert "Traceback" not in by["tensor"].error
    for name in ("single", "dp-shard-map"):
        s = by[name]
        assert [r["step"] for r in s.steps] == list(range(1, 41))
        assert [v["step"] for v in s.validations] == [20, 40]
        row = live.summary_row(s)
        assert row["step"] == "40/40" and row["images/s"] > 0 and row["test accuracy"] is not None
        assert classify.load_classifier(group / name, "synthetic").step == 40  # ready for the classify panel
    assert live.summary_row(by["dp-shard-map"])["collective B/step"] > 0
    assert live.summary_row(by["single"])["collective B/step"] == 0
    curves = live.curves(statuses, runs.started)
    assert {r["strategy"] for r in curves["loss"]} == {"single", "dp-shard-map"}
    assert len(curves["accuracy"]) == 4 and all(r["seconds"] > 0 for r in curves["loss"])


def test_stop_saves_a_checkpoint_and_resume_continues(tmp_path):
    runs = live.LiveRuns(tmp_path)
    spec = live.RunSpec(model="mlp", dataset="synthetic", strategies=("single",), devices=1,
                        steps=4000, batch_size=16, eval_every=1000, val_size=200, extra=SMALL)
    runs.start(spec)
    wait(runs, lambda ss: len(ss[0].steps) >= 20)
    runs.stop(wait=True)
    status = runs.poll()[0]
    assert status.state == "stopped"
    stopped_at = status.steps[-1]["step"]
    assert stopped_at < 4000
    assert runs.resume() == 1
    status = wait(runs, lambda ss: ss[0].state in ("finished", "failed"))[0]
    assert status.state == "finished", status.error
    starts = [r for r in read_events(status.folder / live.EVENTS) if r["event"] == "start"]
    assert len(starts) == 2 and 0 < starts[1]["step"] <= stopped_at + 1
    steps = [r["step"] for r in status.steps]
    assert steps[-1] == 4000 and sorted(set(steps)) == list(range(1, 4001))
    assert runs.resume() == 0  # nothing stopped any more


def test_failure_message_of_a_crash(tmp_path):
    err = tmp_path / "stderr.txt"
    err.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    assert live.failure_message(err, 1).startswith("exited with status 1:")
    assert "RuntimeError: boom" in live.failure_message(err, 1)
    err.write_text("some warning\nerror: --batch-size must be >= 1, got 0\n")
    assert live.failure_message(err, 2) == "--batch-size must be >= 1, got 0"
