"""`jaxpar.validate`: every option and combination refused before any work, one paragraph."""

from __future__ import annotations

import pytest

from experiments.__main__ import EXIT_USAGE, run
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES
from jaxpar.validate import validate


def model_for(strategy: str) -> str:
    """A model the strategy takes (the first it lists, else the MLP)."""
    return (STRATEGIES[strategy].models or ("mlp",))[0]


def refused(**options) -> str:
    """The message `validate` gives for these options (fails if it accepts them)."""
    with pytest.raises(ConfigError) as e:
        validate(with_options(TrainConfig(), **options))  # on the 8 devices of conftest.py
    return str(e.value)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("option,value,says", [
    ("lr", float("nan"), "--lr nan"), ("lr", -1.0, "--lr -1.0"), ("lr", float("inf"), "--lr inf"),
    ("accumulate", 0, "--accumulate 0")])
def test_bad_values_are_refused_for_every_strategy(strategy, option, value, says):
    message = refused(strategy=strategy, model=model_for(strategy), **{option: value})
    assert says in message and "Nothing was run or written" in message


@pytest.mark.parametrize("option,value", [
    ("momentum", 1.0), ("momentum", -0.1), ("target_accuracy", 0.0), ("target_accuracy", 1.5),
    ("eval_batch_size", 0), ("batch_size", 0), ("microbatches", 0), ("sync_every", 0),
    ("devices", 0), ("width", 0), ("depth", 0), ("warmup_steps", -1), ("epochs", 0), ("steps", 0),
    ("seed", -1), ("eval_every", 0), ("checkpoint_every", 0), ("val_size", -5)])
def test_each_range_is_checked(option, value):
    assert f"--{option.replace('_', '-')} {value}" in refused(**{option: value})


@pytest.mark.parametrize("options,says", [
    (dict(strategy="single", sync_every=4), "--sync-every 4 applies to --strategy local-sgd"),
    (dict(strategy="dp-auto", microbatches=8), "--microbatches 8 applies to --strategy pipeline"),
    (dict(strategy="single", accumulate=2), "--accumulate 2 applies to --strategy dp-pmap"),
    (dict(optimizer="adam", momentum=0.5), "--momentum applies to --optimizer momentum"),
    (dict(lr_schedule="cosine", warmup_steps=10), "--warmup-steps applies to --lr-schedule"),
    (dict(model="cnn", width=32), "--model cnn does not take --width"),
])
def test_options_that_do_not_apply_are_refused_not_ignored(options, says):
    assert says in refused(**options)


@pytest.mark.parametrize("options,says", [
    (dict(lr_schedule="warmup-cosine", warmup_steps=10, steps=10), "--warmup-steps 10 must be fewer"),
    (dict(target_accuracy=0.9, val_size=0), "--val-size > 0"),
    (dict(resume=True), "--resume needs --checkpoint-dir"),
    (dict(strategy="tensor", model="mlp"), "--strategy tensor cannot place --model mlp"),
    (dict(strategy="pipeline", model="cnn"), "--mesh stage=8 needs at least 8 layers"),
    (dict(strategy="pipeline", model="stack-mlp", devices=2, microbatches=3), "--microbatches 3"),
    (dict(strategy="layer-split", model="cnn", devices=2, stage_boundaries=(5,)), "--stage-boundaries 5"),
    (dict(strategy="hybrid", model="stack-mlp", width=255, mesh="data=2,tensor=2,stage=2"), "--width 255"),
    (dict(strategy="tensor", model="stack-mlp", width=100), "--width 100 is not divisible by tensor=8"),
    (dict(strategy="local-sgd", batch_size=100), "divisible by the 8 replicas"),
    (dict(strategy="single", mesh="data=2"), "runs on one device"),
    (dict(strategy="pipeline", model="stack-mlp", mesh="data=2,stage=4"), "drop data from --mesh"),
    (dict(strategy="dp-auto", mesh="data=3"), "--mesh data=3 needs 3 devices"),
    (dict(strategy="mpi-pipeline", model="resnet"), "does not carry batch-norm statistics"),
    (dict(strategy="mpi-pipeline", model="cnn", batch_norm=True), "no --batch-norm"),
])
def test_combinations_are_checked_once(options, says):
    assert says in refused(**options)


def test_every_problem_in_one_paragraph():
    message = refused(lr=-1.0, accumulate=0)
    assert "--lr -1.0" in message and "--accumulate 0" in message and "\n" not in message


@pytest.mark.parametrize("options", [
    dict(), dict(strategy="tensor", model="stack-mlp", mesh="data=4,tensor=2"),
    dict(strategy="pipeline", model="stack-mlp", devices=2, microbatches=4, schedule="1f1b"),
    dict(strategy="local-sgd", sync_every=4, accumulate=2),
    dict(optimizer="momentum", momentum=0.5, lr_schedule="warmup-cosine", warmup_steps=5, steps=20),
])
def test_valid_configs_pass(options):
    validate(with_options(TrainConfig(), **options))


@pytest.mark.parametrize("argv,says", [
    (["--lr", "nan"], "--lr nan"), (["--lr", "-1"], "--lr -1.0"), (["--accumulate", "0"], "--accumulate 0"),
    (["--strategy", "dp-shard-map", "--accumulate", "0"], "--accumulate 0")])
def test_cli_exits_2_with_one_paragraph_and_writes_nothing(tmp_path, capsys, argv, says):
    out = tmp_path / "out"
    code = run(["train", "--dataset", "synthetic", "--steps", "1", "--no-progress", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_option_values_are_checked_before_processes_join(tmp_path, monkeypatch):
    """A bad value ends a multi-process job before any rank starts jax.distributed: every
    rank fails the same way at once, none mid-start (whose broken connection, when another
    rank ended the job, printed a traceback)."""
    from jaxpar import api
    from jaxpar.runtime import distributed

    def joined(*_):
        raise AssertionError("distributed.setup ran before the options were checked")

    monkeypatch.setattr(distributed, "setup", joined)
    config = with_options(TrainConfig(), dataset="synthetic", steps=1, lr=float("nan"))
    with pytest.raises(ConfigError, match="--lr nan"):
        api.run(config, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
