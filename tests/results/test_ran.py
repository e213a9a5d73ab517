"""Every result records what ran (jaxpar/results/ran.py): the convolution and batch-norm forms
`--conv-impl` resolved to, oneDNN's version and ISA where its convolutions ran, XLA's threads,
a pipeline's formulation, the GPU and its driver; `report`'s machine lines show it, and old
results without it still report ("not recorded").

    python -m pytest -q tests/results/test_ran.py
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import ROOT, run_cli
from experiments.publish import measured_on
from jaxpar import api, results
from jaxpar.results import ran
from jaxpar.config import TrainConfig, with_options
from jaxpar.models import layers, onednn

SMALL = dict(dataset="synthetic", synthetic_size=64, val_size=0, batch_size=16, progress=False)


def bench(**options) -> results.RunResult:
    config = with_options(TrainConfig(), **{**SMALL, **options})
    return api.run_bench(config, iters=1, warmup=1, matmul_peak=False)


def test_a_cnn_records_what_auto_resolved_to():
    env = bench(model="resnet", depth=1).env
    resolved = layers.resolve_conv_impl("auto")  # onednn where it builds, else cpu: this machine's answer
    assert env["ran"]["conv"] == resolved and env["ran"]["batch_norm"] == "fast"
    if resolved == "onednn":
        assert re.fullmatch(r"\d+\.\d+\.\d+", env["ran"]["onednn"]["version"])
        assert env["ran"]["onednn"]["isa"] in onednn._isa_names().values()
    else:
        assert env["ran"]["onednn"] is None
    assert env["ran"]["xla_threads"] == env["threads_per_process"] >= 1
    assert env["ran"]["pipeline"] is None and env["gpu"] is None  # a CPU backend


def test_forms_chosen_by_hand_are_recorded_as_chosen():
    ran_ = bench(model="cnn", batch_norm=True, conv_impl="xla").env["ran"]
    assert (ran_["conv"], ran_["batch_norm"], ran_["onednn"]) == ("xla", "flax", None)
    mlp = bench(model="mlp", width=16, depth=1).env["ran"]
    assert (mlp["conv"], mlp["batch_norm"], mlp["onednn"]) == (None, None, None)


@pytest.mark.parametrize("impl", ["spmd", "mpmd"])
def test_a_pipeline_records_its_formulation_in_env_and_strategy(impl, tmp_path):
    done = run_cli("bench", "--dataset", "synthetic", "--model", "mlp", "--width", "16", "--depth", "2",
                   "--batch-size", "16", "--strategy", "pipeline", "--devices", "2", "--microbatches",
                   "2", "--pipeline-impl", impl, "--iters", "1", "--warmup", "1", "--no-matmul-peak",
                   "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads((tmp_path / results.RESULT_FILE).read_text())
    assert written["env"]["ran"]["pipeline"] == impl == written["strategy"]["implementation"]


def test_the_driver_version_is_read_from_the_kernel_module(tmp_path, monkeypatch):
    line = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 2025\n")
    (tmp_path / "version").write_text(line)
    monkeypatch.setattr(ran, "DRIVER_FILE", str(tmp_path / "version"))
    assert ran.driver_version() == "570.86.15"


def _train_folder(tmp_path, with_ran: bool):
    """figures/data/train's two results copied to a scratch data folder; the MLP's with an
    env.ran as a run now records it."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "figures/data/train", data / "train")
    if with_ran:
        mlp = json.loads((data / "train/mlp.json").read_text())
        mlp["env"]["ran"] = {"conv": None, "batch_norm": None, "onednn": None, "xla_threads": 2,
                             "pipeline": None}
        mlp["env"]["gpu"] = {"name": "NVIDIA H200", "driver": "570.86.15"}
        (data / "train/mlp.json").write_text(json.dumps(mlp))
    return data


def test_machine_lines_show_what_ran_and_old_files_as_not_recorded(tmp_path):
    line = measured_on.machine_line("train-cnn", _train_folder(tmp_path, with_ran=True))
    assert line.endswith(" *Ran:* XLA CPU threads per process 2, GPU NVIDIA H200, driver "
                         "570.86.15; 1 file(s) not recorded.")


def test_a_folder_of_old_results_keeps_its_line():
    data = ROOT / "figures/data"
    line = measured_on.machine_line("train-cnn", data)
    assert "*Ran:*" not in line and line.startswith("*Measured on:*")
    assert measured_on.ran_words([{"ran": {"conv": "onednn", "onednn": {"version": "3.2.0", "isa": "avx2"},
                                      "xla_threads": 16}},
                             {"ran": {"conv": "cpu", "xla_threads": 2, "pipeline": "mpmd"}}]) == (
        " *Ran:* convolutions cpu / onednn, oneDNN 3.2.0 (avx2), XLA CPU threads per process "
        "2 / 16, pipeline mpmd.")
