"""Small IDX data sets written under a test's tmp_path, for the idx and tfds_idx tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.data.idx import write_idx

N_TRAIN, N_TEST = 64, 16
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def make_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
            rng.integers(0, 10, n, dtype=np.uint8))


def write_dataset(directory: Path, gz: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Write a small train/test IDX dataset into directory and return its arrays."""
    directory.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    data = {"train": make_split(N_TRAIN, 0), "test": make_split(N_TEST, 1)}
    for split, (images, labels) in data.items():
        write_idx(directory / (FILES[split][0] + ext), images)
        write_idx(directory / (FILES[split][1] + ext), labels)
    return data
