"""The demo's classify panel without a browser: models load from result folders and
checkpoints written under any strategy, their predictions are `eval_step`'s, bad folders and
incompatible checkpoints give a message and nothing else, test images and confusion matrices.

    python -m pytest -q tests/experiments/demo/test_demo_classify.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from conftest import requires_devices
from experiments.demo import classify, views
from experiments.demo.models import Models, candidates
from jaxpar import data as datalib
from jaxpar.results import portable
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.step import eval_step, init_state
from jaxpar.train import evaluate, fit


def tiny(folder: Path, **kw) -> TrainConfig:
    base = dict(dataset="synthetic", synthetic_size=800, val_size=100, batch_size=32, model="mlp",
                width=32, depth=1, steps=25, progress=False, out=str(folder),
                checkpoint_dir=str(folder / classify.CHECKPOINT_SUBDIR))
    return with_options(TrainConfig(), **{**base, **kw})


def train(folder: Path, **kw):
    """A finished run as the demo's live runs leave it: result.json beside checkpoint/."""
    outcome = fit(tiny(folder, **kw))
    results.save(outcome.result, folder)
    return outcome


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    single = train(root / "single")
    return root, single


def test_class_names():
    assert classify.class_names("fashion_mnist")[1] == "Trouser"
    assert classify.class_names("mnist") == [str(i) for i in range(10)]


@pytest.mark.parametrize("strategy", ["single", pytest.param("dp-shard-map", marks=requires_devices(2))])
def test_predictions_are_eval_steps(tmp_path, strategy):
    """A checkpoint from any strategy gives the probabilities whose argmax and log-loss
    `jaxpar.step.eval_step` computes, and the accuracy the run itself measured."""
    outcome = train(tmp_path / strategy, strategy=strategy)
    model = classify.load_classifier(tmp_path / strategy, "synthetic")
    assert model.step == 25
    images, labels = datalib.load_splits(outcome.strategy.config.data, seed=0).test
    probs = model.probabilities_of_split(images)
    predicted = probs.argmax(-1)

    state = init_state(model.params, model.model_state, optax.identity())
    batch = {"image": images[:64], "label": predicted[:64].astype(np.int32), "weight": np.ones(64, np.float32)}
    sums = jax.device_get(eval_step(model.graphdef, state, batch))
    assert sums["correct"] == 64  # eval_step's argmax is ours, example by example
    batch["label"] = labels[:64]
    sums = jax.device_get(eval_step(model.graphdef, state, batch))
    assert sums["correct"] == np.sum(predicted[:64] == labels[:64])
    np.testing.assert_allclose(sums["loss_sum"], -np.log(probs[np.arange(64), labels[:64]]).sum(), rtol=1e-4)

    # The run's own evaluation of its final state (on its devices) agrees with the loaded model.
    eval_bs = min(outcome.strategy.config.data.eval_batch_size, len(labels))  # its compiled shape
    measured = evaluate(outcome.strategy, outcome.state, (images, labels), eval_bs)
    assert np.mean(predicted == labels) == pytest.approx(measured["accuracy"], abs=1e-9)


def test_a_checkpoint_folder_loads_as_well_as_its_result_folder(runs):
    root, _ = runs
    a = classify.load_classifier(root / "single")
    b = classify.load_classifier(root / "single" / classify.CHECKPOINT_SUBDIR)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    assert candidates([root]) == [root / "single"]


def test_a_moved_result_folder_finds_its_checkpoint(runs, tmp_path):
    root, _ = runs
    shutil.copytree(root / "single", tmp_path / "moved")
    result = results.load(tmp_path / "moved")
    result.config["checkpoint_dir"] = str(tmp_path / "gone")
    results.save(result, tmp_path / "moved")
    assert classify.load_classifier(tmp_path / "moved").step == 25


def test_a_result_whose_checkpoint_lives_elsewhere(runs, tmp_path):
    root, _ = runs
    result = results.load(root / "single")  # train --out A --checkpoint-dir B
    results.save(result, tmp_path)
    recorded = result.config["checkpoint_dir"]  # relative to its root (jaxpar.results.portable)
    assert recorded.startswith("<tmp>/")
    assert classify.find_checkpoint(tmp_path) == Path(portable.resolve(recorded))
    assert classify.load_classifier(tmp_path).step == 25


def test_a_folder_without_a_result_or_checkpoint(tmp_path):
    with pytest.raises(classify.LoadError, match="holds no jaxpar result"):
        classify.load_classifier(tmp_path)
    with pytest.raises(classify.LoadError, match="is not a folder"):
        classify.load_classifier(tmp_path / "nowhere")


def test_a_result_without_a_checkpoint(runs, tmp_path):
    root, _ = runs
    result = results.load(root / "single")
    result.config["checkpoint_dir"] = None
    results.save(result, tmp_path)
    with pytest.raises(classify.LoadError, match="no --checkpoint-dir, so no weights were saved"):
        classify.load_classifier(tmp_path)


def _edit_meta(folder: Path, edit) -> None:
    """Rewrite the JSON metadata of every step of a checkpoint (as another writer might have)."""
    for meta in folder.glob("*/meta/metadata"):
        d = json.loads(meta.read_text())
        edit(d)
        meta.write_text(json.dumps(d))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["config"]["model"].update(width=64), "does not fit its own model"),
    (lambda d: d["config"]["model"].update(model="transformer-xl"), "cannot build"),
    (lambda d: d["config"].update(no_such_option=1), "cannot build"),
    (lambda d: d.update(format="something-else"), "not a jaxpar checkpoint"),
])
def test_an_incompatible_checkpoint_is_refused(runs, tmp_path, edit, message):
    root, _ = runs
    shutil.copytree(root / "single" / classify.CHECKPOINT_SUBDIR, tmp_path / "ckpt")
    _edit_meta(tmp_path / "ckpt", edit)
    with pytest.raises(classify.LoadError, match=message):
        classify.load_classifier(tmp_path / "ckpt")


def test_a_model_of_another_dataset_is_refused(runs):
    root, _ = runs
    with pytest.raises(classify.LoadError, match="trained on synthetic.*--dataset synthetic"):
        classify.load_classifier(root / "single", "mnist")


def test_bad_folders_leave_the_loaded_models_alone(runs, tmp_path):
    root, _ = runs
    models = Models("synthetic")
    lines = models.preload([root / "single", tmp_path, "/nowhere/at/all"])
    assert lines[0].startswith("loaded single")
    assert lines[1].startswith("could not load") and "holds no jaxpar result" in lines[1]
    assert lines[2].startswith("could not load") and "is not a folder" in lines[2]
    assert len(models.loaded) == 1
    with pytest.raises(classify.LoadError):
        models.load("   ")
    models.load(root / "single")  # loading again replaces, it does not duplicate
    assert len(models.loaded) == 1
    shutil.copytree(root / "single", tmp_path / "other" / "single")  # another run of that name
    models.load(tmp_path / "other" / "single")
    assert [m.name.split(" ")[0] for m in models.loaded] == ["single", "other/single"]


def test_test_images_and_confusion(runs):
    root, outcome = runs
    models = Models("synthetic")
    models.load(root / "single")
    probs = models.probabilities()
    images, labels = models.test_split()
    name = models.loaded[0].name
    assert probs[name].shape == (len(labels), 10)
    matrix = classify.confusion(labels, probs[name].argmax(-1), 10)
    assert matrix.sum() == len(labels)
    assert np.trace(matrix) / len(labels) == pytest.approx(outcome.result.metrics["test_accuracy"])
    idx = models.sample(6)
    html = views.test_images_html(images[idx], labels[idx], {k: v[idx] for k, v in probs.items()},
                                  models.names)
    assert html.count("<img") == 6 and name in html
    models.next_sample()
    assert not np.array_equal(models.sample(6), idx)
    fig = views.confusion_figure(labels, probs, models.names)
    assert len(fig.axes) == 1 and "test accuracy" in fig.axes[0].get_title()


def test_top3_table(runs):
    root, _ = runs
    models = Models("synthetic")
    assert "No model loaded" in views.top3_markdown([], None, [])
    models.load(root / "single")
    assert "Draw an item" in views.top3_markdown(models.loaded, None, models.names)
    image = datalib.load_splits(models.loaded[0].config.data, seed=0).test[0][0]
    table = views.top3_markdown(models.loaded, image, models.names)
    name = models.loaded[0].name
    assert name in table and table.count("%") == 3 + name.count("%")  # three classes and the name's


def test_the_demo_downloads_nothing(monkeypatch, tmp_path):
    """A dataset neither prepared nor on disk is refused with the command that prepares it,
    instead of the download `train` would start."""
    from experiments.demo.models import check_offline
    from jaxpar.data import idx
    from jaxpar.errors import DataError

    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path))
    monkeypatch.setitem(idx.SYSTEM_DIRS, "mnist", [])
    check_offline("synthetic")
    with pytest.raises(DataError, match="prepare-data --dataset mnist"):
        check_offline("mnist")
    with pytest.raises(DataError, match="downloads nothing"):
        Models("mnist").test_split()


def test_a_models_name_says_strategy_model_step_and_accuracy(runs, tmp_path, monkeypatch):
    root, outcome = runs
    accuracy = outcome.result.metrics["test_accuracy"]
    model = classify.load_classifier(root / "single", "synthetic")
    assert model.name == f"single mlp, step 25, {accuracy:.2%} test"  # the demo's runs: by strategy
    shutil.copytree(root / "single", tmp_path / "my-run")
    named = classify.load_classifier(tmp_path / "my-run" / classify.CHECKPOINT_SUBDIR, "synthetic")
    assert named.name == f"my-run: single mlp, step 25, {accuracy:.2%} test"
    (tmp_path / "my-run" / results.RESULT_FILE).unlink()  # a checkpoint alone: its last validation
    assert classify.load_classifier(tmp_path / "my-run", "synthetic").name.endswith("% validation")
    # Paths as the page shows them: relative to where the demo started, never absolute.
    monkeypatch.chdir(tmp_path)
    assert Models("synthetic").load(tmp_path / "my-run", trusted=True).endswith("from my-run")
    with pytest.raises(classify.LoadError, match=r"^'nowhere' is not a folder"):
        classify.load_classifier(tmp_path / "nowhere")


def test_the_page_loads_only_under_its_folders(runs, tmp_path, monkeypatch):
    """Classify reads the runs, results/ and committed folders, not the rest of the machine
    (a name outside, a symbolic link out, `..`), unless the operator named it (--load) or
    started the demo with --load-anywhere (roots None)."""
    root, _ = runs
    monkeypatch.chdir(tmp_path)
    allowed = tmp_path / "results"
    shutil.copytree(root / "single", allowed / "single")
    (allowed / "link").symlink_to(root / "single")
    (allowed / "elsewhere").mkdir()  # its result.json names a checkpoint outside
    elsewhere = json.loads((root / "single" / results.RESULT_FILE).read_text())
    # results record paths relative to the folder their run started in; name this one by its
    # absolute path, so it resolves outside from wherever the demo stands
    elsewhere["config"]["checkpoint_dir"] = str((root / "single" / "checkpoint").resolve())
    (allowed / "elsewhere" / results.RESULT_FILE).write_text(json.dumps(elsewhere))
    models = Models("synthetic", roots=[allowed])
    assert models.load("results/single").startswith("loaded single mlp")
    for outside in (root / "single", "results/link", "results/elsewhere", "results/../results/../../",
                    tmp_path / "no-such-folder-outside"):
        with pytest.raises(classify.LoadError, match="outside the folders this demo loads from "
                                                     r"\(results\).*--load-anywhere"):
            models.load(outside)
    assert len(models.loaded) == 1
    assert models.preload([root / "single"])[0].startswith("loaded")  # the operator's --load
    assert Models("synthetic", roots=None).load(root / "single").startswith("loaded")
