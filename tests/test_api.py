"""The library API (`jaxpar.fit`, `Dataset.from_arrays`, `register_model`) with a model defined
here, not in jaxpar/models: equal to `single` under fsdp and pipeline, trained on arrays of
another image shape and class count, checkpoints, resume, events and divergence as from the
command line, and bad input refused before anything is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import equivalence as eq
import jaxpar
from jaxpar import api
from jaxpar.results import portable
from jaxpar import data as datalib
from jaxpar.errors import ConfigError, DataError, Diverged
from jaxpar.models import MODELS
from jaxpar.models.sequence import Layer, apply

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def registries_as_they_were():
    """Models and datasets these tests pass are registered by name; other tests see only the
    built-in ones."""
    models, datasets = dict(MODELS), dict(datalib.REGISTERED)
    yield
    MODELS.clear()
    MODELS.update(models)
    datalib.REGISTERED.clear()
    datalib.REGISTERED.update(datasets)


class TinyNet(nnx.Module):
    """A user's classifier: flatten, a hidden layer, logits; `layers()` for model parallelism."""

    def __init__(self, *, num_classes: int, in_features: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(in_features, 24, rngs=rngs)
        self.head = nnx.Linear(24, num_classes, rngs=rngs)

    def layers(self) -> list[Layer]:
        return [Layer("hidden", (("hidden",),),
                      lambda h, train: nnx.relu(self.hidden(h.reshape(h.shape[0], -1)))),
                Layer("head", (("head",),), lambda h, train: self.head(h))]

    def __call__(self, x, train: bool = False):
        return apply(self.layers(), x, train)


class NoLayers(nnx.Module):
    """A classifier without `layers()`: fine for data parallelism, refused by model parallelism."""

    def __init__(self, *, num_classes: int, in_features: int, rngs: nnx.Rngs):
        self.fc = nnx.Linear(in_features, num_classes, rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.fc(x.reshape(x.shape[0], -1))


def arrays(shape=(28, 28, 1), classes=5, train=640, test=160, noise=60.0) -> datalib.Dataset:
    """Learnable synthetic images of `shape` in `classes` classes, as a user would pass them."""
    x, y = datalib.synthetic(train, 1, noise, shape=shape, classes=classes)
    tx, ty = datalib.synthetic(test, 2, noise, shape=shape, classes=classes)
    return jaxpar.Dataset.from_arrays(x, y, test_x=tx, test_y=ty, name=f"test-{classes}x{shape}")


SGD = dict(optimizer="sgd", lr_schedule="constant", lr=0.1, batch_size=16, val_size=0)
STRATEGIES = {"single": {}, "fsdp": dict(mesh="data=2"),
              "pipeline": dict(mesh="stage=2", microbatches=2)}


@pytest.mark.skipif(len(jax.devices()) != 2, reason="runs in its own 2-device process, started "
                    "by test_user_model_under_fsdp_and_pipeline_equals_single")
def test_user_model_through_the_api_on_two_devices():
    data = arrays()
    batch = next(datalib.train_batches(data.train, 16, seed=0, epoch=0))
    ref = None
    for strategy, options in STRATEGIES.items():
        config = api.configure(TinyNet, data, strategy=strategy, devices=2, **options, **SGD)
        grads = eq.run(config, steps=1, global_batches=[batch]).grads  # step 1, directly
        params = nnx.to_pure_dict(nnx.state(jaxpar.fit(TinyNet, data, strategy=strategy, devices=2,
                                                        steps=5, **options, **SGD).model, nnx.Param))
        if ref is None:
            ref = grads, params
            continue
        eq.assert_tree_close(ref[0], grads, what=f"{strategy}'s step-1 gradients")
        eq.assert_tree_close(ref[1], params, what=f"{strategy}'s parameters after 5 SGD steps")
    # Stages traced with the dataset's images (32x32x3), not the built-in 28x28x1.
    other = arrays(shape=(32, 32, 3), classes=5)
    trained = jaxpar.fit(TinyNet, other, strategy="layer-split", devices=2, epochs=2, batch_size=32,
                         val_size=64, lr=3e-3)
    assert trained.result.metrics["test_accuracy"] > 0.9, trained.result.metrics
    assert trained.result.strategy["boundary_elements_per_example"] == [24]


def test_user_model_under_fsdp_and_pipeline_equals_single():
    """The test above in a process with 2 simulated devices (a mesh uses every device)."""
    env = {**os.environ, "JAXPAR_TEST_DEVICES": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_user_model_through_the_api_on_two_devices"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_five_classes_of_32x32x3_images_train_and_write_their_result(tmp_path):
    data = arrays(shape=(32, 32, 3), classes=5)
    trained = jaxpar.fit(TinyNet, data, epochs=2, batch_size=32, val_size=64, lr=3e-3,
                         out=str(tmp_path / "run"))
    m = trained.result.metrics
    assert m["test_accuracy"] > 0.9, m  # 5 learnable classes: far above chance (0.2)
    assert trained.predict(data.test[0][:64]).tolist() == \
        np.asarray(jax.numpy.argmax(trained.model(data.test[0][:64] / 255.0), -1)).tolist()
    written = json.loads((tmp_path / "run" / "result.json").read_text())
    assert written["config"]["data"]["dataset"] == data.name
    assert written["config"]["model"]["model"] == "TinyNet"
    source = written["env"]["data_source"]
    assert (source["image_shape"], source["num_classes"], source["train_examples"]) == ([32, 32, 3], 5, 640)
    assert written["config"]["out"] == portable.path(tmp_path / "run")  # relative to <tmp>


def test_an_instance_trains_from_its_own_parameters_and_is_not_changed():
    model = TinyNet(num_classes=5, in_features=784, rngs=nnx.Rngs(7))
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    config = api.configure(model, arrays(), steps=1, **SGD)
    built = nnx.to_pure_dict(nnx.state(jaxpar.train.build_model(config), nnx.Param))
    eq.assert_tree_close(before, built, tol=0.0, what="the run's initial parameters")
    trained = jaxpar.fit(model, arrays(), steps=3, **SGD)
    assert trained.result.config["model"]["model"] == "TinyNet"
    eq.assert_tree_close(before, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tol=0.0,
                         what="the caller's instance")


def test_checkpoints_resume_and_events_work_as_from_the_command_line(tmp_path):
    data, ckpt, events = arrays(), tmp_path / "ckpt", tmp_path / "events.jsonl"
    options = dict(steps=6, checkpoint_dir=str(ckpt), checkpoint_every=3, **SGD)
    whole = jaxpar.fit(TinyNet, data, events=str(events), **options)
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "end" and "step" in kinds
    shutil.rmtree(ckpt / "6")  # as if the run had stopped after step 3's checkpoint
    resumed = jaxpar.fit(TinyNet, data, resume=True, **options)
    assert resumed.result.metrics["resumed_from_step"] == 3
    eq.assert_tree_close(nnx.to_pure_dict(nnx.state(whole.model, nnx.Param)),
                         nnx.to_pure_dict(nnx.state(resumed.model, nnx.Param)), tol=0.0,
                         what="resumed parameters")


def test_a_diverging_run_stops_and_writes_its_diverged_result(tmp_path):
    with pytest.raises(Diverged) as stop:
        jaxpar.fit(NoLayers, arrays(), steps=5, out=str(tmp_path / "run"), **{**SGD, "lr": 1e38})
    assert stop.value.result.status == "diverged"
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "diverged"


def test_a_registered_model_is_a_choice_of_the_command_line():
    from experiments.__main__ import COMMANDS
    from experiments.cli import build_parser, config_from_args
    from jaxpar.validate import validate

    jaxpar.register_model("tiny-test", TinyNet)
    args = build_parser(COMMANDS).parse_args(["train", "--model", "tiny-test", "--dataset", "synthetic"])
    config = config_from_args(args)
    validate(config)  # the model fits the dataset: 28x28x1 images, 10 classes
    assert jaxpar.train.build_model(config).head.out_features == 10
    with pytest.raises(ValueError, match="built-in"):
        jaxpar.register_model("mlp", TinyNet)


X = np.zeros((8, 28, 28, 1), np.uint8)
Y = np.arange(8) % 2


@pytest.mark.parametrize("train_x, train_y, needle", [
    (X, Y[:7], "8 images but train_y has 7 labels"),
    (X.astype(np.float32), Y, "dtype float32; images must be uint8"),
    (X, Y.astype(np.float32), "labels must be integers"),
    (X, Y - 1, "negative label"),
    (X[:0], Y[:0], "is empty"),
    (X[:, :, :, 0, None, None], Y, "must be [N, H, W, C]"),
])
def test_bad_arrays_are_refused_naming_the_fix_and_nothing_is_written(tmp_path, train_x, train_y, needle):
    with pytest.raises(DataError, match=re.escape(needle)):
        jaxpar.fit(TinyNet, jaxpar.Dataset.from_arrays(train_x, train_y, test_x=X, test_y=Y),
                   out=str(tmp_path / "run"), checkpoint_dir=str(tmp_path / "ckpt"))
    assert list(tmp_path.iterdir()) == []


def test_labels_beyond_num_classes_are_refused():
    with pytest.raises(DataError, match=r"labels must be in \[0, 2\)"):
        jaxpar.Dataset.from_arrays(X, Y, test_x=X, test_y=Y + 1, num_classes=2)


@pytest.mark.parametrize("model, options, needle", [
    (NoLayers, dict(strategy="layer-split"), "needs a method layers()"),
    (TinyNet, dict(strategy="tensor"), "cannot place --model user-model"),
    (lambda *, rngs: TinyNet(num_classes=3, in_features=784, rngs=rngs), {}, "returns logits [B, 5]"),
    (lambda *, rngs: TinyNet(num_classes=5, in_features=99, rngs=rngs), {}, "cannot take --dataset"),
])
def test_a_model_that_cannot_run_is_refused_before_anything_is_written(tmp_path, model, options, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        jaxpar.fit(model, arrays(), name="user-model", out=str(tmp_path / "run"),
                   checkpoint_dir=str(tmp_path / "ckpt"), **options)
    assert list(tmp_path.iterdir()) == []


def test_a_data_parallel_strategy_needs_no_layers():
    assert jaxpar.fit(NoLayers, arrays(), strategy="dp-auto", steps=2, **SGD).result.status == "completed"


def test_an_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown option 'epoch'"):
        jaxpar.fit(TinyNet, arrays(), epoch=3)


def test_mnist_from_a_data_dir_reads_back_through_tfds(tmp_path):
    """MNIST is supported through --data-dir (here: IDX files the test writes; the real ones
    from the URL in README.md); its prepared TFDS copy is also a `Dataset.from_tfds`."""
    from idx_files import write_dataset

    want = write_dataset(tmp_path / "idx")
    cfg = datalib.DataConfig(dataset="mnist", data_dir=str(tmp_path / "idx"),
                             cache_dir=str(tmp_path / "cache"), val_size=0, batch_size=16)
    loaded = datalib.load_splits(cfg, seed=0)  # prepares the TFDS copy, as `train --dataset mnist` does
    data = jaxpar.Dataset.from_tfds("jaxpar_mnist", data_dir=datalib.cache_dir(cfg))
    for split in (loaded.train, loaded.test):
        assert split[0].shape[1:] == (28, 28, 1)
    np.testing.assert_array_equal(data.test[0][..., 0], want["test"][0])
    np.testing.assert_array_equal(data.train[1], loaded.train[1])
    assert data.spec == ((28, 28, 1), int(max(want["train"][1].max(), want["test"][1].max())) + 1)
    with pytest.raises(DataError, match="cannot be read from"):
        jaxpar.Dataset.from_tfds("jaxpar_mnist", data_dir=str(tmp_path / "nothing"))
