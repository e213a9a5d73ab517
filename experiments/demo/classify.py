"""Trained models for the demo's classify panel: loaded from a result folder or a checkpoint,
then asked for class probabilities (test images, a confusion matrix, a drawing's top 3).

    python -m pytest -q tests/experiments/demo/test_demo_classify.py

A checkpoint holds the state in the single-device layout (`jaxpar.checkpoint`), whatever
strategy and mesh trained it, so one forward pass (`jaxpar.step.forward`, the one every
strategy's `eval_step` runs) serves every run.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar import checkpoint as ckptlib
from jaxpar import data as datalib
from jaxpar.results import portable
from jaxpar.config import TrainConfig, from_dict
from jaxpar.errors import UserError
from jaxpar.results import RESULT_FILE
from jaxpar.results import load as load_result
from jaxpar.step import forward, split_model
from jaxpar.train import build_model

CHECKPOINT_SUBDIR = "checkpoint"  # where the demo's runs (and the committed models) keep theirs
EVAL_BATCH = 1000                 # one compiled shape for a whole test split


class LoadError(UserError):
    """A folder the demo cannot load a model from; the message names the fix."""


def class_names(dataset: str) -> list[str]:
    """The dataset's label names (its TFDS builder's), else the label numbers."""
    from jaxpar.data.tfds_idx import BUILDERS  # TFDS takes seconds to import: only when asked

    builder = BUILDERS.get(dataset)
    names = builder.LABEL_NAMES if builder is not None else None
    return list(names) if names else [str(i) for i in range(datalib.NUM_CLASSES)]


def shown(path: str | Path) -> str:
    """`path` as the page shows it: relative to the folder the demo was started in (the page
    and its screenshots never print the machine's absolute paths)."""
    return os.path.relpath(path) if Path(path).is_absolute() else str(path)


def find_checkpoint(folder: str | Path) -> Path:
    """The checkpoint folder behind `folder`: itself, its `checkpoint/` sub-folder (where the
    demo's runs keep theirs: found wherever the folder is moved or copied), or the one its
    result.json names (`config.checkpoint_dir`)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LoadError(f"{shown(folder)!r} is not a folder; give a result folder (holding "
                        f"{RESULT_FILE} and its checkpoint) or a --checkpoint-dir")
    candidates = [folder, folder / CHECKPOINT_SUBDIR]
    result = folder / RESULT_FILE
    recorded = None
    if result.exists():
        recorded = load_result(result).config.get("checkpoint_dir")
        if recorded:
            try:  # recorded relative to a named root (jaxpar.results.portable): this machine's folder
                candidates.append(Path(portable.resolve(recorded)))
            except ValueError:
                pass  # a folder outside the roots: only the checkpoint/ beside it can be found
    for candidate in candidates:
        if has_checkpoint(candidate):
            return candidate
    if result.exists():
        why = ("its run had no --checkpoint-dir, so no weights were saved" if not recorded else
               f"its checkpoint {shown(recorded)!r} is gone")
        raise LoadError(f"{shown(result)!r} has no checkpoint to load ({why}); train it again with "
                        "--checkpoint-dir, or load that run's checkpoint folder")
    raise LoadError(f"{shown(folder)!r} holds no jaxpar result ({RESULT_FILE}) and no checkpoint; give "
                    "a folder written by `python -m experiments train --out ... --checkpoint-dir ...`")


def has_checkpoint(folder: Path) -> bool:
    """A folder holding at least one complete step (`<step>/meta`, as checkpoint.py saves)."""
    return folder.is_dir() and any(p.name.isdigit() and (p / "meta").is_dir() for p in folder.iterdir())


@dataclass(frozen=True)
class Classifier:
    """One trained model, ready to predict; `name` is how the page labels it."""

    name: str
    folder: str
    config: TrainConfig
    step: int
    graphdef: Any
    params: Any
    model_state: Any

    @property
    def dataset(self) -> str:
        return self.config.data.dataset

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """Softmax of the logits, float32 [N, 10], for uint8 images [N, 28, 28, 1]."""
        return np.asarray(_softmax_forward(self.graphdef, self.params, self.model_state, images))

    def probabilities_of_split(self, images: np.ndarray) -> np.ndarray:
        """`probabilities` over a whole split in padded batches of EVAL_BATCH (one compile)."""
        n = len(images)
        size = min(EVAL_BATCH, n)
        labels = np.zeros(n, np.int32)
        out = [self.probabilities(b["image"])
               for b in datalib.eval_batches((images, labels), size)]
        return np.concatenate(out)[:n]


@functools.partial(jax.jit, static_argnums=0)
def _softmax_forward(graphdef, params, model_state, images):
    logits, _ = forward(graphdef, params, model_state, images, train=False)
    return jax.nn.softmax(logits, -1)


def load_classifier(folder: str | Path, dataset: str | None = None) -> Classifier:
    """The model in `folder` (a result folder or a checkpoint), its latest step.

    Args:
      dataset: refuse a model trained on another dataset (the demo classifies one).
    Raises:
      LoadError: no result or checkpoint there, or a checkpoint this code cannot rebuild.
    """
    directory = find_checkpoint(folder)
    try:
        flat, meta = ckptlib.load_checkpoint(str(directory))
    except ckptlib.CheckpointError as e:
        raise LoadError(str(e)) from None
    where = f"checkpoint {shown(directory)!r}"
    if meta.get("format") != ckptlib.FORMAT:
        raise LoadError(f"{where} is not a jaxpar checkpoint ({ckptlib.FORMAT}); load one written "
                        "by `python -m experiments train --checkpoint-dir`")
    try:
        config = from_dict(meta["config"])
        graphdef, params, model_state = split_model(build_model(config))
    except (TypeError, ValueError, KeyError) as e:
        raise LoadError(f"{where} holds a model this version cannot build ({e}); load a "
                        "checkpoint written by this version of jaxpar") from None
    if dataset is not None and config.data.dataset != dataset:
        raise LoadError(f"{where} was trained on {config.data.dataset}, and this demo classifies "
                        f"{dataset}; load a {dataset} model or start the demo with --dataset "
                        f"{config.data.dataset}")
    target = {"params": params, "model_state": model_state}
    _check_shapes(where, ckptlib.flatten(target), flat, config)
    state = ckptlib.unflatten(target, flat)
    folder = Path(folder)
    run = folder.parent if folder.name == CHECKPOINT_SUBDIR else folder
    return Classifier(name=model_name(run, config, int(meta["step"]), meta), folder=shown(folder),
                      config=config, step=int(meta["step"]), graphdef=graphdef,
                      params=state["params"], model_state=state["model_state"])


def model_name(run: Path, config: TrainConfig, step: int, meta: dict) -> str:
    """How the page labels a model: its strategy, model, step and accuracy (the run's test
    accuracy from its result.json, else the checkpoint's last validation), after the run's
    folder name where that is not just the strategy (the demo's runs are named by it)."""
    strategy, label = config.parallel.strategy, f"{config.parallel.strategy} {config.model.model}"
    parts = [label, f"step {step}"]
    result = run / RESULT_FILE
    test = load_result(result).metrics.get("test_accuracy") if result.exists() else None
    history = meta.get("history") or []
    if test is not None:
        parts.append(f"{test:.2%} test")
    elif history and history[-1].get("val_accuracy") is not None:
        parts.append(f"{history[-1]['val_accuracy']:.2%} validation")
    name = ", ".join(parts)
    return name if run.name == strategy else f"{run.name}: {name}"


def _check_shapes(where: str, want: dict[str, np.ndarray], have: dict[str, np.ndarray],
                  config: TrainConfig) -> None:
    """Every parameter the model built from the checkpoint's config has, in the same shape."""
    for key, value in want.items():
        got = have.get(key)
        if got is None or got.shape != value.shape:
            shape = "missing" if got is None else f"shaped {list(got.shape)}"
            raise LoadError(f"{where} does not fit its own model ({config.model.model}: {key} is "
                            f"{shape} there, the model needs {list(value.shape)}); it was written "
                            "by another model or version, so load a checkpoint of a jaxpar model")


def top_k(probabilities: np.ndarray, names: list[str], k: int = 3) -> list[tuple[str, float]]:
    """The k most probable (class name, probability) pairs of one image, best first."""
    order = np.argsort(-probabilities)[:k]
    return [(names[i], float(probabilities[i])) for i in order]


def confusion(labels: np.ndarray, predictions: np.ndarray, classes: int) -> np.ndarray:
    """Counts [true class, predicted class]."""
    out = np.zeros((classes, classes), np.int64)
    np.add.at(out, (labels, predictions), 1)
    return out
