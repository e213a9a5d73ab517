"""Datasets as numpy arrays, the seeded validation split, and batching.

Fashion-MNIST (the default) and MNIST come from the prepared TFDS dataset (`jaxpar.data.tfds_idx`);
`synthetic` is a small learnable stand-in for tests and benchmarks, never a silent fallback.
A user's own arrays (or a TFDS dataset on disk) become a `Dataset`, registered by its name so
that a run's config names it like the built-in ones (`register_dataset`). Images stay uint8
on the host; `jaxpar.step.normalize` makes them float32 on device. The image shape and the
class count of a run come from its dataset (`spec`), never from a constant.

    splits = load(DataConfig(), seed=0)
    for batch in train_batches(splits.train, 128, seed=0, epoch=0): ...
    register_dataset(Dataset.from_arrays(x, y, test_x=tx, test_y=ty, name="mine"))
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from jaxpar.config import DataConfig
from jaxpar.errors import DataError
from jaxpar.data.idx import IMAGE_SHAPE, NUM_CLASSES  # the built-in datasets'

DATASETS = ("fashion_mnist", "mnist", "synthetic")  # the built-in ones

Arrays = tuple[np.ndarray, np.ndarray]  # (images uint8 [N, H, W, C], labels int32 [N])


class Spec(NamedTuple):
    """What a model must take and give for a dataset: images [B, *image_shape] (float32 in
    [0, 1] once normalised) in, logits [B, num_classes] out."""
    image_shape: tuple[int, ...]
    num_classes: int


BUILTIN_SPEC = Spec(IMAGE_SHAPE, NUM_CLASSES)


@dataclass(frozen=True, eq=False)
class Dataset:
    """A user's dataset as arrays: train and test splits (validation is carved from train by
    `--val-size`, as for the built-in datasets). Build it with `from_arrays` or `from_tfds`,
    which check everything before any work."""

    name: str
    train: Arrays
    test: Arrays
    num_classes: int
    source: str = "arrays"   # where the arrays came from, for the results' provenance

    @property
    def spec(self) -> Spec:
        return Spec(tuple(int(d) for d in self.train[0].shape[1:]), self.num_classes)

    @classmethod
    def from_arrays(cls, train_x, train_y, *, test_x, test_y, num_classes: int | None = None,
                    name: str = "arrays", source: str = "arrays") -> "Dataset":
        """Check and wrap numpy arrays.

        Args:
          train_x, test_x: images, uint8 pixels 0-255, [N, H, W, C] (or [N, H, W]: one channel).
          train_y, test_y: integer labels [N] in [0, num_classes).
          num_classes: default: the largest label + 1.
          name: what results and checkpoints call the dataset (`config.data.dataset`).
        Raises:
          DataError naming the array and the fix: lengths that differ, an empty split,
          images that are not uint8, labels that are not integers or out of range.
        """
        if not isinstance(name, str) or not name or name in DATASETS:
            raise DataError(f"a Dataset's name must be a non-empty string other than the "
                            f"built-in {', '.join(DATASETS)}; got {name!r}")
        train = _checked("train", train_x, train_y)
        test = _checked("test", test_x, test_y)
        if train[0].shape[1:] != test[0].shape[1:]:
            raise DataError(f"train_x images are {train[0].shape[1:]} but test_x images are "
                            f"{test[0].shape[1:]}; both splits need one image shape")
        top = int(max(train[1].max(), test[1].max()))
        classes = top + 1 if num_classes is None else num_classes
        if not isinstance(classes, (int, np.integer)) or classes < 2:
            raise DataError(f"num_classes must be a whole number >= 2, got {classes!r}")
        if top >= classes:
            raise DataError(f"labels must be in [0, {classes}) for num_classes={classes}, but "
                            f"the largest is {top}; pass the right num_classes or fix the labels")
        return cls(name, train, test, int(classes), source)

    @classmethod
    def from_tfds(cls, name: str, *, data_dir: str | None = None, train_split: str = "train",
                  test_split: str = "test", image_key: str = "image",
                  label_key: str = "label") -> "Dataset":
        """A TFDS dataset already prepared under `data_dir` in TFDS's array_record format
        (nothing is downloaded; no TensorFlow needed), as arrays.

        Raises:
          DataError naming the dataset and folder when TFDS cannot read it there.
        """
        import tensorflow_datasets as tfds  # TFDS takes seconds to import; arrays runs skip it

        splits = {}
        for split in (train_split, test_split):
            try:
                records = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
                rows = [records[i] for i in range(len(records))]
            except Exception as e:  # TFDS raises its own errors for a missing or bad copy
                raise DataError(f"TFDS dataset {name!r} (split {split!r}) cannot be read from "
                                f"{data_dir or 'the default TFDS folder'} ({type(e).__name__}: "
                                f"{e}); prepare it there first (`tfds build`, array_record "
                                "format), or pass data_dir") from e
            splits[split] = (np.stack([r[image_key] for r in rows]) if rows else np.zeros((0,), np.uint8),
                             np.asarray([r[label_key] for r in rows]))
        (tx, ty), (vx, vy) = splits[train_split], splits[test_split]
        return cls.from_arrays(tx, ty, test_x=vx, test_y=vy, name=name, source=f"tfds:{name}")


def _checked(split: str, images, labels) -> Arrays:
    """`split`'s images as uint8 [N, H, W, C] and labels as int32 [N], or DataError."""
    x, y = f"{split}_x", f"{split}_y"
    if images is None or labels is None:
        raise DataError(f"pass {x} and {y}: the {split} split is needed "
                        f"({'the final test accuracy is measured on it' if split == 'test' else 'to train'})")
    images, labels = np.asarray(images), np.asarray(labels)
    if images.size == 0 or labels.size == 0:
        raise DataError(f"{x} or {y} is empty; the {split} split needs at least one example")
    if images.dtype != np.uint8:
        raise DataError(f"{x} has dtype {images.dtype}; images must be uint8 pixels 0-255 "
                        "(from floats in [0, 1]: (x * 255).round().astype(np.uint8))")
    if images.ndim == 3:
        images = images[..., None]  # [N, H, W]: one channel
    if images.ndim != 4:
        raise DataError(f"{x} has shape {images.shape}; images must be [N, H, W, C] or [N, H, W]")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{y} has shape {labels.shape} and dtype {labels.dtype}; labels must be "
                        "integers [N] (class indices)")
    if len(images) != len(labels):
        raise DataError(f"{x} has {len(images)} images but {y} has {len(labels)} labels; "
                        "they must have the same length")
    if labels.min() < 0:
        raise DataError(f"{y} holds the negative label {int(labels.min())}; labels are class "
                        "indices 0, 1, ...")
    return images, labels.astype(np.int32)


# Datasets passed to the API, by name: a run's config names its dataset, and every part of
# the run (the loop, the strategies' shape traces, provenance) finds the arrays here.
REGISTERED: dict[str, Dataset] = {}


def register_dataset(dataset: Dataset) -> str:
    """Make `dataset` a choice of `--dataset` (by its name, replacing one of that name)."""
    REGISTERED[dataset.name] = dataset
    return dataset.name


def dataset_names() -> tuple[str, ...]:
    """The built-in datasets, then the registered ones."""
    return (*DATASETS, *REGISTERED)


def spec(cfg: DataConfig) -> Spec:
    """The image shape and class count of `cfg`'s dataset."""
    return REGISTERED[cfg.dataset].spec if cfg.dataset in REGISTERED else BUILTIN_SPEC


@dataclass(frozen=True)
class Splits:
    train: Arrays
    val: Arrays | None
    test: Arrays


def cache_root(explicit: str | None = None) -> str:
    """jaxpar's cache folder: `explicit` (--cache-dir), $JAXPAR_CACHE, or ~/.cache/jaxpar."""
    return explicit or os.environ.get("JAXPAR_CACHE") or os.path.expanduser("~/.cache/jaxpar")


def cache_dir(cfg: DataConfig) -> str:
    """Where a prepared dataset lives: --cache-dir, $JAXPAR_CACHE, or ~/.cache/jaxpar.

    Data prepared from an explicit --data-dir gets its own sub-folder keyed by the files'
    path, sizes and times, so other IDX files never silently reuse an earlier preparation.
    """
    root = cache_root(cfg.cache_dir)
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


def load_splits(cfg: DataConfig, seed: int) -> Splits:
    """Train / validation / test arrays; validation is `val_size` examples carved from train
    by a permutation seeded with `seed`, so the same seed always holds out the same examples."""
    if cfg.dataset not in dataset_names():
        raise DataError(f"unknown --dataset {cfg.dataset!r}; choices: {', '.join(dataset_names())}")
    if cfg.dataset in REGISTERED:
        raw = {"train": REGISTERED[cfg.dataset].train, "test": REGISTERED[cfg.dataset].test}
    elif cfg.dataset == "synthetic":
        raw = {"train": synthetic(cfg.synthetic_size, seed=1), "test": synthetic(512, seed=2)}
    else:
        from jaxpar.data import tfds_idx  # TFDS import is slow; synthetic runs skip it

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


def synthetic(n: int, seed: int, noise: float = 60.0, shape: tuple[int, ...] = IMAGE_SHAPE,
              classes: int = NUM_CLASSES) -> Arrays:
    """`n` learnable images of `shape`: one fixed random template per class plus Gaussian
    noise (standard deviation `noise` grey levels; more noise, a harder task)."""
    templates = np.random.default_rng(1234).integers(0, 256, (classes, *shape))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n).astype(np.int32)
    noise = rng.normal(0, noise, (n, *shape))
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
