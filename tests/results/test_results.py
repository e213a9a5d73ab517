"""Results JSON: round trip, atomic writes, unwritable folders."""

import json

import pytest

from jaxpar import results
from jaxpar.results import ResultsError, RunResult


def sample():
    return RunResult(kind="train", config={"seed": 0}, env={"backend": "cpu"},
                     metrics={"test_accuracy": 0.9})


def test_round_trip(tmp_path):
    path = results.save(sample(), tmp_path / "run")
    assert path.name == "result.json"
    back = results.load(tmp_path / "run")
    assert back == sample() and json.loads(path.read_text())["schema_version"] == results.SCHEMA_VERSION


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    results.save(sample(), tmp_path)
    results.save(sample(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_results_get_the_umask_mode_not_mkstemps_owner_only(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        path = results.save(sample(), tmp_path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_failed_write_keeps_the_old_file(tmp_path):
    results.save(sample(), tmp_path)
    bad = sample()
    bad.metrics["x"] = object()  # not serialisable: fails before anything is replaced
    with pytest.raises(TypeError):
        results.save(bad, tmp_path)
    assert results.load(tmp_path) == sample()


def test_unwritable_out_names_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ResultsError, match="--out"):
        results.ensure_writable(blocker / "sub")


def test_other_schema_version_is_refused(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"schema_version": 0}))
    with pytest.raises(ResultsError, match="schema_version"):
        results.load(tmp_path)


def test_environment_records_the_machine():
    env = results.environment()
    for key in ("jax", "flax", "backend", "device_kind", "device_count", "process_count",
                "cpu_cores", "threads", "git_revision"):
        assert key in env
