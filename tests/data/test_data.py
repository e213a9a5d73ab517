"""Splits and batching: seeded, deterministic, fixed shapes, padding that changes nothing."""

import numpy as np
import pytest

from jaxpar import data
from jaxpar.config import DataConfig
from jaxpar.errors import DataError


def synthetic_cfg(**kw):
    return DataConfig(dataset="synthetic", synthetic_size=600, val_size=100, batch_size=32, **kw)


def test_validation_split_is_seeded_and_disjoint():
    a, b, c = (data.load_splits(synthetic_cfg(), seed=s) for s in (0, 0, 1))
    assert len(a.train[1]) == 500 and len(a.val[1]) == 100
    np.testing.assert_array_equal(a.val[0], b.val[0])
    assert not np.array_equal(a.val[0], c.val[0])
    # Disjoint: every training image differs from every validation image (noise makes
    # coincidences impossible), and together they are the whole original split.
    full = data.synthetic(600, seed=1)[0].reshape(600, -1)
    rows = {r.tobytes() for r in full}
    train_rows = {r.tobytes() for r in a.train[0].reshape(500, -1)}
    val_rows = {r.tobytes() for r in a.val[0].reshape(100, -1)}
    assert not train_rows & val_rows and train_rows | val_rows == rows


def test_epoch_order_depends_on_seed_and_epoch_only():
    split = data.synthetic(256, seed=0)
    first = [b["label"] for b in data.train_batches(split, 64, seed=3, epoch=0)]
    again = [b["label"] for b in data.train_batches(split, 64, seed=3, epoch=0)]
    other = [b["label"] for b in data.train_batches(split, 64, seed=3, epoch=1)]
    assert len(first) == 4
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(first, other))
    resumed = [b["label"] for b in data.train_batches(split, 64, seed=3, epoch=0, start=2)]
    for x, y in zip(first[2:], resumed):
        np.testing.assert_array_equal(x, y)


def test_train_batches_drop_remainder_and_keep_dtypes():
    split = data.synthetic(100, seed=0)
    batches = list(data.train_batches(split, 32, seed=0, epoch=0))
    assert len(batches) == 3
    for b in batches:
        assert b["image"].shape == (32, 28, 28, 1) and b["image"].dtype == np.uint8
        assert b["label"].dtype == np.int32 and b["weight"].dtype == np.float32


def test_eval_batches_cover_every_example_once_with_zero_weight_padding():
    split = data.synthetic(70, seed=0)
    batches = list(data.eval_batches(split, 32))
    assert [b["label"].shape[0] for b in batches] == [32, 32, 32]
    weights = np.concatenate([b["weight"] for b in batches])
    assert weights.sum() == 70 and np.all(weights[70:] == 0)
    labels = np.concatenate([b["label"] for b in batches])[:70]
    np.testing.assert_array_equal(labels, split[1])


@pytest.mark.parametrize("bs", [0, -3, 10_000])
def test_bad_batch_size_is_a_clear_error(bs):
    with pytest.raises(DataError, match="--batch-size"):
        data.load_splits(DataConfig(dataset="synthetic", synthetic_size=600, val_size=100, batch_size=bs), 0)


def test_unknown_dataset_lists_choices():
    with pytest.raises(DataError, match="fashion_mnist, mnist, synthetic"):
        data.load_splits(DataConfig(dataset="cifar"), 0)


def test_each_data_dir_gets_its_own_prepared_copy(tmp_path):
    """Two folders of IDX files never share a preparation (no silent reuse of stale data)."""
    from jaxpar.data import idx

    got = []
    for name, seed in (("a", 0), ("b", 1)):
        folder = tmp_path / name
        folder.mkdir()
        rng = np.random.default_rng(seed)
        for split, n in (("train", 40), ("t10k", 10)):
            idx.write_idx(folder / f"{split}-images-idx3-ubyte",
                          rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
            idx.write_idx(folder / f"{split}-labels-idx1-ubyte",
                          rng.integers(0, 10, n).astype(np.uint8))
        cfg = DataConfig(dataset="mnist", data_dir=str(folder), cache_dir=str(tmp_path / "cache"),
                         val_size=0, batch_size=8)
        got.append(data.load_splits(cfg, seed=0).train[0])
    assert not np.array_equal(got[0], got[1])
