"""Datasets as numpy arrays, the seeded validation split, and batching.

Fashion-MNIST (the default) and MNIST come from the prepared TFDS dataset (`jaxpar.tfds_idx`);
`synthetic` is a small learnable stand-in for tests and benchmarks, never a silent fallback.
Images stay uint8 on the host; `jaxpar.step.normalize` makes them float32 on device.

    splits = load(DataConfig(), seed=0)
    for batch in train_batches(splits.train, 128, seed=0, epoch=0): ...
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from jaxpar.config import DataConfig
from jaxpar.errors import DataError

DATASETS = ("fashion_mnist", "mnist", "synthetic")
NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)  # every dataset's images, uint8

Arrays = tuple[np.ndarray, np.ndarray]  # (images uint8 [N,28,28,1], labels int32 [N])


@dataclass(frozen=True)
class Splits:
    train: Arrays
    val: Arrays | None
    test: Arrays


def cache_dir(cfg: DataConfig) -> str:
    """Where a prepared dataset lives: --cache-dir, $JAXPAR_CACHE, or ~/.cache/jaxpar.

    Data prepared from an explicit --data-dir gets its own sub-folder keyed by the files'
    path, sizes and times, so other IDX files never silently reuse an earlier preparation.
    """
    root = cfg.cache_dir or os.environ.get("JAXPAR_CACHE") or os.path.expanduser("~/.cache/jaxpar")
    if cfg.data_dir is None:
        return root
    source = os.path.realpath(cfg.data_dir)
    try:
        listing = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                         for e in os.scandir(source) if "-ubyte" in e.name)
    except OSError:
        listing = []  # a missing folder fails with a clear message when it is read
    key = hashlib.sha1(repr((source, listing)).encode()).hexdigest()[:12]
    return os.path.join(root, f"from-data-dir-{key}")


def load(cfg: DataConfig, seed: int) -> Splits:
    """Train / validation / test arrays; validation is `val_size` examples carved from train
    by a permutation seeded with `seed`, so the same seed always holds out the same examples."""
    if cfg.dataset not in DATASETS:
        raise DataError(f"unknown --dataset {cfg.dataset!r}; choices: {', '.join(DATASETS)}")
    if cfg.dataset == "synthetic":
        raw = {"train": synthetic(cfg.synthetic_size, seed=1), "test": synthetic(512, seed=2)}
    else:
        from jaxpar import tfds_idx  # TFDS import is slow; synthetic runs skip it

        raw = tfds_idx.load_arrays(cfg.dataset, cfg.data_dir, cache_dir(cfg))
    train, test = raw["train"], raw["test"]
    n = len(train[1])
    if not 0 <= cfg.val_size < n:
        raise DataError(f"--val-size must be in [0, {n}) for {cfg.dataset}, got {cfg.val_size}")
    val = None
    if cfg.val_size:
        order = np.random.default_rng(seed).permutation(n)
        held, kept = np.sort(order[:cfg.val_size]), np.sort(order[cfg.val_size:])
        val = (train[0][held], train[1][held])
        train = (train[0][kept], train[1][kept])
    check_batch_size(cfg.batch_size, len(train[1]), "training")
    return Splits(train=train, val=val, test=test)


def check_batch_size(batch_size: int, split_size: int, split: str) -> None:
    if batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {batch_size}")
    if batch_size > split_size:
        raise DataError(
            f"--batch-size {batch_size} is larger than the {split} split ({split_size} examples); "
            "lower --batch-size (or --val-size, which is carved from train)")


def synthetic(n: int, seed: int, noise: float = 60.0) -> Arrays:
    """`n` learnable 28x28 images: one fixed random template per class plus Gaussian noise
    (standard deviation `noise` grey levels; more noise, a harder task)."""
    templates = np.random.default_rng(1234).integers(0, 256, (NUM_CLASSES, 28, 28, 1))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
    noise = rng.normal(0, noise, (n, 28, 28, 1))
    images = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
    return images, labels


def steps_per_epoch(n_examples: int, batch_size: int) -> int:
    """Training drops the last partial batch, so every step has the same shape (no retrace)."""
    return n_examples // batch_size


def train_batches(split: Arrays, batch_size: int, seed: int, epoch: int,
                  start: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Shuffled batches of one epoch, the order a function of (seed, epoch) alone.

    Args:
      start: skip this many batches (resuming mid-epoch gives the same batches that follow).
    """
    images, labels = split
    order = np.random.default_rng([seed, epoch]).permutation(len(labels))
    weight = np.ones(batch_size, np.float32)
    for i in range(start, steps_per_epoch(len(labels), batch_size)):
        idx = np.sort(order[i * batch_size:(i + 1) * batch_size])  # sorted: faster gathers
        yield {"image": images[idx], "label": labels[idx], "weight": weight}


def eval_batches(split: Arrays, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Every example once, in order; the last batch is padded with weight-0 rows so all
    batches share one shape (one compiled eval program)."""
    images, labels = split
    n = len(labels)
    for lo in range(0, n, batch_size):
        hi = min(lo + batch_size, n)
        yield pad_batch({"image": images[lo:hi], "label": labels[lo:hi],
                         "weight": np.ones(hi - lo, np.float32)}, batch_size)


def pad_batch(batch: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """Pad every array to `size` rows; padding rows get weight 0 so they change nothing."""
    n = len(batch["label"])
    if n == size:
        return batch
    return {k: np.concatenate([v, np.zeros((size - n, *v.shape[1:]), v.dtype)])
            for k, v in batch.items()}
