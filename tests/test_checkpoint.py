"""Checkpoints (`jaxpar/checkpoint.py`) lose nothing, move between meshes, refuse bad input.

Kill -9 and resume is bitwise the uninterrupted run, a checkpoint moves between meshes and
strategies, damaged steps are skipped, bad --resume input is refused.

    python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import equivalence as eq
from conftest import ROOT, requires_devices, run_cli
from jaxpar import checkpoint as ckptlib
from jaxpar.config import TrainConfig, with_options
from jaxpar.mesh import STAGE
from jaxpar.parallel import STRATEGIES
from jaxpar.train import fit

# 125 steps per epoch: checkpoints every 60 steps fall mid-epoch.
TINY = ["--dataset", "synthetic", "--synthetic-size", "2000", "--val-size", "0", "--batch-size", "16",
        "--model", "mlp", "--width", "32", "--depth", "1", "--no-progress"]
LONG_STEPS = 500  # long enough that a poll every 20 ms finds the run mid-way


def tiny(directory, **kw) -> TrainConfig:
    base = dict(dataset="synthetic", synthetic_size=600, val_size=100, batch_size=40, model="mlp",
                width=32, depth=1, steps=30, progress=False, checkpoint_dir=str(directory))
    return with_options(TrainConfig(), **{**base, **kw})


def present(*names):
    """pytest params for `names`, skipping strategies not merged into this branch yet."""
    return [pytest.param(n, marks=pytest.mark.skipif(
        n not in STRATEGIES, reason=f"strategy {n!r} not in STRATEGIES on this branch yet"))
        for n in names]


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def complete_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / "meta").is_dir())


def cli_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "experiments", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_after_first_checkpoint(proc: subprocess.Popen, directory: Path, sig: int,
                                timeout: float = 120) -> str:
    """Send `sig` once a complete checkpoint exists; the process's stderr."""
    deadline = time.monotonic() + timeout
    while not complete_steps(directory):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no checkpoint appeared (rc {proc.returncode}): {proc.communicate()[1][-2000:]}")
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return err


# fsdp's sharded state and a pipeline's stages: the layouts a resume can get wrong (single's and
# a replicated data-parallel state resume through the same code, tested beside).
@pytest.mark.parametrize("strategy", present("fsdp", "pipeline"))
def test_sigkill_mid_epoch_then_resume_is_bitwise_the_uninterrupted_run(tmp_path, strategy):
    extra = [] if strategy == "single" else ["--devices", "2"]
    if strategy == "pipeline":
        extra = ["--devices", "2", "--model", "stack-mlp", "--depth", "2"]
    args = [*TINY, "--strategy", strategy, *extra, "--steps", str(LONG_STEPS),
            "--checkpoint-every", "60", "--out", str(tmp_path / "out")]
    full, killed = tmp_path / "full", tmp_path / "killed"
    rc = run_cli("train", *args, "--checkpoint-dir", str(full))
    assert rc.returncode == 0, rc.stderr[-2000:]

    proc = cli_process(*args, "--checkpoint-dir", str(killed))
    stop_after_first_checkpoint(proc, killed, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed"
    stopped_at = complete_steps(killed)[-1]
    assert stopped_at < LONG_STEPS

    rc = run_cli("train", *args, "--checkpoint-dir", str(killed), "--resume")
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert "resumed from step" in rc.stdout
    want, want_meta = ckptlib.load_checkpoint(str(full))
    got, got_meta = ckptlib.load_checkpoint(str(killed))
    assert got_meta["step"] == want_meta["step"] == LONG_STEPS
    assert_same_state(want, got)  # params, optimizer state and step, bitwise


@pytest.mark.parametrize("strategy", present("single", "dp-pmap", "dp-shard-map", "dp-auto", "fsdp",
                                             "local-sgd", "tensor", "layer-split", "pipeline", "gems", "hybrid"))
@requires_devices(8)
def test_checkpoint_from_8_devices_restores_on_2_and_on_single(tmp_path, strategy):
    """Saved from a mesh over 8 devices, restored over 2 and under `single`: the same state."""
    from jaxpar.optim import make_optimizer
    from jaxpar.train import build_model, make_strategy

    # strategies that take only some models (split blocks), or put a stage on each of the 8
    # devices (a stage needs a layer), take the stack-mlp with 8 blocks
    staged = STRATEGIES[strategy].default_axes.get(STAGE) == -1
    model = dict(model="stack-mlp", depth=8) if STRATEGIES[strategy].models or staged else {}
    if strategy == "hybrid":
        model["microbatches"] = 2  # 40 rows over data=4 shards
    cfg = tiny(tmp_path, strategy=strategy, **model)
    out = fit(cfg)  # 8 devices (conftest), ends with a checkpoint at step 30
    saved, _ = ckptlib.load_checkpoint(str(tmp_path))
    assert_same_state(ckptlib.flatten(out.strategy.state_to_reference(out.state)), saved)

    for devices, name in ((2, strategy), (1, "single")):
        c = with_options(cfg, strategy=name, resume=True)
        strategy_obj = make_strategy(c)
        mesh = strategy_obj.make_mesh(jax.devices()[:devices])
        state = strategy_obj.init(build_model(c), make_optimizer(c.optim, 30), mesh)
        checkpointer = ckptlib.Checkpointer(c)
        ref, meta = checkpointer.restore(strategy_obj.state_to_reference(state))
        checkpointer.close()
        placed = strategy_obj.state_from_reference(ref)
        assert meta["step"] == 30
        assert_same_state(saved, ckptlib.flatten(strategy_obj.state_to_reference(placed)))


@pytest.mark.skipif(not {"dp-shard-map", "fsdp"} <= set(STRATEGIES), reason="needs dp-shard-map and fsdp")
def test_cli_checkpoint_from_8_devices_resumes_on_2_under_another_strategy(tmp_path):
    sgd = [*TINY, "--optimizer", "sgd", "--lr-schedule", "constant", "--lr", "0.05", "--steps", "40",
           "--checkpoint-every", "20"]
    ck, ref = tmp_path / "ck", tmp_path / "ref"
    rc = run_cli("train", *sgd, "--strategy", "dp-shard-map", "--devices", "8",
                 "--checkpoint-dir", str(ck), "--out", str(tmp_path / "a"))
    assert rc.returncode == 0, rc.stderr[-2000:]
    shutil.rmtree(ck / "40")  # as if stopped at step 20
    rc = run_cli("train", *sgd, "--strategy", "fsdp", "--devices", "2", "--checkpoint-dir", str(ck),
                 "--resume", "--out", str(tmp_path / "a"))
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert "resumed from step 20" in rc.stdout
    rc = run_cli("train", *sgd, "--checkpoint-dir", str(ref), "--out", str(tmp_path / "b"))
    assert rc.returncode == 0, rc.stderr[-2000:]
    (got, _), (want, _) = ckptlib.load_checkpoint(str(ck)), ckptlib.load_checkpoint(str(ref))
    eq.assert_tree_close(want, got)  # another mesh and reduction order: close, not bitwise


def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path):
    cfg = tiny(tmp_path, checkpoint_every=10)
    fit(cfg)
    assert complete_steps(tmp_path) == [10, 20, 30]
    want, _ = ckptlib.load_checkpoint(str(tmp_path), 30)
    for f in (tmp_path / "30" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # truncated, as by a lost disk
    with pytest.warns(UserWarning, match=r"checkpoint .*/30 is damaged"):
        out = fit(with_options(cfg, resume=True))
    assert out.result.metrics["resumed_from_step"] == 20
    got, _ = ckptlib.load_checkpoint(str(tmp_path), 30)  # re-written from step 20: the same numbers
    assert_same_state(want, got)


def test_resumed_result_records_where_it_resumed(tmp_path):
    full = fit(tiny(tmp_path / "a", checkpoint_every=10, eval_every=10))
    fit(tiny(tmp_path / "b", checkpoint_every=10, eval_every=10, steps=30))
    shutil.rmtree(tmp_path / "b" / "30")
    resumed = fit(tiny(tmp_path / "b", checkpoint_every=10, eval_every=10, resume=True))
    assert resumed.result.metrics["resumed_from_step"] == 20
    assert full.result.metrics["resumed_from_step"] is None
    assert [h["step"] for h in resumed.result.history] == [10, 20, 30]
    assert [h["val_loss"] for h in resumed.result.history] == [h["val_loss"] for h in full.result.history]
    assert resumed.result.metrics["final_loss"] == full.result.metrics["final_loss"]


def test_sigterm_saves_and_says_how_to_resume(tmp_path):
    directory = tmp_path / "c"
    proc = cli_process(*TINY, "--steps", str(LONG_STEPS), "--checkpoint-every", "100",
                       "--out", str(tmp_path / "out"), "--checkpoint-dir", str(directory))
    err = stop_after_first_checkpoint(proc, directory, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM: saved checkpoint" in err and "--resume" in err
    step = complete_steps(directory)[-1]
    _, meta = ckptlib.load_checkpoint(str(directory))
    assert meta["step"] == step


def test_bad_resume_inputs_are_refused_and_nothing_is_written(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ckptlib.CheckpointError, match="is empty; drop --resume"):
        fit(tiny(empty, resume=True))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ckptlib.CheckpointError, match="holds no jaxpar checkpoint"):
        fit(tiny(foreign, resume=True))
    with pytest.raises(ckptlib.CheckpointError, match="is not empty"):
        fit(tiny(foreign))  # without --resume a used folder is never written into
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert list(empty.iterdir()) == []

    run = tmp_path / "run"
    fit(tiny(run, steps=10))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(ckptlib.CheckpointError, match=r"--width 32 \(now 64\)"):
        fit(tiny(run, steps=10, width=64, resume=True))
    with pytest.raises(ckptlib.CheckpointError, match=r"--optimizer"):
        fit(tiny(run, steps=10, optimizer="sgd", resume=True))
    with pytest.raises(ckptlib.CheckpointError, match=r"--steps 10 \(now 20\)"):
        fit(tiny(run, steps=20, resume=True))  # the LR schedule spans the run's length
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    rc = run_cli("train", *TINY, "--steps", "10", "--resume", "--out", str(tmp_path / "o"))
    assert rc.returncode == 2 and "--resume needs --checkpoint-dir" in rc.stderr



def test_resume_auto_starts_then_continues_and_refuses_another_run(tmp_path):
    """--resume auto: one command for a job that may be requeued. It starts where there is
    nothing to resume (no folder; only a first save a kill interrupted), continues where
    there is a checkpoint (ending where the uninterrupted run ends), and still refuses a
    checkpoint of a different run, or a folder holding something else."""
    full = fit(tiny(tmp_path / "full", checkpoint_every=10, eval_every=10))
    auto = tiny(tmp_path / "auto", checkpoint_every=10, eval_every=10, resume="auto")
    assert fit(with_options(auto, steps=30)).result.metrics["resumed_from_step"] is None
    shutil.rmtree(tmp_path / "auto" / "30")  # as if the job died after step 20's checkpoint
    resumed = fit(auto)
    assert resumed.result.metrics["resumed_from_step"] == 20
    assert resumed.result.metrics["final_loss"] == full.result.metrics["final_loss"]
    assert_same_state(ckptlib.load_checkpoint(str(tmp_path / "full"))[0], ckptlib.load_checkpoint(str(tmp_path / "auto"))[0])

    with pytest.raises(ckptlib.CheckpointError, match=r"--width 32 \(now 64\)"):
        fit(with_options(auto, width=64))
    interrupted = tmp_path / "interrupted"  # killed during its first save
    (interrupted / f"10{ckptlib.TMP_MARK}-123").mkdir(parents=True)
    assert fit(tiny(interrupted, steps=10, resume="auto")).result.metrics["resumed_from_step"] is None
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ckptlib.CheckpointError, match="is not empty"):
        fit(tiny(foreign, resume="auto"))
    with pytest.raises(ValueError, match="--resume, --no-resume or --resume auto"):
        fit(tiny(foreign, resume="yes"))


def test_resume_auto_on_the_command_line(capsys):
    from experiments.__main__ import COMMANDS
    from experiments.cli import build_parser, config_from_args

    def resume(*flags):
        return config_from_args(build_parser(COMMANDS).parse_args(["train", *flags])).resume

    assert (resume("--resume", "auto"), resume("--resume"), resume("--no-resume"), resume()) == \
        ("auto", True, False, False)
    for bad, says in ((["--resume", "always"], "--resume takes no value or one of: auto"),
                      (["--no-resume", "auto"], "--no-resume takes no value")):
        with pytest.raises(SystemExit) as exit_:
            resume(*bad)
        assert exit_.value.code == 2 and says in capsys.readouterr().err
