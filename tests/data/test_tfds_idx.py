"""The TFDS builder over IDX files (`jaxpar/data/tfds_idx.py`): prepare, reuse, damage, download.

Every test makes its own small IDX files under tmp_path (downloads come from a local HTTP
server).

    python -m pytest -q tests/data/test_tfds_idx.py
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
import time

import numpy as np
import pytest

from idx_files import N_TEST, N_TRAIN, write_dataset
from jaxpar.data import idx
from jaxpar.errors import DataError

tfds_idx = pytest.importorskip("jaxpar.data.tfds_idx")


def assert_same(got, want):
    assert set(got) == {"train", "test"}
    for split, (images, labels) in want.items():
        x, y = got[split]
        assert x.dtype == np.uint8 and x.shape == (len(images), 28, 28, 1)
        assert y.dtype == np.int32 and y.shape == (len(labels),)
        np.testing.assert_array_equal(x[..., 0], images)  # Values and order.
        np.testing.assert_array_equal(y, labels)


@pytest.mark.parametrize("gz", [True, False])
def test_builder_round_trip(tmp_path, gz):
    want = write_dataset(tmp_path / "idx", gz=gz)
    cache = tmp_path / "cache"
    got = tfds_idx.load_arrays("mnist", tmp_path / "idx", cache)
    assert_same(got, want)
    version_dir = cache / "jaxpar_mnist" / "1.0.0"
    assert (version_dir / "dataset_info.json").exists()

    # The standard TFDS reader decodes the same records: the dataset is the truth.
    source = tfds_idx.JaxparMnist(data_dir=cache, file_format="array_record").as_data_source()
    assert len(source["train"]) == N_TRAIN
    for i in (0, 7, N_TEST - 1):
        example = source["test"][i]
        np.testing.assert_array_equal(example["image"][..., 0], want["test"][0][i])
        assert example["label"] == want["test"][1][i]

    # Second call reuses the prepared data, even when the IDX files are gone.
    mtime = (version_dir / "dataset_info.json").stat().st_mtime_ns
    for f in (tmp_path / "idx").iterdir():
        f.unlink()
    t0 = time.perf_counter()
    tfds_idx.prepare("mnist", tmp_path / "idx", cache)
    assert time.perf_counter() - t0 < 0.5
    assert (version_dir / "dataset_info.json").stat().st_mtime_ns == mtime
    assert_same(tfds_idx.load_arrays("mnist", None, cache), want)


def test_builder_fashion_label_names(tmp_path):
    write_dataset(tmp_path / "idx")
    tfds_idx.prepare("fashion_mnist", tmp_path / "idx", tmp_path / "cache")
    builder = tfds_idx.JaxparFashionMnist(data_dir=tmp_path / "cache", file_format="array_record")
    assert builder.info.features["label"].names[0] == "T-shirt/top"
    assert builder.info.splits["test"].num_examples == N_TEST


def test_builder_ignores_half_written_cache(tmp_path):
    want = write_dataset(tmp_path / "idx")
    cache = tmp_path / "cache"
    # What a prepare killed midway leaves: TFDS's temp dir, never the version dir.
    stale = cache / "jaxpar_mnist" / "incomplete.ABC123_1.0.0"
    stale.mkdir(parents=True)
    (stale / "jaxpar_mnist-train.array_record-00000-of-00001").write_bytes(b"junk")
    assert_same(tfds_idx.load_arrays("mnist", tmp_path / "idx", cache), want)
    assert not stale.exists()


def test_builder_bad_file_leaves_no_cache(tmp_path):
    write_dataset(tmp_path / "idx")
    labels = tmp_path / "idx" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:-4])
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        tfds_idx.prepare("mnist", tmp_path / "idx", tmp_path / "cache")
    assert not (tmp_path / "cache" / "jaxpar_mnist" / "1.0.0").exists()
    assert not list((tmp_path / "cache" / "jaxpar_mnist").glob("incomplete.*"))


def test_damaged_cache(tmp_path):
    write_dataset(tmp_path / "idx")
    cache = tmp_path / "cache"
    tfds_idx.prepare("mnist", tmp_path / "idx", cache)
    shard = next((cache / "jaxpar_mnist" / "1.0.0").glob("*-train.array_record-*"))
    shard.write_bytes(b"junk" * 100)
    with pytest.raises(DataError, match="delete that directory"):
        tfds_idx.load_arrays("mnist", tmp_path / "idx", cache)


def test_builder_missing_file_in_data_dir(tmp_path):
    write_dataset(tmp_path / "idx")
    (tmp_path / "idx" / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        tfds_idx.load_arrays("fashion_mnist", tmp_path / "idx", tmp_path / "cache")


def test_unknown_name(tmp_path):
    with pytest.raises(DataError, match="fashion_mnist, mnist"):
        tfds_idx.load_arrays("cifar10", None, tmp_path)


def test_offline_error_is_quick_and_helpful(tmp_path, monkeypatch):
    monkeypatch.setitem(idx.SYSTEM_DIRS, "fashion_mnist", [])
    # Port 9 on localhost: nothing listens, so the connection is refused.
    monkeypatch.setattr(tfds_idx.JaxparFashionMnist, "URL", "http://127.0.0.1:9/")
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        tfds_idx.prepare("fashion_mnist", None, tmp_path / "cache")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    for remedy in ("--data-dir", "sudo apt-get install dataset-fashion-mnist",
                   "python -m experiments prepare-data", str(tmp_path / "cache")):
        assert remedy in msg


@pytest.fixture
def http_dir(tmp_path):
    """Serve tmp_path/www over HTTP on localhost; yields (directory, base url)."""
    www = tmp_path / "www"
    www.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=os.fspath(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_download_through_tfds(tmp_path, monkeypatch, http_dir):
    import requests

    www, url = http_dir
    want = write_dataset(www)
    monkeypatch.setitem(idx.SYSTEM_DIRS, "mnist", [])
    monkeypatch.setattr(tfds_idx.JaxparMnist, "URL", url)
    monkeypatch.setattr(tfds_idx, "OFFICIAL_SIZES", {"train": N_TRAIN, "test": N_TEST})
    timeouts = []
    get = requests.Session.get

    def spy(self, u, **kwargs):
        timeouts.append(kwargs.get("timeout"))
        return get(self, u, **kwargs)

    monkeypatch.setattr(requests.Session, "get", spy)
    assert_same(tfds_idx.load_arrays("mnist", None, tmp_path / "cache"), want)
    # Every request TFDS made carried our timeout, so none can block forever.
    assert timeouts == [tfds_idx.HTTP_TIMEOUT_S] * 4


def test_download_from_stalled_server_gives_up(tmp_path, monkeypatch):
    import socket

    # A server that accepts connections and never answers.
    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setitem(idx.SYSTEM_DIRS, "mnist", [])
    monkeypatch.setattr(tfds_idx.JaxparMnist, "URL", f"http://127.0.0.1:{listener.getsockname()[1]}/")
    monkeypatch.setattr(tfds_idx, "HTTP_TIMEOUT_S", (1.0, 1.0))
    monkeypatch.setattr(tfds_idx, "HTTP_RETRIES", 0)
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="Downloading mnist .* failed"):
        tfds_idx.prepare("mnist", None, tmp_path / "cache")
    assert time.perf_counter() - t0 < 10
    listener.close()


def test_bad_download_is_deleted(tmp_path, monkeypatch, http_dir):
    www, url = http_dir
    want = write_dataset(www)
    good = (www / "t10k-labels-idx1-ubyte.gz").read_bytes()
    (www / "t10k-labels-idx1-ubyte.gz").write_bytes(b"<html>Sign in to the Wi-Fi</html>")
    monkeypatch.setitem(idx.SYSTEM_DIRS, "mnist", [])
    monkeypatch.setattr(tfds_idx.JaxparMnist, "URL", url)
    cache = tmp_path / "cache"
    official = tfds_idx.OFFICIAL_SIZES
    monkeypatch.setattr(tfds_idx, "OFFICIAL_SIZES", {"train": N_TRAIN, "test": N_TEST})
    with pytest.raises(DataError, match="magic number.*run again"):
        tfds_idx.prepare("mnist", None, cache)
    # Official copies must have the official sizes.
    (www / "t10k-labels-idx1-ubyte.gz").write_bytes(good)
    monkeypatch.setattr(tfds_idx, "OFFICIAL_SIZES", official)
    with pytest.raises(DataError, match="expected 60000"):
        tfds_idx.prepare("mnist", None, cache)
    # Nothing bad was kept: the next run downloads afresh and succeeds.
    monkeypatch.setattr(tfds_idx, "OFFICIAL_SIZES", {"train": N_TRAIN, "test": N_TEST})
    assert_same(tfds_idx.load_arrays("mnist", None, cache), want)


