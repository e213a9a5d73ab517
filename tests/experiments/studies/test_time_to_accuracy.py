"""The time-to-accuracy study in its quick mode: real properties, not files.

    python -m pytest -q tests/experiments/studies/test_time_to_accuracy.py
"""

import dataclasses
import json

import pytest

RESNET_TARGET = 0.91

from experiments.publish import tables
from experiments.__main__ import run


def _rows(folder):
    data = json.loads((folder / "time_to_accuracy.json").read_text())
    return {r["strategy"]: r for r in data["metrics"]["rows"]}, data


def test_data_parallel_reaches_the_target_at_singles_step_reproducibly(tmp_path, capsys):
    study = tmp_path / "data" / "time_to_accuracy"
    assert run(["time-to-accuracy", "--quick", "--out", str(study)]) == 0
    rows, data = _rows(study)
    single, dp, mpi = rows["single"], rows["dp-shard-map"], rows["mpi-allreduce"]
    assert single["reached"] and dp["reached"] and mpi["reached"], (single, dp, mpi)
    assert (single["devices"], dp["devices"], mpi["devices"]) == (1, 2, 2)
    assert (dp["ranks"], mpi["ranks"]) == (1, 2)  # the MPI row: 2 processes of one device
    # Same global batch and seed: the same trajectory, so the same step, on 1 device, 2
    # devices in one process or 2 MPI ranks.
    val_size = data["config"]["val_size"]
    for other in (dp, mpi):
        assert other["steps"] == single["steps"] and other["examples"] == single["examples"]
        for a, b in zip(single["curve"], other["curve"], strict=True):
            assert a["step"] == b["step"] and abs(a["val_accuracy"] - b["val_accuracy"]) <= 2 / val_size
    # The reported step is the first validation at or above the target, a multiple of eval-every.
    accs = [c["val_accuracy"] for c in single["curve"]]
    assert accs[-1] >= single["target"] > max(accs[:-1])
    assert single["steps"] % data["config"]["eval_every"] == 0
    assert data["env"]["cpu_cores"] >= 1 and data["config"]["train_options"]["lr_schedule"] == "constant"
    summary = (study / "summary.md").read_text()
    assert "| mlp | dp-shard-map | 2 |" in summary and "| mlp | mpi-allreduce | 2 ranks |" in summary

    # A re-run with the same seed (a fresh folder, one strategy) gives the same step exactly.
    again = tmp_path / "again"
    assert run(["time-to-accuracy", "--quick", "--strategies", "dp-shard-map", "--out", str(again)]) == 0
    rerun = _rows(again)[0]["dp-shard-map"]
    assert rerun["steps"] == dp["steps"]
    assert [(c["step"], c["val_accuracy"]) for c in rerun["curve"]] == \
        [(c["step"], c["val_accuracy"]) for c in dp["curve"]]

    # The same folder again: complete points are not run again.
    capsys.readouterr()
    assert run(["time-to-accuracy", "--quick", "--out", str(study)]) == 0
    assert "3 of 3 points already done" in capsys.readouterr().out
    assert _rows(study)[0]["single"]["time_s"] == single["time_s"]

    # The docs' table: per strategy its time to target (steps) and its state per device beside
    # it; a row written before the state was recorded shows it blank.
    row = f"| mpi-allreduce | 2 ranks | {mpi['time_s']:.1f} s ({mpi['steps']}) | {mpi['state_bytes_per_device'] / 1e6:.2f} |"
    assert row in tables.TABLES["time-to-accuracy"](tmp_path / "data")
    del data["metrics"]["rows"][0]["state_bytes_per_device"]
    (study / "time_to_accuracy.json").write_text(json.dumps(data))
    assert f"| single | 1 | {single['time_s']:.1f} s ({single['steps']}) |  |" in tables.TABLES["time-to-accuracy"](tmp_path / "data")

    # The figure comes from the JSON alone.
    assert run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "time_to_accuracy.png").stat().st_size > 0


@pytest.mark.parametrize("flags,needles", [
    (["--models", "mlp,gpt"], ["--models", "gpt", "choices: mlp, cnn, resnet"]),
    (["--strategies", "hybrid"], ["--strategies", "choices: single, dp-pmap, dp-shard-map"]),
    (["--models", "vit"], ["no target accuracy for vit", "--targets"]),
    (["--targets", "mlp=1.5"], ["--targets", "(0, 1]"]),
    (["--targets", "mlp"], ["model=accuracy"])])
def test_bad_options_exit_2_with_the_fix_and_write_nothing(tmp_path, capsys, flags, needles):
    code = run(["time-to-accuracy", "--quick", *flags, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "x").exists()


def test_model_parallel_rows_on_the_cnn_follow_singles_trajectory(tmp_path):
    """The seeds' comparison in small: the CNN (no batch norm) under pipeline (1F1B) and
    tensor on 2 simulated devices and mpi-pipeline on 2 ranks trains on single's global
    batches, so it reaches the target at single's step along single's validation curve; the
    stages and shards hold less state per device. (layer-split and gems: CI time; their
    equality with single is tested in their own files.)"""
    from experiments.studies.time_to_accuracy import study as tta

    config = dataclasses.replace(
        tta.QUICK, models=("cnn",), width=None, depth=None, targets=("cnn=0.45",), batch_size=24,
        strategies=("single", "pipeline", "tensor", "mpi-pipeline"),
        schedules=("1f1b",), synthetic_size=600, val_size=120, out=str(tmp_path / "tta"))
    tta.run(config)
    rows, data = _rows(tmp_path / "tta")
    single = rows.pop("single")
    assert single["reached"] and set(rows) == {"pipeline", "tensor", "mpi-pipeline"}
    assert rows["pipeline"]["label"] == "pipeline (1f1b)" and rows["pipeline"]["devices"] == 2
    assert (rows["mpi-pipeline"]["ranks"], rows["mpi-pipeline"]["devices"]) == (2, 2)
    for name, r in rows.items():
        assert r["steps"] == single["steps"], name
        for a, b in zip(single["curve"], r["curve"], strict=True):
            assert abs(a["val_accuracy"] - b["val_accuracy"]) <= 2 / config.val_size, name
    for name in ("pipeline", "tensor", "mpi-pipeline"):
        assert rows[name]["state_bytes_per_device"] < single["state_bytes_per_device"], name
    summary = (tmp_path / "tta" / "summary.md").read_text()
    assert "| cnn | pipeline (1f1b) | 2 |" in summary and "| cnn | mpi-pipeline (1f1b) | 2 ranks |" in summary


def test_by_default_every_strategy_on_singles_trajectory_is_a_point():
    """The full study's plan: each model under every strategy that places it and trains on
    single's global batches (local SGD does not), the model-parallel ones on 2 simulated
    devices, the MPI ones on 2 single-threaded ranks of one device, both pipeline schedules;
    targets that take most of a real run, all at one constant learning rate."""
    from experiments.studies.time_to_accuracy import study as tta

    config = tta.TimeToAccuracyConfig()
    assert tta.targets(config) == {"mlp": 0.88, "cnn": 0.91, "resnet": RESNET_TARGET}
    planned = tta.time_to_accuracy_points(config)
    model_parallel = {"layer-split", "pipeline-gpipe", "pipeline-1f1b", "gems", "mpi-pipeline-gpipe",
                      "mpi-pipeline-1f1b"}
    data_parallel = {"single", "dp-pmap", "dp-shard-map", "dp-auto", "fsdp", "mpi-allreduce",
                     "mpi-param-server"}
    for model in config.models:
        here = {p.folder.removeprefix(f"{model}-"): p for p in planned if p.config.model.model == model}
        tensor = {"tensor", "tensor-auto"} if model != "mlp" else set()  # they do not place the MLP
        # mpi-pipeline carries no batch-norm statistics between ranks: not the ResNet
        mpi_pipeline = {"mpi-pipeline-gpipe", "mpi-pipeline-1f1b"} if model == "resnet" else set()
        assert (model_parallel - mpi_pipeline) | data_parallel | tensor <= set(here), model
        assert not mpi_pipeline & set(here), model
        assert not any(name.startswith(("local-sgd", "hybrid")) for name in here), model
        for name, point in here.items():
            c = point.config
            assert (c.optim.lr, c.optim.lr_schedule, c.target_accuracy) == (1e-3, "constant", tta.targets(config)[model])
            if name.startswith("mpi-"):
                assert (point.ranks, c.parallel.devices, c.parallel.single_thread) == (2, 1, True), name
            else:
                assert (point.ranks, c.parallel.devices) == (None, 1 if name == "single" else 2), name
    assert {"mlp-tensor", "mlp-tensor-auto", "cnn-hybrid", "resnet-mpi-pipeline"} <= set(tta.skipped(config))
