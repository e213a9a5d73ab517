"""Read and write IDX files, the format MNIST and Fashion-MNIST ship in.

An IDX file is a 4-byte magic number (two zero bytes, a dtype code, the
number of dimensions), one big-endian uint32 per dimension, then the raw
data.  Files may be gzip-compressed.  Everything that can go wrong with a
file on disk (truncated, wrong magic, broken gzip) raises `DataError` with
one sentence that names the file and says what to do, so the CLI can print
it without a traceback.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from jaxpar.errors import DataError

# Magic numbers of the two kinds of MNIST files: 0x00000803 and 0x00000801.
IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
_UINT8_CODE = 0x08

# Split name -> (images file stem, labels file stem), as the datasets ship.
IDX_FILE_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# Where Linux distributions install the files (Debian: dataset-fashion-mnist).
SYSTEM_DIRS = {
    "fashion_mnist": ["/usr/share/datasets/fashion-mnist"],
    "mnist": ["/usr/share/datasets/mnist"],
}
# The package that installs them there: results name the files by it (jaxpar.results.portable).
DATASET_PACKAGES = {"fashion_mnist": "deb:dataset-fashion-mnist"}
# Where TFDS downloads them from when they are on no disk (jaxpar.data.tfds_idx).
DOWNLOAD_URLS = {
    "fashion_mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",  # HTTP only
    "mnist": "https://storage.googleapis.com/cvdf-datasets/mnist/",
}

_FIX = "re-download it or point --data-dir at a good copy"

NUM_CLASSES = 10            # MNIST's and Fashion-MNIST's classes (the built-in datasets)
IMAGE_SHAPE = (28, 28, 1)   # their images, uint8


def source_root(name: str) -> str:
    """How results name the system folder of dataset `name`: its package, else the dataset."""
    return f"<{DATASET_PACKAGES.get(name, f'datasets:{name}')}>"


def _read_bytes(path: Path) -> bytes:
    """Return the file's content, gunzipped when it is gzip-compressed."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"Cannot read IDX file {path}: {e.strerror or e}; {_FIX}.") from e
    # Decide by content, not by name: a renamed file should still load.
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(
            f"IDX file {path} is not a valid gzip file ({e}); {_FIX}."
        ) from e


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (gzip or raw) and check it is whole and well formed.

    Args:
        path: the file, e.g. ``train-images-idx3-ubyte.gz``.

    Returns:
        A uint8 array of the shape the header declares: [N, 28, 28] for an
        MNIST images file, [N] for a labels file.

    Raises:
        DataError: the file is unreadable, has a wrong magic number, or holds
            more or fewer bytes than its header promises.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(
            f"IDX file {path} is truncated ({len(data)} bytes, too short for a header); {_FIX}."
        )
    magic = struct.unpack(">I", data[:4])[0]
    if magic not in (IMAGES_MAGIC, LABELS_MAGIC):
        raise DataError(
            f"IDX file {path} has magic number {magic}, expected {IMAGES_MAGIC} (images) "
            f"or {LABELS_MAGIC} (labels), so it is not an uint8 MNIST-style IDX file; {_FIX}."
        )
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataError(f"IDX file {path} is truncated inside its header; {_FIX}.")
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    expected = header_len + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise DataError(
            f"IDX file {path} is {what}: header {shape} promises {expected} bytes "
            f"but it holds {len(data)}; {_FIX}."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(shape).copy()


def read_split(images_path: str | os.PathLike, labels_path: str | os.PathLike
               ) -> tuple[np.ndarray, np.ndarray]:
    """Read one split's images and labels files and check they fit together.

    Args:
        images_path: the ``*-images-idx3-ubyte[.gz]`` file.
        labels_path: the ``*-labels-idx1-ubyte[.gz]`` file.

    Returns:
        (images uint8 [N, H, W], labels uint8 [N]).

    Raises:
        DataError: a file is bad, the two are swapped, or their counts differ.
    """
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise DataError(f"IDX file {images_path} holds shape {images.shape}, not images [N, H, W]; {_FIX}.")
    if labels.ndim != 1:
        raise DataError(f"IDX file {labels_path} holds shape {labels.shape}, not labels [N]; {_FIX}.")
    if len(images) != len(labels):
        raise DataError(
            f"IDX files {images_path} ({len(images)} images) and {labels_path} "
            f"({len(labels)} labels) do not match; {_FIX}."
        )
    return images, labels


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file, gzip-compressed if path ends in .gz.

    Args:
        path: the file to write.
        array: uint8 labels [N] or images [N, H, W].
    """
    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim not in (1, 3):
        raise ValueError(
            f"write_idx needs uint8 labels [N] or images [N, H, W], got {array.dtype} {array.shape}"
        )
    header = struct.pack(">HBB", 0, _UINT8_CODE, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    payload = header + np.ascontiguousarray(array).tobytes()
    path = Path(path)
    if path.name.endswith(".gz"):
        # mtime=0 keeps the output byte-identical across runs.
        payload = gzip.compress(payload, mtime=0)
    path.write_bytes(payload)


def _find_in(directory: Path) -> tuple[dict[str, tuple[Path, Path]], list[str]]:
    """Look up the four standard files in one directory; return found and missing."""
    found: dict[str, tuple[Path, Path]] = {}
    missing: list[str] = []
    for split, stems in IDX_FILE_STEMS.items():
        pair = []
        for stem in stems:
            # Prefer the .gz: that is how the files are distributed.
            hit = next((directory / (stem + ext) for ext in (".gz", "")
                        if (directory / (stem + ext)).is_file()), None)
            if hit is None:
                missing.append(f"{stem}[.gz]")
            pair.append(hit)
        if None not in pair:
            found[split] = (pair[0], pair[1])
    return found, missing


def find_idx_files(
    name: str, data_dir: str | os.PathLike | None
) -> dict[str, tuple[Path, Path]] | None:
    """Find the four IDX files of a data set on disk.

    Args:
        name: 'fashion_mnist' or 'mnist' (chooses the system locations).
        data_dir: a directory that must hold the files, or None to look in
            the system locations (e.g. Debian's /usr/share/datasets/fashion-mnist).

    Returns:
        {'train': (images_path, labels_path), 'test': (...)}, or None when
        data_dir is None and no system location has all four files.

    Raises:
        DataError: data_dir was given but lacks some of the files.
    """
    if data_dir is not None:
        directory = Path(data_dir).expanduser()
        if not directory.is_dir():
            raise DataError(
                f"--data-dir {directory} is not a directory; point it at a directory holding "
                "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
                "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz."
            )
        found, missing = _find_in(directory)
        if missing:
            raise DataError(
                f"Data directory {directory} lacks {', '.join(missing)}; put the four IDX "
                f"files of {name} there (gzip or raw) or point --data-dir at a directory that has them."
            )
        return found
    for directory in SYSTEM_DIRS.get(name, []):
        found, missing = _find_in(Path(directory))
        if not missing:
            return found
    return None
