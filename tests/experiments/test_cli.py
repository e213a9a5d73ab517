"""The command line: every bad input gives one clear paragraph and a non-zero exit."""

import json

import pytest

from experiments.__main__ import run
from jaxpar.data import idx

TINY = ["--dataset", "synthetic", "--synthetic-size", "600", "--val-size", "100",
        "--model", "mlp", "--width", "32", "--depth", "1", "--steps", "3", "--no-progress"]


def fails(argv, capsys, *needles):
    try:
        code = run(argv)
    except SystemExit as e:  # argparse's own errors (bad choice) exit 2
        code = e.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize("flag,value,choice", [
    ("--dataset", "cifar", "fashion_mnist"), ("--model", "gpt", "cnn"),
    ("--strategy", "magic", "single"), ("--optimizer", "lion", "adam")])
def test_unknown_choice_lists_the_choices(capsys, flag, value, choice):
    fails(["train", flag, value], capsys, value, choice)


@pytest.mark.parametrize("bs", ["0", "100000"])
def test_bad_batch_size(capsys, tmp_path, bs):
    fails(["train", *TINY, "--batch-size", bs, "--out", str(tmp_path / "r")], capsys, "--batch-size")
    assert not (tmp_path / "r" / "result.json").exists()


def test_unwritable_out(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    fails(["train", *TINY, "--out", str(tmp_path / "file" / "r")], capsys, "--out")


def test_missing_idx_files_name_the_remedies(capsys, tmp_path):
    fails(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--cache-dir",
           str(tmp_path / "cache"), "--out", str(tmp_path / "r")], capsys, "train-images-idx3-ubyte")


@pytest.mark.parametrize("damage", ["truncate", "magic"])
def test_damaged_idx_file(capsys, tmp_path, damage):
    import numpy as np

    rng = np.random.default_rng(0)
    for split, n in (("train", 64), ("t10k", 16)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        idx.write_idx(tmp_path / f"{split}-images-idx3-ubyte", images)
        idx.write_idx(tmp_path / f"{split}-labels-idx1-ubyte", labels)
    target = tmp_path / "train-images-idx3-ubyte"
    raw = target.read_bytes()
    target.write_bytes(raw[:-100] if damage == "truncate" else b"\x00\x00\x09\x03" + raw[4:])
    fails(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--cache-dir",
           str(tmp_path / "cache"), "--out", str(tmp_path / "r")], capsys, "train-images-idx3-ubyte")


def test_mesh_on_single_names_the_fix(capsys, tmp_path):
    fails(["train", *TINY, "--mesh", "data=2", "--out", str(tmp_path)], capsys, "--mesh")


def test_train_writes_result_json(tmp_path, capsys):
    assert run(["train", *TINY, "--out", str(tmp_path / "run1")]) == 0
    result = json.loads((tmp_path / "run1" / "result.json").read_text())
    assert result["metrics"]["steps"] == 3 and result["config"]["model"]["model"] == "mlp"


def test_bench_prints_and_writes(tmp_path, capsys):
    assert run(["bench", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "32",
                "--iters", "3", "--warmup", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for word in ("median step", "images/s", "compile", "GFLOP/s", "% of"):
        assert word in printed
    m = json.loads((tmp_path / "result.json").read_text())["metrics"]
    assert m["images_per_sec"] > 0 and m["achieved_gflops"] > 0 and m["matmul_peak_gflops"] > 0


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        run(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dataset", "--data-dir", "--model", "--strategy", "--devices", "--mesh",
                 "--optimizer", "--lr", "--lr-schedule", "--batch-size", "--epochs", "--steps",
                 "--seed", "--out"):
        assert flag in out


def test_devices_flag_in_a_fresh_process(cli, tmp_path):
    proc = cli("bench", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "32",
               "--iters", "2", "--warmup", "1", "--devices", "3", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "result.json").read_text())["env"]["device_count"] == 3
