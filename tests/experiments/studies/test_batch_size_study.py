"""The batch-size study (Shallue et al. 2018) in its quick mode: real properties, not files."""

import json
import subprocess
import sys

from experiments.__main__ import run


def _rows(folder):
    return {r["batch_size"]: r for r in json.loads((folder / "result.json").read_text())["metrics"]["rows"]}


def test_steps_to_target_fall_from_the_smallest_batch_and_reproduce(tmp_path):
    assert run(["batch-size", "--quick", "--out", str(tmp_path / "a")]) == 0
    rows = _rows(tmp_path / "a")
    assert all(r["reached"] for r in rows.values()), rows
    steps = [rows[b]["steps"] for b in sorted(rows)]
    # More data per step: fewer steps to the same validation error, from the smallest batch on.
    assert steps[0] == max(steps) and steps[-1] < steps[0], steps
    for r in rows.values():  # the reported step is the first evaluation at or under the target
        errors = [c["best_error"] for c in r["curve"]]
        assert errors[-1] <= 0.12 < min(errors[:-1], default=1.0)
        assert r["examples"] == r["steps"] * r["batch_size"]
    # Same seed, same numbers: the smallest batch again, on its own, gives the same steps exactly.
    assert run(["batch-size", "--quick", "--batch-sizes", "16", "--out", str(tmp_path / "b")]) == 0
    again = _rows(tmp_path / "b")[16]
    assert again["steps"] == rows[16]["steps"]
    assert again["curve"][-1]["errors"] == rows[16]["curve"][-1]["errors"]


def test_figure_redraws_from_the_results_alone(tmp_path):
    data = tmp_path / "data" / "batch_size"
    assert run(["batch-size", "--quick", "--batch-sizes", "64,128", "--out", str(data)]) == 0
    assert run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "batch_size.png").stat().st_size > 0


def test_bad_batch_size_fails_with_the_rule_and_writes_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments", "batch-size", "--quick", "--batch-sizes", "48",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "powers of two" in p.stderr
    assert not (tmp_path / "x" / "result.json").exists()


def test_regimes_follow_the_whole_curve():
    from experiments.studies.batch_size import scaling_regimes

    bs = [16, 32, 64, 128, 256, 512]
    steps = [1000, 500, 260, 200, 190, 185]  # halves, halves, then flattens
    assert scaling_regimes(bs, steps) == ["perfect scaling"] * 3 + ["diminishing returns"] + \
        ["maximal data parallelism"] * 2
