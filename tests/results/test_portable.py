"""Results name no folder of the machine that wrote them: paths relative to named roots
(jaxpar.results.portable), in results, point files, summaries and orbax's commit marks."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from jaxpar.results import portable
from jaxpar import results
from jaxpar.results import RunResult

# A machine as the rewrite of old results saw it: checkout two folders down, root's home.
ROOTS = portable.make_roots("/w/repo", {
    "/w/repo": "", "/root": "<home>", "/root/.cache/jaxpar": "<cache>", "/tmp": "<tmp>",
    "/opt/torch/.venv": "<venv>", "/usr/share/datasets/fashion-mnist": "<deb:dataset-fashion-mnist>"})


@pytest.mark.parametrize("given,recorded", [
    ("/w/repo/figures/data/x", "figures/data/x"),                      # the working folder
    ("results/run", "results/run"),
    ("/root/.cache/jaxpar/jaxpar_fashion_mnist/1.0.0", "<cache>/jaxpar_fashion_mnist/1.0.0"),
    ("/root/notes", "<home>/notes"),                                   # the longest root wins
    ("../../tmp/m/node-cpu", "<tmp>/m/node-cpu"),                      # climbing out of /w/repo
    ("/opt/torch/.venv/bin/mpiexec", "<venv>/bin/mpiexec"),
    ("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz",
     "<deb:dataset-fashion-mnist>/t10k-images-idx3-ubyte.gz"),
    ("/scratch/data/train.gz", "<outside>/train.gz"),                  # only the name is kept
    ("<tmp>/already", "<tmp>/already"),
])
def test_a_path_is_recorded_relative_to_the_root_that_holds_it(given, recorded):
    assert portable.path(given, ROOTS) == recorded


def test_paths_inside_messages_are_rewritten_and_nothing_else():
    message = ("--ranks 16 needs /opt/torch/.venv/bin/mpiexec: see http://example.org/a/b, "
               "1.5 GB/s over ../../tmp/m, <!-- /report:x -->")
    assert portable.text(message, ROOTS) == (
        "--ranks 16 needs <venv>/bin/mpiexec: see http://example.org/a/b, 1.5 GB/s over <tmp>/m, "
        "<!-- /report:x -->")


def test_a_recorded_path_resolves_to_this_machines_folder_and_outside_is_refused():
    here = portable.here()
    inside = os.path.join(tempfile.gettempdir(), "jaxpar-point", "r0")
    assert portable.resolve(portable.path(inside, here), here) == inside
    assert portable.resolve("figures/data", here) == "figures/data"
    with pytest.raises(ValueError, match="outside the roots"):
        portable.resolve("<outside>/train.gz", here)


def test_a_result_file_names_no_folder_of_the_machine(tmp_path):
    mpiexec = os.path.join(os.sys.prefix, "bin", "mpiexec")
    result = RunResult(kind="bench", config={"out": str(tmp_path / "run"), "seed": 0},
                       env={"xla_flags": f"--xla_dump_to={tmp_path}/dump"},
                       metrics={"step_ms": 1.25, "note": f"no {mpiexec}", "files": [str(tmp_path)]})
    text = results.save(result, tmp_path / "run").read_text()
    assert str(tmp_path) not in text and os.sys.prefix not in text
    written = json.loads(text)
    assert written["config"]["out"] == portable.path(tmp_path / "run")
    assert written["config"]["out"].startswith("<tmp>/")  # pytest's folders are temporary ones
    assert written["metrics"]["note"] == f"no {portable.path(mpiexec)}"
    assert written["metrics"]["note"].endswith(">/bin/mpiexec")  # <venv> (or <python>)
    assert written["metrics"]["step_ms"] == 1.25 and written["config"]["seed"] == 0
    assert result.config["out"] == str(tmp_path / "run")  # the caller's result is unchanged


def test_a_summary_is_written_with_its_paths_relative(tmp_path):
    path = results.write_summary(tmp_path / "summary.md", f"| a | {tmp_path}/x |\n")
    assert path.read_text() == f"| a | {portable.path(tmp_path)}/x |\n"


def test_orbax_commit_marks_name_their_folder_relative(tmp_path):
    from jaxpar import checkpoint

    step = tmp_path / "ckpt" / "12" / "meta"
    step.mkdir(parents=True)
    mark = step / checkpoint.COMMIT_MARK
    mark.write_text(f"Checkpoint commit was successful to {step}")
    checkpoint.portable_marks(tmp_path / "ckpt")
    assert mark.read_text() == f"Checkpoint commit was successful to {portable.path(step)}"
    assert str(tmp_path) not in mark.read_text()


def test_a_saved_checkpoint_names_no_folder_of_the_machine(tmp_path):
    from jaxpar import checkpoint
    from jaxpar.config import TrainConfig, with_options
    from jaxpar.train import fit

    fit(with_options(TrainConfig(), dataset="synthetic", synthetic_size=200, val_size=0,
                     batch_size=40, model="mlp", width=16, depth=1, steps=5, progress=False,
                     checkpoint_dir=str(tmp_path / "ckpt")))
    marks = sorted((tmp_path / "ckpt").rglob(checkpoint.COMMIT_MARK))
    assert len(marks) == 3  # the step's, its meta's and its state's
    assert all(str(tmp_path) not in m.read_text() and "<tmp>/" in m.read_text() for m in marks)
    assert checkpoint.load_checkpoint(str(tmp_path / "ckpt"))[1]["step"] == 5  # orbax reads it as before
