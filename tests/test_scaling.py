"""The scaling study: one bench process per point, a summary table, and a stopped study
resumes where it stopped (complete points are not run again)."""

from experiments.__main__ import run


def test_quick_scaling_writes_every_point_and_resumes(tmp_path, capsys):
    assert run(["scaling", "--quick", "--out", str(tmp_path)]) == 0
    files = sorted(tmp_path.rglob("result.json"))
    assert len(files) == 3  # single on 1 device, two DP strategies on 2
    table = (tmp_path / "summary.md").read_text()
    assert "| strong | mlp | single | 1 |" in table and "dp-shard-map" in table
    capsys.readouterr()
    before = {f: f.stat().st_mtime_ns for f in files}
    assert run(["scaling", "--quick", "--out", str(tmp_path)]) == 0
    assert "3 of 3 points already done" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in files} == before
