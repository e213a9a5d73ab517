"""`figures` draws every figure from the committed results alone, names each figure whose
results are absent, and exits 2 writing nothing when there is nothing to draw from; the
batch-size regimes follow the 1.25x band the caption states."""

from __future__ import annotations

import json

from conftest import ROOT
from experiments.publish import sources
from experiments.__main__ import run
from experiments.publish.figures import FIGURES
from experiments.studies.batch_size import scaling_regimes

DATA = ROOT / "figures" / "data"


def test_the_committed_results_draw_every_figure(tmp_path, capsys):
    assert run(["figures", "--data", str(DATA), "--out", str(tmp_path)]) == 0
    # A study whose results are not committed yet (the peers study needs PyTorch) is named.
    absent = [(name, figures) for name, figures in FIGURES if not sources.present(DATA, name)]
    err = capsys.readouterr().err
    for name, figures in absent:
        assert f"not drawn: {', '.join(png for png, _ in figures)} ({sources.missing_line(DATA, name)})" in err
    want = {png for name, figures in FIGURES if sources.present(DATA, name) for png, _ in figures}
    assert {p.name for p in tmp_path.glob("*.png")} == want
    assert all((tmp_path / png).stat().st_size > 10_000 for png in want)


def test_a_missing_data_folder_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "png"
    assert run(["figures", "--data", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no results to draw from" in err and "python -m experiments pipeline --out" in err
    assert not out.exists()


def test_absent_studies_are_named_not_skipped_silently(tmp_path, capsys):
    data = tmp_path / "data" / "hparam"
    data.mkdir(parents=True)
    (data / "hparam.json").write_text((DATA / "hparam" / "hparam.json").read_text())
    assert run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 0
    err = capsys.readouterr().err
    assert "not drawn: pipeline_bubble.png, pipeline_schedule.png" in err
    assert "not drawn: scaling_devices.png, scaling_ranks.png" in err
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["hparam_speedup.png"]


def test_a_damaged_results_file_exits_2_naming_it(tmp_path, capsys):
    data = tmp_path / "data" / "hparam"
    data.mkdir(parents=True)
    (data / "hparam.json").write_text("{")
    assert run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 2
    assert "hparam.json" in capsys.readouterr().err and not (tmp_path / "png").exists()


def test_batch_16_at_1_26x_the_fewest_examples_is_not_perfect_scaling():
    rows = json.loads((DATA / "batch_size" / "result.json").read_text())["metrics"]["rows"]
    rows = [r for r in rows if r["reached"]]
    regimes = scaling_regimes([r["batch_size"] for r in rows], [r["steps"] for r in rows])
    fewest = min(r["examples"] for r in rows)
    for r, regime in zip(rows, regimes):
        if regime == "perfect scaling":
            assert r["examples"] <= 1.25 * fewest, r
    assert rows[0]["batch_size"] == 16 and regimes[0] == "unclassified"
    assert regimes[1:4] == ["perfect scaling"] * 3
