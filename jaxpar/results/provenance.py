"""Where a result came from: the code revision a run started from, and the data it read.

A Python process runs the code it imported when it started, so the revision is read once,
at the start of a run (`capture`, called first thing by the CLI, `train` and `bench`), and
every result the process writes reports that reading, not the tree at write time. A dirty
tree records the SHA-256 of its diff (`git diff HEAD`, the checkout's `figures/` left out:
results and drawings are what runs write, not the code they run, and a study re-measuring
into its own folder would otherwise record every earlier point's files); `write_diff_beside`
puts the diff itself next to the results file. The data source names the files a run read (relative to
named roots: the working folder, jaxpar's cache, the package that installed them; jaxpar.results.portable)
and their checksums, or the arrays it was given and theirs.

    provenance.capture(config.data)     # at the start of a run
    provenance.environment_fields()     # -> the git_* and data_source fields of results' env
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar import data as datalib
from jaxpar.results import portable
from jaxpar.errors import DataError
from jaxpar.data.idx import DOWNLOAD_URLS, find_idx_files

# The folder git is asked about: a folder of the checkout this package was imported from.
REPO_DIR = Path(__file__).resolve().parent
# Diffs larger than this are recorded by hash and size only (results folders stay small).
MAX_DIFF_BYTES = 256 * 1024
# The whole checkout but its results and figures (the module's docstring: why).
CODE_PATHS = (":/", ":(top,exclude)figures")
_HASH_CHUNK = 1 << 20

_git: dict[str, Any] | None = None        # the first reading in this process
_data: dict[str, Any] | None = None       # the data source of the latest run
_data_config = None                       # its DataConfig, to re-read a copy made after start
_file_hashes: dict[tuple, str] = {}       # (path, size, mtime) -> sha256, so reruns are free


def _git_out(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO_DIR, capture_output=True, text=True,
                          timeout=10, check=True).stdout


def read_git() -> dict[str, Any]:
    """The checkout's HEAD, whether tracked files outside `figures/` differ from it, and that diff.

    Returns:
      {'git_revision': commit or 'unknown', 'git_dirty': bool or None (not a checkout),
       'git_diff_sha256': hex or None, 'git_diff_bytes': int, 'diff': the text (not for JSON)}
    """
    try:
        rev = _git_out("rev-parse", "HEAD").strip()
        status = _git_out("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS).strip()
        diff = _git_out("diff", "HEAD", "--no-color", "--no-ext-diff", "--", *CODE_PATHS) if status else ""
    except (OSError, subprocess.SubprocessError):
        return {"git_revision": "unknown", "git_dirty": None, "git_diff_sha256": None,
                "git_diff_bytes": 0, "diff": ""}
    digest = hashlib.sha256(diff.encode()).hexdigest() if status else None
    return {"git_revision": rev or "unknown", "git_dirty": bool(status),
            "git_diff_sha256": digest, "git_diff_bytes": len(diff.encode()), "diff": diff}


def capture(data=None) -> dict[str, Any]:
    """Record where this run starts from: call first thing in a run.

    The revision is read on the first call in a process and kept (the process goes on running
    the code it imported then); the data source is replaced on every call.

    Args:
      data: the run's `jaxpar.config.DataConfig`, or None when the run reads no dataset
        (bench times synthetic batches of the real shapes).
    Returns:
      the fields `environment_fields` will report.
    """
    global _git, _data, _data_config
    if _git is None:
        _git = {**read_git(), "git_read_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _data_config = data
    _data = None if data is None else data_source(data)
    return environment_fields()


def environment_fields() -> dict[str, Any]:
    """The provenance part of a result's `env` (reads the revision now if no run captured it)."""
    global _data
    if _git is None:
        capture(None)
    if _data is not None and _data.get("prepared", True) is None:
        _data = data_source(_data_config)  # the run prepared its copy after it started
    fields = {k: v for k, v in _git.items() if k != "diff"}
    fields["git_diff_file"] = diff_file_name() if _diff_to_write() else None
    fields["data_source"] = _data
    return fields


def diff_file_name() -> str | None:
    """`git-diff-<12 hex>.patch`: named by its hash, so runs with other diffs never collide."""
    digest = (_git or {}).get("git_diff_sha256")
    return f"git-diff-{digest[:12]}.patch" if digest else None


def _diff_to_write() -> bool:
    return bool(_git and _git["git_dirty"] and 0 < _git["git_diff_bytes"] <= MAX_DIFF_BYTES)


def write_diff_beside(result_path: str | os.PathLike, text: str) -> Path | None:
    """Write the captured diff next to `result_path` when the result written there (`text`)
    names it in its env (once per folder); None otherwise."""
    if not _diff_to_write() or diff_file_name() not in text:
        return None
    path = Path(result_path).parent / diff_file_name()
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(_git["diff"])
        os.replace(tmp, path)
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (cached by path, size and modification time)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _file_hashes:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                h.update(chunk)
        _file_hashes[key] = h.hexdigest()
    return _file_hashes[key]


def _files(paths) -> dict[str, dict[str, Any]]:
    return {Path(p).name: {"path": portable.path(p), "bytes": Path(p).stat().st_size,
                           "sha256": sha256_file(p)} for p in paths}


def arrays_source(dataset: datalib.Dataset) -> dict[str, Any]:
    """A dataset passed as arrays: where they came from, their sizes and a checksum of their
    bytes (images and labels of both splits, in order)."""
    digest = hashlib.sha256()
    for images, labels in (dataset.train, dataset.test):
        digest.update(np.ascontiguousarray(images).data)
        digest.update(np.ascontiguousarray(labels).data)
    return {"dataset": dataset.name, "source": dataset.source,
            "train_examples": len(dataset.train[1]), "test_examples": len(dataset.test[1]),
            "image_shape": list(dataset.spec.image_shape), "num_classes": dataset.num_classes,
            "sha256": digest.hexdigest()}


def data_source(data) -> dict[str, Any]:
    """Which files a run's dataset is read from, with their checksums.

    Real datasets are read from the prepared TFDS copy (`prepared`: its record files, the
    bytes training sees, under <cache>); `idx_files` are the IDX files jaxpar finds for the
    dataset now (--data-dir, else the system copy, named by its package), which the copy is
    prepared from on first use (None: none on disk, so the copy came from a download, from
    `download_url`). A copy the run prepares itself is read again when the result is written.
    """
    if data.dataset in datalib.REGISTERED:
        return arrays_source(datalib.REGISTERED[data.dataset])
    if data.dataset == "synthetic":
        return {"dataset": "synthetic", "generated": "jaxpar.data.synthetic (seeded; no files)",
                "synthetic_size": data.synthetic_size}
    try:
        found = find_idx_files(data.dataset, data.data_dir)
    except DataError:
        found = None  # the run itself reports a bad --data-dir
    idx = _files(sorted(p for pair in found.values() for p in pair)) if found else None
    prepared = None
    root = Path(datalib.cache_dir(data)).expanduser()
    versions = sorted(root.glob(f"jaxpar_{data.dataset}/*/dataset_info.json"))
    if versions:
        folder = versions[-1].parent
        prepared = {"folder": portable.path(folder),
                    "files": _files(sorted(p for p in folder.iterdir() if "array_record" in p.name))}
    source = {"dataset": data.dataset, "data_dir": portable.path(data.data_dir), "idx_files": idx,
              "prepared": prepared}
    if idx is None:
        source["download_url"] = DOWNLOAD_URLS.get(data.dataset)
    return source
