"""Scaling rows and figures from results files alone: speed-up over the right baseline (same
mode and model config), the best single-process point, and both figures drawn.

    python -m pytest -q tests/experiments/studies/test_speedup.py
"""

import pytest

from experiments.studies.scaling import figures as scaling_figures
from experiments.studies.scaling import speedup
from jaxpar import results
from jaxpar.config import TrainConfig, to_dict, with_options


def _point(root, mode, strategy, images_per_sec, devices=1, ranks=None, width=None, round_=None):
    """A bench result as the scaling study lays it out (only the fields the rows read); in
    round `round_`'s folder when given."""
    root = root / f"width{width}" if width else root
    folder = root / (f"{mode}/mlp-{strategy}-{devices}" if ranks is None
                     else f"ranks/{mode}/mlp-{strategy}-r{ranks}")
    folder = folder if round_ is None else folder / f"r{round_}"
    config = with_options(TrainConfig(), model="mlp", width=width, strategy=strategy,
                          single_thread=ranks is not None, out=str(folder))
    env = {"device_count": 1 if ranks else devices, "mpi_ranks": ranks or 1, "cpu_cores": 2,
           "cores_available": 1 if ranks else 2, "threads_per_process": 1 if ranks else 2,
           "threads": "test", "jax": "test"}
    metrics = {"step_time_ms_median": 128e3 / images_per_sec, "images_per_sec": images_per_sec,
               "collective_bytes_per_step": 0, "state_bytes_per_device": 0}
    recorded = {**to_dict(config), "point": {"kind": "bench", "labels": {"mode": mode}}}
    results.save(results.RunResult("bench", recorded, env, metrics, {"strategy": strategy}), folder)


@pytest.fixture
def study(tmp_path):
    _point(tmp_path, "strong", "single", 1000)
    _point(tmp_path, "strong", "dp-auto", 1500, devices=2)
    _point(tmp_path, "strong", "dp-auto", 1200, devices=4)
    _point(tmp_path, "strong", "single", 700, ranks=1)
    _point(tmp_path, "strong", "mpi-allreduce", 1050, ranks=2)
    _point(tmp_path, "weak", "single", 900)  # another mode: its own baseline
    _point(tmp_path, "strong", "single", 10, width=8)  # another model config: not a baseline
    return tmp_path


def test_speedups_use_the_baseline_of_their_mode_and_model_config(study):
    points = speedup.load_points(study)
    rows = speedup.device_rows(points)
    assert len(rows) == 5
    by = {(r["mode"], r["strategy"], r["devices"]): r for r in rows
          if '"width": null' in r["group"][1]}
    assert by[("strong", "dp-auto", 4)]["speedup"] == pytest.approx(1.2)
    assert by[("strong", "dp-auto", 4)]["efficiency"] == pytest.approx(0.3)
    assert by[("weak", "single", 1)]["speedup"] == pytest.approx(1.0)
    (two,) = [r for r in speedup.rank_rows(points) if r["ranks"] == 2]
    assert two["speedup"] == pytest.approx(1.5) and two["efficiency"] == pytest.approx(0.75)
    assert (two["best"]["strategy"], two["best"]["devices"]) == ("dp-auto", 2)
    assert two["speedup_vs_best"] == pytest.approx(0.7)


def test_both_scaling_figures_are_drawn_from_the_results(study, tmp_path):
    out = tmp_path / "figures"
    out.mkdir()
    loaded = {"points": speedup.load_points(study)}
    paths = [scaling_figures.devices_figure(loaded, out), scaling_figures.ranks_figure(loaded, out)]
    assert [p.name for p in paths] == ["scaling_devices.png", "scaling_ranks.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_the_mode_comes_from_the_result_not_its_folder(tmp_path):
    _point(tmp_path, "weak", "single", 900)
    (tmp_path / "weak").rename(tmp_path / "moved")
    (point,) = speedup.load_points(tmp_path)
    assert point["mode"] == "weak"
    unlabelled = results.RunResult("bench", to_dict(TrainConfig()), {}, {})
    results.save(unlabelled, tmp_path / "strong" / "mlp-single-1")
    with pytest.raises(results.ResultsError, match="does not record its scaling mode"):
        speedup.load_points(tmp_path)


def test_a_point_measured_in_rounds_is_its_median_round(tmp_path):
    """Three rounds of `single` (one slow), two of dp-auto: one record each, the median round
    (of two, the faster), every round's ms/step beside it; speed-ups are the medians'."""
    for k, ips in enumerate((1000, 400, 1100)):
        _point(tmp_path, "strong", "single", ips, round_=k)
    for k, ips in enumerate((1500, 1300)):
        _point(tmp_path, "strong", "dp-auto", ips, devices=2, round_=k)
    found = {p["strategy"]: p for p in speedup.load_points(tmp_path)}
    assert len(found) == 2
    assert found["single"]["images_per_sec"] == 1000
    assert found["single"]["rounds_ms"] == sorted(128e3 / x for x in (1000, 400, 1100))
    assert found["dp-auto"]["images_per_sec"] == 1500
    (two,) = [r for r in speedup.device_rows(list(found.values())) if r["devices"] == 2]
    assert two["speedup"] == pytest.approx(1.5)


def test_the_same_configuration_in_both_modes_pools_its_rounds(tmp_path):
    """The weak mode's `single` on one device runs the strong mode's configuration: each mode
    keeps its row, both the median of all six rounds (of an even count, the faster middle)."""
    for k, (strong, weak) in enumerate(((1000, 700), (1100, 650), (900, 720))):
        _point(tmp_path, "strong", "single", strong, round_=k)
        _point(tmp_path, "weak", "single", weak, round_=k)
    found = {p["mode"]: p for p in speedup.load_points(tmp_path)}
    assert set(found) == {"strong", "weak"} and found["weak"]["group"][0] == "weak"
    assert found["strong"]["images_per_sec"] == found["weak"]["images_per_sec"] == 900
    assert len(found["weak"]["rounds_ms"]) == 6 and found["weak"]["rounds"] == 3
