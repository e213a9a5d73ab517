"""Experiment studies: quick modes run and check one real property each."""

import json
import subprocess
import sys


def test_pipeline_bubble_equals_theory(tmp_path):
    from experiments import __main__ as cli

    assert cli.run(["pipeline", "--quick", "--no-measure", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "pipeline.json").read_text())["metrics"]
    for r in data["rows"]:
        assert abs(r["bubble"] - r["theory"]) < 1e-12
    gp = {r["M"]: r["peak_in_flight"] for r in data["rows"] if r["schedule"] == "gpipe"}
    fb = {r["M"]: r["peak_in_flight"] for r in data["rows"] if r["schedule"] == "1f1b"}
    assert all(fb[m] <= gp[m] for m in gp) and fb[max(gp)] < gp[max(gp)]


def test_bad_study_name_lists_choices():
    p = subprocess.run([sys.executable, "-m", "experiments", "nosuch"], capture_output=True, text=True)
    assert p.returncode == 2 and "pipeline" in p.stderr


def test_figures_redraws_pngs_from_results(tmp_path):
    from experiments import __main__ as cli

    assert cli.run(["pipeline", "--quick", "--no-measure", "--out", str(tmp_path / "data" / "pipeline")]) == 0
    assert cli.run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 0
    assert {p.name for p in (tmp_path / "png").glob("*.png")} >= {"pipeline_bubble.png", "pipeline_schedule.png"}

