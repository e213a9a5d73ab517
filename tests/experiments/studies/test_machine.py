"""The machine command: what it plans on a CPU, one GPU or several (the probe's env faked),
speed-ups over the right baselines, the budget, and its quick form end to end (MPI ranks
when mpi4jax is here), resumed, then drawn into the "Other machines" table and figure.
The quick form without MPI and PyTorch runs in tests/test_install_light.py.

    python -m pytest -q tests/experiments/studies/test_machine.py
"""

import importlib.util
import shutil
import time

import pytest

from experiments.studies.machine import study as machine
from experiments.studies.machine import rows as machine_rows
from experiments.points.mpi import mpiexec
from experiments.studies.machine import figures as machine_figures
from experiments.publish import sources
from experiments.publish import tables
from experiments.__main__ import run
from experiments.peers.torch_point import TorchPoint
from jaxpar.runtime import optional
from jaxpar import results
from jaxpar.errors import ConfigError


def probe(backend: str, devices: int, cores: int) -> results.RunResult:
    env = {"backend": backend, "local_device_count": devices, "device_count": devices,
           "cores_available": cores, "device_kind": "cpu" if backend == "cpu" else "NVIDIA H100"}
    return results.RunResult(kind="bench", config={}, env=env, metrics={})


@pytest.fixture
def everything_installed(monkeypatch):
    monkeypatch.setattr(optional, "available", lambda module: True)
    monkeypatch.setattr(machine, "check_ranks", lambda *args: None)


def folders(planned) -> list[str]:
    return [p.folder for p in planned]


def test_a_16_core_cpu_gets_one_device_per_core_one_thread_each_and_ranks(everything_installed):
    planned, skipped = machine.machine_points(machine.MachineConfig(), probe("cpu", 1, 16))
    assert skipped == {}
    found = folders(planned)
    assert found[:2] == ["one-device/cnn", "one-device/resnet"]  # the MLP's is the probe
    assert [p.device for p in planned if isinstance(p, TorchPoint)] == ["cpu"] * 3
    devices = [p for p in planned if p.folder.startswith("devices/")]
    assert sorted({p.config.parallel.devices for p in devices}) == [1, 2, 4, 8, 16]
    assert all(p.config.parallel.single_thread for p in devices)
    assert all(p.config.data.batch_size == 128 * p.config.parallel.devices for p in devices)
    ranks = [p for p in planned if p.folder.startswith("ranks/")]
    assert sorted({p.ranks for p in ranks}) == [2, 4, 8, 16]  # 1 rank: devices/<model>-single-1
    assert "devices/resnet-single-1" in found


def test_one_gpu_is_one_device_and_no_simulated_devices_nor_ranks(everything_installed):
    planned, skipped = machine.machine_points(machine.MachineConfig(), probe("gpu", 1, 16))
    assert folders(planned) == ["one-device/cnn", "one-device/resnet", "torch/mlp", "torch/cnn",
                                "torch/resnet"]
    assert {p.device for p in planned if isinstance(p, TorchPoint)} == {"cuda"}
    assert not any(p.config.parallel.single_thread for p in planned if not isinstance(p, TorchPoint))
    assert set(skipped) == {"devices", "ranks"} and "not the CPU" in skipped["ranks"]


def test_four_gpus_are_measured_all_four_against_one(everything_installed):
    planned, _ = machine.machine_points(machine.MachineConfig(models=("cnn",)), probe("gpu", 4, 32))
    devices = [p for p in planned if p.folder.startswith("devices/")]
    assert [(p.config.parallel.devices, p.config.parallel.single_thread) for p in devices] == [(4, False)]
    with pytest.raises(ConfigError, match="every local device"):
        machine.machine_points(machine.MachineConfig(device_counts=(1, 2)), probe("gpu", 4, 32))


def test_without_torch_and_mpi4jax_the_rest_runs_and_says_why(monkeypatch):
    monkeypatch.setattr(optional, "available", lambda module: False)
    monkeypatch.setattr(machine, "check_ranks", lambda *a: (_ for _ in ()).throw(ConfigError("no mpi4jax")))
    planned, skipped = machine.machine_points(machine.MachineConfig(models=("mlp",)), probe("cpu", 1, 4))
    assert folders(planned) == ["devices/mlp-single-1", "devices/mlp-dp-shard-map-2",
                                "devices/mlp-dp-shard-map-4"]
    assert "optional dependency torch" in skipped["torch"] and skipped["ranks"] == "no mpi4jax"


def test_speed_ups_are_over_one_worker_and_over_pytorch():
    def rec(part, workers, ips, framework="jaxpar"):
        return {"part": part, "model": "cnn", "framework": framework, "devices": 1 if part == "ranks" else workers,
                "ranks": workers if part == "ranks" else 1, "images_per_sec": ips}
    rows = machine_rows.with_speedups([rec("one-device", 1, 300), rec("torch", 1, 200, "pytorch"),
                                       rec("devices", 1, 100), rec("devices", 4, 300),
                                       rec("ranks", 4, 200)])
    got = {(r["part"], r["workers"]): (r["speedup"], r["efficiency"]) for r in rows}
    assert got == {("one-device", 1): (1.5, None), ("torch", 1): (None, None),
                   ("devices", 1): (1.0, 1.0), ("devices", 4): (3.0, 0.75), ("ranks", 4): (2.0, 0.5)}


def test_points_past_the_budget_are_listed_not_started(tmp_path):
    config = machine.MachineConfig(out=str(tmp_path), budget=60)
    planned = [machine.one_device(config, "cnn"), machine.torch_eager(config, "cnn", "cpu")]
    records, failed, unstarted = machine.measure_points(config, planned, deadline=time.monotonic() + 1)
    assert records == [] and failed == {} and set(unstarted) == {"one-device/cnn", "torch/cnn"}
    assert "60 s budget spent" in unstarted["torch/cnn"]


@pytest.mark.parametrize("flags, needle", [(["--strategy", "tensor"], "data-parallel"),
                                           (["--budget", "0"], "--budget must be >= 1"),
                                           (["--models", "mlp,mlp"], "lists a value twice")])
def test_bad_options_exit_2_before_any_work(tmp_path, capsys, flags, needle):
    assert run(["machine", "--quick", "--out", str(tmp_path / "m"), *flags]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_quick_form_measures_resumes_and_reports(tmp_path, capsys):
    out = tmp_path / "data" / "machines" / "here"
    assert run(["machine", "--quick", "--out", str(out)]) == 0
    study = results.load(out / "machine.json")
    rows = study.metrics["rows"]
    parts = {(r["part"], r["workers"]) for r in rows}
    assert {("one-device", 1), ("devices", 1), ("devices", 2)} <= parts
    mpi = importlib.util.find_spec("mpi4jax") is not None and mpiexec().exists()
    assert (("ranks", 2) in parts) is mpi
    one = next(r for r in rows if r["part"] == "devices" and r["workers"] == 1)
    assert one["threads_per_process"] == 1 and one["speedup"] == 1.0
    assert study.env["backend"] == "cpu" and study.env["cores_available"] >= 1
    assert "| mlp | devices | jaxpar | dp-shard-map | 2 |" in (out / "summary.md").read_text()
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("result.json")}
    assert run(["machine", "--quick", "--out", str(out)]) == 0  # resumed: nothing measured again
    assert {p: p.stat().st_mtime_ns for p in out.rglob("result.json")} == before

    data = tmp_path / "data"
    shutil.copytree(out, data / "machines" / "there")  # a second machine beside it
    loaded = sources.load_source(data, "machines")
    assert [m["files"][0].parent.name for m in loaded["machines"]] == ["here", "there"]
    table = tables.TABLES["other-machines"](data)
    assert table.count("| here: ") == 1 and table.count("| there: ") == 1
    assert f"{study.env['cores_available']}-core" in table
    png = machine_figures.machines_speedup(loaded, tmp_path)
    assert png.stat().st_size > 10_000


def test_a_damaged_machine_file_names_the_command(tmp_path):
    (tmp_path / "machines" / "x").mkdir(parents=True)
    (tmp_path / "machines" / "x" / "machine.json").write_text("{")
    with pytest.raises(results.ResultsError, match="python -m experiments machine --out"):
        sources.load_source(tmp_path, "machines")
