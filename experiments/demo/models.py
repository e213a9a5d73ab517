"""The models the demo has loaded, the dataset's test split and each model's predictions on
it: the state behind the classify panel (one presenter, so one state for every browser tab).

    python -m pytest -q tests/experiments/demo/test_demo_classify.py
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np

from experiments.demo import classify
from experiments.demo.safety import inside
from jaxpar import data as datalib
# At import, so in the main thread before the page serves: TFDS's lazy-import hook is
# process-wide while TFDS imports, and breaks imports made meanwhile in Gradio's workers.
from jaxpar.data import tfds_idx
from jaxpar.config import DataConfig
from jaxpar.errors import DataError, UserError
from jaxpar.data.idx import find_idx_files
from jaxpar.results import RESULT_FILE
from jaxpar.results import load as load_result

ROOT = Path(__file__).resolve().parents[2]
# Small models trained by the command in docs/demo.md and committed, so a fresh clone can
# classify drawings at once; the demo preloads those of its dataset.
BUNDLED = ROOT / "figures" / "data" / "demo"
SEED = 0  # which test images are shown first; "new test images" moves on from it


class Models:
    """Loaded classifiers of one dataset and what the page shows of them.

    Args:
      roots: the folders the page may load from (None: any folder; the operator's choice).
    """

    def __init__(self, dataset: str, roots: list[Path] | None = None):
        self.dataset = dataset
        self.roots = roots
        self.version = 0  # counts loads and unloads: a page shows the models of a version
        self._lock = threading.Lock()  # the train panel's tick loads finished runs meanwhile
        self.loaded: list[classify.Classifier] = []
        self.names = classify.class_names(dataset)
        self._test: tuple[np.ndarray, np.ndarray] | None = None
        self._probabilities: dict[str, np.ndarray] = {}  # model name -> [N, 10] on the test split
        self.shown = SEED

    def load(self, folder: str | Path, trusted: bool = False) -> str:
        """Load the model in `folder`; the line the page shows. Raises UserError (the message).

        Args:
          trusted: the operator named it (--load): `roots` do not apply.
        """
        if not str(folder).strip():
            raise classify.LoadError("give a folder: a result folder or a checkpoint")
        folder = str(folder).strip()
        if not trusted:
            self._check_inside(folder)
        model = classify.load_classifier(folder, self.dataset)
        same = Path(model.folder).resolve()
        with self._lock:
            self.loaded = [m for m in self.loaded if Path(m.folder).resolve() != same]  # a reload
            if any(m.name == model.name for m in self.loaded):  # two runs of one name: say where
                model = dataclasses.replace(model, name=f"{Path(model.folder).parent.name}/{model.name}")
            self.loaded.append(model)
            self._probabilities.pop(model.name, None)
            self.version += 1
        return f"loaded {model.name} from {model.folder}"

    def _check_inside(self, folder: str) -> None:
        """LoadError unless `folder` and the checkpoint it names lie under `roots`: a page that
        others reach must not read the machine's other folders."""
        if self.roots is None:
            return
        where = ", ".join(classify.shown(r) for r in self.roots)
        path = Path(folder)
        if inside(path, self.roots) and path.is_dir():  # then the checkpoint it leads to
            path = classify.find_checkpoint(path)
        if not inside(path, self.roots):
            raise classify.LoadError(f"{classify.shown(path)!r} is outside the folders this demo "
                                     f"loads from ({where}); pick one of the list, or start the "
                                     "demo with --load-anywhere to load any folder")

    def clear(self) -> None:
        with self._lock:
            self.loaded, self._probabilities = [], {}
            self.version += 1

    def preload(self, folders: list[str | Path]) -> list[str]:
        """Load each folder the operator named; a line per folder, errors included (the demo
        starts anyway)."""
        lines = []
        for folder in folders:
            try:
                lines.append(self.load(folder, trusted=True))
            except UserError as e:
                lines.append(f"could not load {classify.shown(folder)}: {e}")
        return lines

    def bundled(self) -> list[Path]:
        """The committed models trained on this dataset, relative to the working folder
        (as the page shows them)."""
        return [Path(classify.shown(p)) for p in candidates([BUNDLED]) if _dataset_of(p) == self.dataset]

    # --- the test split --------------------------------------------------------------------
    def test_split(self) -> tuple[np.ndarray, np.ndarray]:
        """The dataset's test images and labels (DataError, naming prepare-data, if absent)."""
        if self._test is None:
            check_offline(self.dataset)
            self._test = datalib.load_splits(DataConfig(dataset=self.dataset, val_size=0), seed=SEED).test
        return self._test

    def probabilities(self) -> dict[str, np.ndarray]:
        """Model name -> class probabilities [N, 10] over the whole test split (cached)."""
        images, _ = self.test_split()
        for model in self.loaded:
            if model.name not in self._probabilities:
                self._probabilities[model.name] = model.probabilities_of_split(images)
        return {m.name: self._probabilities[m.name] for m in self.loaded}

    def sample(self, count: int = 10) -> np.ndarray:
        """Indices of `count` test images; each call after `next_sample` shows others."""
        n = len(self.test_split()[1])
        return np.random.default_rng(self.shown).choice(n, size=min(count, n), replace=False)

    def next_sample(self) -> None:
        self.shown += 1


def check_offline(dataset: str) -> None:
    """DataError unless `dataset` can be read without a download (the demo fetches nothing):
    prepared already, or its IDX files on disk (Debian's dataset-fashion-mnist)."""
    if dataset not in tfds_idx.BUILDERS:
        return  # synthetic: made on the fly
    builder = tfds_idx.BUILDERS[dataset]
    # Where tfds_idx.prepare looks first (its fast path): the prepared dataset's metadata.
    prepared = (Path(datalib.cache_dir(DataConfig(dataset=dataset))) / builder.name
                / str(builder.VERSION) / "dataset_info.json")
    if not prepared.exists() and find_idx_files(dataset, None) is None:
        raise DataError(f"{dataset} is not on this machine, and the demo downloads nothing; prepare "
                        f"it before the demo: python -m experiments prepare-data --dataset {dataset}")


def _dataset_of(folder: Path) -> str | None:
    """The dataset a result folder's run trained on (None when it has no result.json)."""
    try:
        return load_result(folder / RESULT_FILE).config["data"]["dataset"]
    except (UserError, KeyError):
        return None


def candidates(roots: list[Path]) -> list[Path]:
    """Folders under `roots` (two levels down) that hold a result or a checkpoint to load, the
    newest first (the runs just trained)."""
    found = []
    for root in roots:
        if not root.is_dir():
            continue
        for folder in sorted([*root.glob("*"), *root.glob("*/*")]):
            if not folder.is_dir() or folder.name == classify.CHECKPOINT_SUBDIR:
                continue
            if ((folder / RESULT_FILE).exists() or classify.has_checkpoint(folder)
                    or classify.has_checkpoint(folder / classify.CHECKPOINT_SUBDIR)):
                found.append(folder)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
