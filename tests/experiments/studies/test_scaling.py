"""The scaling study: one bench process per point, a summary table, and a stopped study
resumes where it stopped (complete points are not run again)."""

import dataclasses

from experiments.studies.scaling import study as scaling
from experiments.__main__ import run


def test_quick_scaling_writes_every_point_and_resumes(tmp_path, capsys):
    assert run(["scaling", "--quick", "--out", str(tmp_path)]) == 0
    files = sorted(tmp_path.rglob("result.json"))
    assert len(files) == 3  # single on 1 device, two DP strategies on 2; one round each
    assert all(f.parent.name == "r0" for f in files)
    table = (tmp_path / "summary.md").read_text()
    assert "| strong | mlp | single | 1 |" in table and "dp-shard-map" in table
    capsys.readouterr()
    before = {f: f.stat().st_mtime_ns for f in files}
    assert run(["scaling", "--quick", "--out", str(tmp_path)]) == 0
    assert "3 of 3 points already done" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in files} == before


def test_rounds_go_over_every_point_in_turn_each_round_rotated():
    """Round k of every point before round k + 1 of any, in FOLDER/r<k>, each round starting
    further along the list, so a slow spell falls on other points each round."""
    config = dataclasses.replace(scaling.QUICK, rounds=3, strategies=("dp-pmap", "dp-shard-map", "fsdp"))
    planned = [p.folder for p in scaling.scaling_points(config)]
    assert len(planned) == 12 and len(set(planned)) == 12
    base = [f.removesuffix("/r0") for f in planned[:4]]
    assert base == ["strong/mlp-single-1", "strong/mlp-dp-pmap-2", "strong/mlp-dp-shard-map-2",
                    "strong/mlp-fsdp-2"]
    assert planned[4:8] == [f"{f}/r1" for f in base[1:] + base[:1]]
    assert planned[8:] == [f"{f}/r2" for f in base[2:] + base[:2]]
