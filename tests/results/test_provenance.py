"""Provenance in results: the revision a run *started* from (a commit made while it runs does
not change it), a dirty tree's diff hash with the diff written beside the result, and the
data source (the IDX files and their checksums)."""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
import pytest

from experiments.__main__ import run
from jaxpar.results import portable, provenance
from jaxpar import results
from jaxpar.config import DataConfig
from jaxpar.data.idx import DOWNLOAD_URLS, IDX_FILE_STEMS, SYSTEM_DIRS, write_idx
from jaxpar.parallel.single import Single
from jaxpar.results import RunResult

TRAIN = ["train", "--dataset", "synthetic", "--model", "mlp", "--width", "16", "--depth", "1",
         "--steps", "3", "--val-size", "0", "--batch-size", "32", "--synthetic-size", "256",
         "--no-progress"]


def git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A throw-away checkout that provenance reads instead of this one, nothing read yet."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    (repo / "code.py").write_text("x = 1\n")
    git(repo, "add", "code.py")
    git(repo, "commit", "-q", "-m", "first")
    monkeypatch.setattr(provenance, "REPO_DIR", repo)
    monkeypatch.setattr(provenance, "_git", None)
    return repo


def test_a_run_records_the_revision_it_started_from(repo, tmp_path, monkeypatch):
    started = git(repo, "rev-parse", "HEAD").strip()
    original = Single.step

    def step_then_commit(self, state, batch):  # someone commits while the run is training
        if git(repo, "rev-parse", "HEAD").strip() == started:
            (repo / "code.py").write_text("x = 2\n")
            git(repo, "commit", "-q", "-am", "second")
        return original(self, state, batch)

    monkeypatch.setattr(Single, "step", step_then_commit)
    assert run([*TRAIN, "--out", str(tmp_path / "out")]) == 0
    env = json.loads((tmp_path / "out" / "result.json").read_text())["env"]
    assert git(repo, "rev-parse", "HEAD").strip() != started  # the commit did happen
    assert env["git_revision"] == started and env["git_dirty"] is False
    assert env["git_diff_sha256"] is None and env["git_diff_file"] is None
    assert env["data_source"]["dataset"] == "synthetic"


def test_a_dirty_tree_records_the_diff_hash_and_writes_the_diff_beside(repo, tmp_path):
    (repo / "code.py").write_text("x = 3  # not committed\n")
    diff = git(repo, "diff", "HEAD", "--no-color", "--no-ext-diff")
    assert run([*TRAIN, "--out", str(tmp_path / "out")]) == 0
    env = json.loads((tmp_path / "out" / "result.json").read_text())["env"]
    assert env["git_dirty"] is True and env["git_revision"] == git(repo, "rev-parse", "HEAD").strip()
    assert env["git_diff_sha256"] == hashlib.sha256(diff.encode()).hexdigest()
    beside = tmp_path / "out" / env["git_diff_file"]
    assert beside.read_text() == diff


def test_results_and_figures_are_not_part_of_the_recorded_diff(repo, tmp_path):
    # A study re-measuring into the checkout's figures/data: the earlier points' files differ
    # from HEAD, the code does not; then the code does too.
    (repo / "figures" / "data").mkdir(parents=True)
    (repo / "figures" / "data" / "result.json").write_text("{}\n")
    git(repo, "add", "figures")
    git(repo, "commit", "-q", "-m", "results")
    (repo / "figures" / "data" / "result.json").write_text('{"new": 1}\n')
    assert provenance.read_git()["git_dirty"] is False
    (repo / "code.py").write_text("x = 5\n")
    got = provenance.read_git()
    assert got["git_dirty"] is True and "code.py" in got["diff"] and "figures" not in got["diff"]


def test_outside_a_checkout_the_revision_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO_DIR", tmp_path)
    monkeypatch.setattr(provenance, "_git", None)
    fields = provenance.capture(None)
    assert fields["git_revision"] == "unknown" and fields["git_dirty"] is None
    assert fields["data_source"] is None


def test_the_data_source_names_the_idx_files_and_their_checksums(tmp_path):
    rng = np.random.default_rng(0)
    for split, (images, labels) in IDX_FILE_STEMS.items():
        write_idx(tmp_path / f"{images}.gz", rng.integers(0, 256, (20, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{labels}.gz", rng.integers(0, 10, 20, dtype=np.uint8))
    cfg = DataConfig(dataset="fashion_mnist", data_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    source = provenance.data_source(cfg)
    names = {f"{stem}.gz" for pair in IDX_FILE_STEMS.values() for stem in pair}
    assert set(source["idx_files"]) == names
    for name, info in source["idx_files"].items():
        assert info["sha256"] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        assert info["path"] == portable.path(tmp_path / name)  # relative to <tmp>, not /tmp/...
    assert source["prepared"] is None  # not prepared yet: the run prepares it and reads again
    assert source["data_dir"] == portable.path(tmp_path) and "download_url" not in source


def test_without_idx_files_the_data_source_names_the_download(tmp_path, monkeypatch):
    monkeypatch.setitem(SYSTEM_DIRS, "mnist", [str(tmp_path / "none")])
    source = provenance.data_source(DataConfig(dataset="mnist", cache_dir=str(tmp_path / "cache")))
    assert source["idx_files"] is None and source["download_url"] == DOWNLOAD_URLS["mnist"]


def test_system_idx_files_are_named_by_their_package():
    assert portable.path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz") == \
        "<deb:dataset-fashion-mnist>/train-images-idx3-ubyte.gz"


def test_only_a_result_that_names_the_diff_gets_it_beside(repo, tmp_path):
    (repo / "code.py").write_text("x = 4\n")
    provenance.capture(None)
    plain = RunResult(kind="bench", config={}, env={"backend": "cpu"}, metrics={})
    results.save(plain, tmp_path / "plain")
    assert [p.name for p in (tmp_path / "plain").iterdir()] == ["result.json"]
    named = RunResult(kind="bench", config={}, env=results.environment(), metrics={})
    results.save(named, tmp_path / "named")
    assert sorted(p.name for p in (tmp_path / "named").iterdir()) == sorted(
        ["result.json", named.env["git_diff_file"]])
