"""The strategies study: its quick mode runs one bench process per strategy and checks real
properties of what they measured; the figure redraws from the JSON alone; the meshes of the
full mode use every device; bad options exit 2 with the fix."""

import json

import jax
import pytest

from conftest import requires_devices
from experiments.studies.strategies import study
from experiments.studies.strategies import tables as strategies_tables
from experiments.__main__ import EXIT_USAGE, run


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategies")
    assert run(["strategies", "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "strategies.json").read_text())


def test_quick_study_measures_what_each_strategy_buys(quick):
    out, data = quick
    rows = {r["strategy"]: r for r in data["metrics"]["rows"]}
    assert set(rows) == set(study.QUICK.strategies)
    assert data["config"]["devices"] == 4 and data["env"]["device_count"] == 4
    single, dp, fsdp = rows["single"], rows["dp-auto"], rows["fsdp"]
    assert single["collective_bytes_per_step"] == 0 and single["mesh"] == {"data": 1}
    assert dp["mesh"] == fsdp["mesh"] == {"data": 4}
    # fsdp keeps 1/N of the state per device (a few padding bytes aside); dp-auto all of it
    assert fsdp["state_bytes_per_device"] <= dp["state_bytes_per_device"] / 4 + 1024
    assert dp["state_bytes_per_device"] == single["state_bytes_per_device"]
    # explicit collectives equal theory; the compiler's all-reduce moves at least the gradient
    assert fsdp["collective_bytes_per_step"] == fsdp["collective_bytes_theory"] > 0
    assert dp["collective_bytes_theory"] <= dp["collective_bytes_per_step"] <= 2 * dp["collective_bytes_theory"]
    table = (out / "summary.md").read_text()
    assert "| fsdp | data=4 |" in table and f"{data['env']['cpu_cores']} CPU cores" in table


def test_quick_study_resumes_without_rerunning_points(quick, capsys):
    out, _ = quick
    files = sorted((out / "points").rglob("result.json"))
    before = {f: f.stat().st_mtime_ns for f in files}
    assert run(["strategies", "--quick", "--out", str(out)]) == 0
    assert {f: f.stat().st_mtime_ns for f in files} == before


def test_points_of_other_settings_are_refused_before_any_work(quick, capsys):
    out, _ = quick
    files = sorted((out / "points").rglob("result.json"))
    before = {f: f.stat().st_mtime_ns for f in files}
    assert run(["strategies", "--quick", "--batch-size", "64", "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "other settings" in err and "data.batch_size 128 (asked 64)" in err and "fresh --out" in err
    assert {f: f.stat().st_mtime_ns for f in files} == before


def test_figure_redraws_from_the_json_alone(quick, tmp_path):
    out, _ = quick
    data = tmp_path / "data" / "strategies"
    data.mkdir(parents=True)
    (data / "strategies.json").write_text((out / "strategies.json").read_text())
    assert run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "strategies.png").stat().st_size > 10_000


@requires_devices(4)
def test_every_single_process_strategy_gets_a_mesh_of_all_devices():
    from jaxpar.config import TrainConfig, with_options
    from jaxpar.parallel import STRATEGIES

    devices = jax.devices()[:4]
    for name, cls in STRATEGIES.items():
        if cls.uses_mpi:
            continue
        cfg = with_options(TrainConfig(), strategy=name, model="stack-mlp",
                           mesh=study.mesh_for(name, 4))
        mesh = cls(cfg).make_mesh(devices)
        assert mesh.devices.size == (1 if name == "single" else 4), (name, mesh.shape)


def test_bad_options_exit_2_naming_the_fix(tmp_path, capsys):
    assert run(["strategies", "--strategies", "single,nosuch", "--out", str(tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "nosuch" in err and "dp-auto" in err and "layer-split" in err
    assert run(["strategies", "--width", "30", "--out", str(tmp_path)]) == EXIT_USAGE
    assert "--width 30" in capsys.readouterr().err  # tensor=4 cannot split 30
    assert not (tmp_path / "points").exists()  # checked before any work


def test_mpi_strategies_are_skipped_with_the_reason_when_mpi_is_missing(monkeypatch):
    from experiments.__main__ import COMMANDS
    from experiments.cli import build_parser, options_from_args

    monkeypatch.setattr(study, "_mpi_missing", lambda: "mpi4jax is not installed")
    args = build_parser(COMMANDS).parse_args(["strategies", "--strategies", "single,mpi-allreduce"])
    config = options_from_args(args, study.StrategiesConfig())
    names, skipped = study.chosen_strategies(config)
    assert names == ["single"] and skipped == {"mpi-allreduce": "mpi4jax is not installed"}
    assert config.strategies == ("single", "mpi-allreduce")
    assert study.strategy_point("single", config).bench.matmul_peak is False  # --no-matmul-peak
    mpi = study.strategy_point("mpi-allreduce", config)  # --devices ranks of one device each
    assert (mpi.ranks, mpi.config.parallel.devices, mpi.config.parallel.single_thread) == (4, 1, True)


def test_the_cnn_gets_model_parallel_rows_and_hybrid_is_skipped_with_why(tmp_path):
    """The seeds' comparison: --model cnn runs every strategy that places it (hybrid, which
    needs identical blocks, is skipped with the reason); its model-parallel rows move what
    their theory says and gems holds two stages per device."""
    import dataclasses

    names, skipped = study.chosen_strategies(dataclasses.replace(study.StrategiesConfig(), model="cnn"))
    assert {"layer-split", "pipeline", "gems", "tensor", "tensor-auto"} <= set(names)
    assert "hybrid" not in names and "--model cnn" in skipped["hybrid"]
    config = dataclasses.replace(study.QUICK, model="cnn", devices=2, batch_size=16, microbatches=4,
                                 strategies=("pipeline", "gems", "tensor"), out=str(tmp_path))
    assert study.run(config)
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "strategies.json").read_text())["metrics"]["rows"]}
    for name in config.strategies:  # explicit collectives: theory exactly
        assert rows[name]["collective_bytes_per_step"] == rows[name]["collective_bytes_theory"], name
    assert rows["tensor"]["collective_bytes_per_step"] > 0
    # on CPU the stages are programs of their own: activations move by device_put, not collectives
    assert rows["pipeline"]["collective_bytes_per_step"] == rows["gems"]["collective_bytes_per_step"] == 0
    assert rows["pipeline"]["mesh"] == {"stage": 2} and rows["pipeline"]["bubble_fraction"] > 0
    # gems: each of the 2 devices holds both stages (one per replica), a pipeline device one
    pipe, gems = rows["pipeline"]["state_bytes_per_device"], rows["gems"]["state_bytes_per_device"]
    assert pipe < gems < 2 * pipe


def test_rounds_measure_every_strategy_each_round_and_report_its_median_round(tmp_path):
    """--rounds R: every strategy once per round in points/<strategy>/r<k>/, a row the median
    round's (for two rounds the faster), every round's step beside it."""
    import dataclasses

    config = dataclasses.replace(study.QUICK, strategies=("single", "dp-auto"), rounds=2,
                                 out=str(tmp_path))
    assert study.run(config)
    for name in config.strategies:
        assert sorted(p.parent.name for p in (tmp_path / "points" / name).glob("*/result.json")) == ["r0", "r1"]
    data = json.loads((tmp_path / "strategies.json").read_text())
    for r in data["metrics"]["rows"]:
        assert len(r["ms_per_step_rounds"]) == 2 and r["ms_per_step"] == min(r["ms_per_step_rounds"])
    assert "median of 2 rounds" in (tmp_path / "summary.md").read_text()


def test_fewer_rounds_than_the_folder_holds_are_refused_before_any_work(tmp_path, capsys):
    """Reporting r0 while r1 lies beside it (which the cost check reads) would disagree: exit 2
    naming the rounds to ask for, nothing run or written."""
    import dataclasses

    config = dataclasses.replace(study.QUICK, strategies=("single",), rounds=2, out=str(tmp_path))
    assert study.run(config)
    before = {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*.json")}
    assert run(["strategies", "--quick", "--strategies", "single", "--rounds", "1",
                "--out", str(tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "holds round r1, beyond --rounds 1" in err and "--rounds 2" in err and "fresh --out" in err
    assert {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*.json")} == before


def test_rounds_are_grouped_by_point_and_the_median_round_picked():
    from types import SimpleNamespace

    from experiments.points import points

    planned = [study.strategy_point(s, study.QUICK) for s in ("single", "dp-auto", "fsdp")]
    rounds = points.in_rounds(planned, 3)  # rotated: round 1 starts at dp-auto
    steps = {"single": [5.0, 9.0, 4.0], "dp-auto": [7.0, 6.0, 8.0], "fsdp": [1.0, 3.0, 2.0]}
    outcomes = [SimpleNamespace(metrics={"step_time_ms_median": steps[p.folder.split("/")[1]][int(p.folder[-1])]})
                for p in rounds]
    grouped = points.by_point(rounds, outcomes)
    assert list(grouped) == [p.folder for p in planned]
    for p in planned:
        name = p.folder.split("/")[1]
        assert [r.metrics["step_time_ms_median"] for r in grouped[p.folder]] == steps[name]
    assert [points.median_round(grouped[p.folder]).metrics["step_time_ms_median"] for p in planned] == [5.0, 7.0, 2.0]
    assert points.median_round(grouped[planned[0].folder][:2]).metrics["step_time_ms_median"] == 5.0
    with pytest.raises(ValueError):  # a round missing
        points.by_point(rounds, outcomes[:-1])


@pytest.mark.skipif(study._mpi_missing() is not None, reason="MPI strategies need mpi4jax and mpiexec")
def test_mpi_rows_get_single_on_one_thread_beside_them(tmp_path):
    """With an MPI strategy the study measures `single` on one thread, as each rank runs, and
    reports it under the table (not as a row: it is the ranks' reference)."""
    import dataclasses

    config = dataclasses.replace(study.QUICK, strategies=("single", "mpi-allreduce"), devices=2,
                                 batch_size=32, out=str(tmp_path))
    assert study.run(config)
    data = json.loads((tmp_path / "strategies.json").read_text())
    assert [r["strategy"] for r in data["metrics"]["rows"]] == ["single", "mpi-allreduce"]
    reference = data["metrics"]["one_thread"]
    measured = json.loads((tmp_path / reference["point"] / "r0" / "result.json").read_text())
    assert measured["config"]["parallel"]["single_thread"] and measured["env"]["threads_per_process"] == 1
    assert reference["ms_per_step"] > 0 and reference["strategy"] == "single"
    assert strategies_tables.one_thread_note(reference) in (tmp_path / "summary.md").read_text()
    alone = dataclasses.replace(config, strategies=("single",), out=str(tmp_path / "alone"))
    assert study.run(alone)  # no MPI row, no reference
    assert json.loads((tmp_path / "alone" / "strategies.json").read_text())["metrics"]["one_thread"] is None
