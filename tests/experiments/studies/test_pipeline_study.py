"""The pipeline study in its quick mode: schedule bubble equals theory, measured points exist,
1F1B holds fewer micro-batches than GPipe, GEMS idles less than both at no more micro-batches
in flight but holds twice the parameters, and the figures redraw from the JSON alone."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest

from experiments.__main__ import run
from experiments.studies.pipeline.study import PipelineConfig, point_on_ranks, rows_on_ranks


def test_quick_study_measures_points_and_matches_theory(tmp_path):
    out = tmp_path / "data" / "pipeline"
    assert run(["pipeline", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "pipeline.json").read_text())
    assert result["config"]["stages"] == 2 and "cpu_cores" in result["env"]
    rows, S = result["metrics"]["rows"], result["metrics"]["stages"]
    for r in rows:  # fill-drain and 1F1B idle the same share of slots: GPipe's formula
        if r["schedule"] in ("gpipe", "1f1b"):
            assert abs(r["bubble"] - (S - 1) / (r["M"] + S - 1)) < 1e-12, r
    for name in ("interleaved-1f1b", "zb-h1", "zbv"):  # every schedule, from its own lists
        top = max(r["M"] for r in rows if r["schedule"] == name)
        assert 0 < {(r["schedule"], r["M"]): r for r in rows}[name, top]["bubble"] < (S - 1) / (top + S - 1)
    by = {(r["schedule"], r["M"]): r for r in rows}
    for r in rows:  # two replicas in opposite directions fill each other's bubble
        if r["schedule"] == "gems":
            assert r["bubble"] < by["gpipe", r["M"]]["bubble"] and r["peak_in_flight"] <= S, r
    measured = [r for r in rows if r["images_per_sec"] is not None]
    assert {r["schedule"] for r in measured} == {"gpipe", "1f1b", "gems", "interleaved-1f1b", "looped-bfs",
                                                 "zb-h1", "zbv", "dualpipev"}
    top_m = max(r["M"] for r in measured)
    assert by["gems", top_m]["state_bytes"] > by["1f1b", top_m]["state_bytes"]  # two stages a device
    for r in measured:
        assert r["images_per_sec"] > 0 and r["step_ms"] > 0 and r["temp_bytes"] > 0, r
        assert (out / r["point"] / "r0" / "result.json").exists()  # the quick mode: one round
        assert r["step_ms_rounds"] == [r["step_ms"]]
    single = result["metrics"]["single"]  # the reference: one device, the same batch
    assert single["images_per_sec"] > 0 and (out / single["point"] / "r0" / "result.json").exists()
    assert json.loads((out / single["point"] / "r0" / "result.json").read_text())["config"]["parallel"]["strategy"] == "single"
    peak = {(r["schedule"], r["M"]): r["peak_in_flight"] for r in rows}
    top = max(r["M"] for r in rows)
    assert all(peak["1f1b", m] <= peak["gpipe", m] for s, m in peak if s == "gpipe")
    assert peak["1f1b", top] == S < peak["gpipe", top] == top
    # the measured timelines: every micro-batch's forward and backward on each stage, stamped
    # by the devices (start before end), and an idle share beside the schedule's bubble
    timelines = result["metrics"]["timelines"]
    (M,) = result["config"]["timeline_microbatches"]
    assert set(timelines) == {f"{name}, M={M}" for name in ("gpipe", "1f1b", "gems", "interleaved-1f1b",
                                                            "looped-bfs", "zb-h1", "zbv", "dualpipev")}
    for key, tl in timelines.items():
        name = key.split(",")[0]
        work = [e for e in tl["events"] if e["kind"] in ("F", "B", "F+B", "I", "W", "F+I")]
        last = max(e["stage"] for e in work)
        assert sorted(e["microbatch"] for e in work if e["stage"] == last and e["kind"][0] == "F") == list(range(M)), key
        assert all(0 <= e["start_ms"] <= e["end_ms"] for e in work), key
        assert 0 <= tl["idle_fraction"] < 1, key
        # the walked step's bubble beside its table's, both from the actions' times alone
        assert 0 <= tl["bubble_timed"] < 1 and tl["bubble_measured"] < 1 and tl["walk_ms"] > 0, key
        assert set(tl["action_ms"]) >= {f"F{s}" for s in range(last + 1)}, key
        if name in ("gpipe", "1f1b", "gems"):
            assert tl["bubble_fraction"] == by[name, M]["bubble"], key
        if name in ("zb-h1", "zbv"):  # the split backward: its input and weight gradients stamped apart
            assert {"I", "W"} <= {e["kind"] for e in work}, key

    # Resumed: the points are read back, not measured again.
    assert run(["pipeline", "--quick", "--out", str(out)]) == 0
    again = json.loads((out / "pipeline.json").read_text())["metrics"]["rows"]
    assert [r["images_per_sec"] for r in again] == [r["images_per_sec"] for r in rows]

    # Figures from pipeline.json alone (no point folders).
    alone = tmp_path / "alone" / "pipeline"
    alone.mkdir(parents=True)
    shutil.copy(out / "pipeline.json", alone)
    assert run(["figures", "--data", str(tmp_path / "alone"), "--out", str(tmp_path / "png")]) == 0
    for name in ("pipeline_bubble.png", "pipeline_schedule.png"):
        assert (tmp_path / "png" / name).stat().st_size > 0


def test_bad_options_exit_2_with_the_fix(tmp_path, capsys):
    assert run(["pipeline", "--stages", "12", "--depth", "8", "--out", str(tmp_path)]) == 2
    assert "needs at least 12 layers" in capsys.readouterr().err
    assert run(["pipeline", "--batch-size", "100", "--out", str(tmp_path)]) == 2
    assert "multiple of the largest" in capsys.readouterr().err
    assert not (tmp_path / "pipeline.json").exists()
    assert run(["pipeline", "--ranks", "1", "--out", str(tmp_path)]) == 2
    assert "--ranks must be 0 (no rank points) or >= 2" in capsys.readouterr().err
    assert run(["pipeline", "--rank-batch-size", "100", "--out", str(tmp_path)]) == 2
    assert "--rank-batch-size 100 must be a multiple of the largest --rank-microbatches 8" in capsys.readouterr().err
    assert not (tmp_path / "pipeline.json").exists()


def test_a_schedules_gain_across_ranks_is_the_median_of_its_rounds_ratios():
    """Rounds drift together (the machine's speed changes over minutes): the gain is read
    within each round, then the median taken; the row's step is the median round's."""
    config = dataclasses.replace(PipelineConfig(), ranks=2, rank_microbatches=(4,))
    planned = {(s, 4): point_on_ranks(config, s, 4) for s in ("1f1b", "zb-h1")}
    steps = {"1f1b": [10.0, 20.0, 30.0], "zb-h1": [9.0, 19.0, 27.0]}  # a slow round between two fast
    # each round's timeline: the idle time stamped within the step, and its table replayed
    idle = {"1f1b": [(3.0, 2.5), (4.0, 3.0), (5.0, 3.5)], "zb-h1": [(1.0, 1.0)] * 3}
    by_folder = {planned[s, 4].folder: [SimpleNamespace(metrics={
        "step_time_ms_median": t, "p2p_waited_ms": [t / 10, t / 5],
        "timeline": {"idle_ms": lived, "idle_ms_timed": replayed, "bubble_timed": 0.1, "latency_ms": 0.03,
                     "action_ms": {"F0": 1.0}}}) for t, (lived, replayed) in zip(ts, idle[s])]
                 for s, ts in steps.items()}
    rows = {r["schedule"]: r for r in rows_on_ranks(config, planned, by_folder)}
    assert rows["zb-h1"]["to_1f1b"] == 0.9 and rows["1f1b"]["to_1f1b"] == 1.0  # not 19/20
    assert rows["zb-h1"]["step_ms"] == 19.0 and rows["zb-h1"]["step_ms_rounds"] == steps["zb-h1"]
    assert rows["zb-h1"]["bubble"] < rows["1f1b"]["bubble"] == pytest.approx(0.2)
    # the idle time: the median over rounds, stamped and replayed; each rank's wait the median round's
    assert rows["1f1b"]["idle_ms"] == 4.0 and rows["1f1b"]["idle_ms_replayed"] == 3.0
    assert rows["1f1b"]["waited_ms_by_rank"] == [2.0, 4.0] and rows["1f1b"]["latency_ms"] == 0.03
    point = planned["zb-h1", 4]
    assert point.ranks == 2 and point.config.parallel.single_thread and point.config.parallel.devices == 1
    assert point.bench.timeline  # each timed step stamped in its programs
