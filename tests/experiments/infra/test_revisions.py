"""Two checkouts alternated (`experiments/infra/revisions.py`): options checked before any work,
each round's stored result reused, the table's medians, their ratio and the rounds' median ratio.

    python -m pytest -q tests/experiments/infra/test_revisions.py
"""

import pytest

from experiments.infra import revisions
from jaxpar import results


def test_an_unknown_config_or_no_rounds_is_refused_before_any_work(tmp_path, capsys):
    for bad in (["--configs", "single,nope"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            revisions.main(["--old", ".", "--new", ".", "--out", str(tmp_path / "ab"), *bad])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--configs nope: choose from single, dp-shard-map" in err and "--rounds must be >= 1" in err
    assert not (tmp_path / "ab").exists()


def test_stored_rounds_are_read_back_and_tabled(tmp_path):
    for side, ms in (("old", [10.0, 12.0, 11.0]), ("new", [10.5, 11.0, 12.5])):
        for k, x in enumerate(ms):
            folder = tmp_path / side / "single" / f"r{k}"
            results.save(results.RunResult(kind="bench", config={}, env={}, metrics={"step_time_ms_median": x}), folder)
    got = revisions.alternate({"old": tmp_path / "nowhere", "new": tmp_path / "nowhere"}, ["single"], 3, tmp_path, 1)
    assert got == {"single": {"old": [10.0, 12.0, 11.0], "new": [10.5, 11.0, 12.5]}}
    assert "| single | 10.00, 12.00, 11.00 | 10.50, 11.00, 12.50 | 11.00 | 11.00 | 1.000 | 1.050 |" in revisions.ab_table(got)  # rounds: 1.05, 0.92, 1.14
