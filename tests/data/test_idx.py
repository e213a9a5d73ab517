"""Reading and writing IDX files (`jaxpar/data/idx.py`): round trips and every damaged-file error.

Every test makes its own small IDX files under tmp_path; only the last one looks at the
Debian copy in /usr/share/datasets and is skipped without it.

    python -m pytest -q tests/data/test_idx.py
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from idx_files import FILES, make_split, write_dataset
from jaxpar.data import idx
from jaxpar.errors import DataError
from jaxpar.data.idx import find_idx_files, read_idx, read_split, write_idx


@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
def test_round_trip(tmp_path, name):
    images, labels = make_split(10, 2)
    write_idx(tmp_path / name, images)
    write_idx(tmp_path / ("l" + name), labels)
    got = read_idx(tmp_path / name)
    assert got.dtype == np.uint8 and got.shape == (10, 28, 28)
    np.testing.assert_array_equal(got, images)
    np.testing.assert_array_equal(read_idx(tmp_path / ("l" + name)), labels)
    # gzip is chosen by the name, and detected by content on reading.
    assert ((tmp_path / name).read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")


def test_header_is_standard(tmp_path):
    write_idx(tmp_path / "x", np.zeros((3, 28, 28), np.uint8))
    write_idx(tmp_path / "y", np.zeros(3, np.uint8))
    assert (tmp_path / "x").read_bytes()[:16] == bytes.fromhex("00000803 00000003 0000001c 0000001c")
    assert (tmp_path / "y").read_bytes()[:8] == bytes.fromhex("00000801 00000003")


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_file(tmp_path, gz):
    path = tmp_path / "train-images-idx3-ubyte"
    write_idx(path, make_split(4, 3)[0])
    raw = path.read_bytes()[:-100]
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)
    with pytest.raises(DataError, match="truncated") as e:
        read_idx(path)
    assert str(path) in str(e.value) and "--data-dir" in str(e.value)


def test_trailing_bytes(tmp_path):
    path = tmp_path / "labels"
    write_idx(path, np.arange(5, dtype=np.uint8))
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(DataError, match="longer than its header"):
        read_idx(path)


def test_wrong_magic(tmp_path):
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + b"\0" * 12)  # float32 dtype
    with pytest.raises(DataError, match="magic number") as e:
        read_idx(path)
    assert str(path) in str(e.value)


def test_bad_gzip(tmp_path):
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    good = gzip.compress(b"\x00\x00\x08\x01" + (100).to_bytes(4, "big") + bytes(100))
    path.write_bytes(good[:len(good) // 2])  # A cut-off download.
    with pytest.raises(DataError, match="gzip") as e:
        read_idx(path)
    assert str(path) in str(e.value)


def test_read_split_count_mismatch(tmp_path):
    write_idx(tmp_path / "i", make_split(5, 4)[0])
    write_idx(tmp_path / "l", np.zeros(4, np.uint8))
    with pytest.raises(DataError, match="do not match"):
        read_split(tmp_path / "i", tmp_path / "l")


@pytest.mark.parametrize("gz", [False, True])
def test_find_idx_files(tmp_path, gz):
    write_dataset(tmp_path, gz=gz)
    found = find_idx_files("fashion_mnist", tmp_path)
    ext = ".gz" if gz else ""
    assert found == {split: (tmp_path / (a + ext), tmp_path / (b + ext)) for split, (a, b) in FILES.items()}


def test_find_idx_files_missing(tmp_path):
    write_dataset(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte") as e:
        find_idx_files("mnist", tmp_path)
    assert "train-images" not in str(e.value)
    with pytest.raises(DataError, match="not a directory"):
        find_idx_files("mnist", tmp_path / "nope")


def test_find_idx_files_system(tmp_path, monkeypatch):
    monkeypatch.setitem(idx.SYSTEM_DIRS, "mnist", [str(tmp_path / "absent"), str(tmp_path)])
    assert find_idx_files("mnist", None) is None
    write_dataset(tmp_path)
    assert find_idx_files("mnist", None)["test"][0] == tmp_path / "t10k-images-idx3-ubyte.gz"



DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not (DEBIAN_DIR / "t10k-labels-idx1-ubyte.gz").exists(),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_debian_fashion_mnist_files():
    found = find_idx_files("fashion_mnist", None)
    assert found is not None
    images, labels = read_split(*found["test"])
    assert images.shape == (10000, 28, 28)
    assert np.bincount(labels).tolist() == [1000] * 10
