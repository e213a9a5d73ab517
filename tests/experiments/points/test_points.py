"""Study points: each runs in its own process from its config (no command line parsed back),
records its settings in its result, and `points.run_points` resumes a stopped study the same way for
every study: a complete point of the same settings is reused, a damaged one is run again, one
of other settings (or of no recorded settings) is refused, naming the folder, before any work.

    python -m pytest -q tests/experiments/points/test_points.py
"""

import dataclasses
import json

import pytest

from experiments.points import points
from experiments.options import BenchOptions
from experiments.points.points import Point
from jaxpar.results import portable
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError

TINY = with_options(TrainConfig(), dataset="synthetic", synthetic_size=300, val_size=50,
                    model="mlp", width=16, depth=1, batch_size=25, steps=2, progress=False)
BENCH = Point("bench/mlp", with_options(TINY, devices=2, strategy="dp-auto"),
              BenchOptions(iters=2, warmup=1, matmul_peak=False), labels={"mode": "weak"})
TRAIN = Point("train/mlp", TINY)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("points")
    outcomes = points.run_points([BENCH, TRAIN], out, timeout=300)
    return out, outcomes


def _mtimes(out):
    return {p: p.stat().st_mtime_ns for p in sorted(out.rglob("*.json"))}


def test_points_run_from_their_config_and_record_their_settings(study):
    out, (bench, train) = study
    assert bench.kind == "bench" and train.kind == "train"
    assert bench.env["device_count"] == 2 and bench.metrics["iters"] == 2
    assert bench.config["point"] == {"kind": "bench", "ranks": None, "labels": {"mode": "weak"},
                                     "bench": {"iters": 2, "warmup": 1, "matmul_peak": False, "timeline": False,
                                               "wire": None}}
    assert train.config["point"]["bench"] is None and train.metrics["steps"] == 2
    assert results.load(out / "bench/mlp").config["model"]["width"] == 16
    # what the process ran is the point file the study wrote, config and all
    ran = Point.from_json((out / "train/mlp" / points.POINT_FILE).read_text())
    assert ran.config == dataclasses.replace(TINY, out=str(out / "train/mlp"))


def test_a_point_file_names_no_folder_of_the_machine(study):
    out, _ = study
    text = (out / "train/mlp" / points.POINT_FILE).read_text()
    assert str(out) not in text
    assert json.loads(text)["config"]["out"] == portable.path(out / "train/mlp")


def test_a_point_naming_a_folder_outside_the_roots_is_refused_before_any_work(tmp_path):
    outside = dataclasses.replace(TRAIN, config=with_options(TINY, events="/jaxpar-nowhere/events"))
    with pytest.raises(ConfigError, match="--events /jaxpar-nowhere/events lies outside"):
        points.run_points([outside], tmp_path, timeout=60)
    assert not any(tmp_path.iterdir())


def test_complete_points_are_reused(study, capsys):
    out, first = study
    before = _mtimes(out)
    again = points.run_points([BENCH, TRAIN], out, timeout=300)
    assert "2 of 2 points already done" in capsys.readouterr().out
    assert _mtimes(out) == before
    assert [r.metrics for r in again] == [r.metrics for r in first]


@pytest.mark.parametrize("other,needle", [
    (dataclasses.replace(BENCH, bench=BenchOptions(iters=3, warmup=1, matmul_peak=False)),
     "point.bench.iters 2 (asked 3)"),
    (dataclasses.replace(BENCH, labels={"mode": "strong"}), "point.labels.mode weak (asked strong)"),
    (dataclasses.replace(BENCH, ranks=2), "point.ranks None (asked 2)"),
    (dataclasses.replace(TRAIN, config=with_options(TINY, lr=0.1)), "optim.lr 0.003 (asked 0.1)"),
    (dataclasses.replace(TRAIN, folder="bench/mlp"), "point.kind bench (asked train)"),
])
def test_a_point_of_other_settings_is_refused_before_any_work(study, other, needle):
    out, _ = study
    before = _mtimes(out)
    fresh = Point("fresh/mlp", TINY)  # listed first: it must not run either
    with pytest.raises(ConfigError, match="other settings") as e:
        points.run_points([fresh, other], out, timeout=300)
    assert needle in str(e.value) and str(out / other.folder) in str(e.value)
    assert "fresh --out" in str(e.value)
    assert _mtimes(out) == before and not (out / "fresh").exists()


def test_a_result_without_recorded_settings_is_refused(study, tmp_path):
    out, (_, train) = study
    old = dataclasses.replace(train, config={k: v for k, v in train.config.items() if k != "point"})
    results.save(old, tmp_path / "train/mlp")
    with pytest.raises(ConfigError, match="does not record its study settings"):
        points.run_points([TRAIN], tmp_path, timeout=300)


def test_a_damaged_point_is_run_again(study, tmp_path):
    out, _ = study
    folder = tmp_path / "train/mlp"
    folder.mkdir(parents=True)
    (folder / results.RESULT_FILE).write_text('{"kind": "tr')  # a run killed mid-write
    (result,) = points.run_points([TRAIN], tmp_path, timeout=300)
    assert result.metrics["steps"] == 2
    assert json.loads((folder / results.RESULT_FILE).read_text())["config"]["point"]["kind"] == "train"


def test_a_failed_point_is_returned_or_raised(tmp_path):
    broken = Point("broken", with_options(TINY, batch_size=10_000))  # larger than the split
    with pytest.raises(points.PointError, match="batch-size"):
        points.run_points([broken], tmp_path, timeout=300)
    (outcome,) = points.run_points([broken], tmp_path, timeout=300, keep_going=True)
    assert isinstance(outcome, points.PointError)
