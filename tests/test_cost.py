"""The cost model: a profile from a quick run, predictions whose parts add up and follow the
strategies' formulas, `plan` refusing what does not fit, every strategy stating its cost, and
the committed error table listing every committed point."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics

import pytest

from conftest import ROOT, run_cli
from experiments.cost import check as cost_check
from experiments.cost import pricing as predictlib
from experiments.__main__ import run
from experiments.publish.tables import TABLES
from jaxpar import cost, results
from jaxpar.cost import Problem
from jaxpar.parallel.pipeline.cost import stage_layers
from jaxpar.parallel import STRATEGIES

DATA = ROOT / "figures" / "data"
PROFILE = cost.load_profile(DATA / "cost" / "profile.json")
STACK = "stack-mlp-d8-w256"  # profiled: every strategy takes it


def test_a_quick_profile_measures_steps_layers_and_collectives(tmp_path):
    done = run_cli("profile", "--quick", "--no-mpi", "--out", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["kind"] == "profile" and saved["env"]["cpu_cores"] >= 1
    m = saved["metrics"]
    (entry,) = m["models"].values()
    assert len(entry["steps"]["batch"]) == len(entry["steps"]["step_ms"]) >= 2
    assert all(t > 0 for t in entry["steps"]["step_ms"]) and entry["update_ms"] > 0
    assert [layer["name"] for layer in entry["layers"]] == ["hidden0", "hidden1", "out"]
    assert all(layer["flops_per_example"] > 0 and layer["ms"] for layer in entry["layers"])
    for op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
        for n in ("2", "4", "8"):
            fit = m["collectives"][op][n]
            assert fit["bytes_per_s"] > 0 and fit["latency_s"] >= 0 and len(fit["points"]) == 2
    assert m["matmul_peak_gflops"] > 0 and set(m["kinds"]) == {"dense"} and m["dispatch_us"] > 0
    assert m["mpi"] == {} and m["mpi_note"] == "not asked"


@pytest.mark.parametrize("strategy,devices,link", [
    ("single", 1, "measured"), ("dp-shard-map", 4, "measured"), ("fsdp", 8, "measured"),
    ("tensor", 4, "measured"), ("layer-split", 4, "measured"), ("pipeline", 4, "measured"),
    ("mpi-allreduce", 2, "measured"), ("pipeline", 8, "10gbit"), ("fsdp", 64, "nvlink"),
])
def test_a_prediction_is_the_sum_of_its_parts(strategy, devices, link):
    device = predictlib.PROFILED if link == "measured" else "h100"
    p = predictlib.predict_one(PROFILE, STACK, strategy, devices, 512, device, link)
    assert p.total_s == pytest.approx(p.compute_s + p.comm_s + p.bubble_s)
    assert min(p.compute_s, p.comm_s, p.bubble_s) >= 0 and p.compute_s > 0
    assert (p.comm_s > 0) == (strategy != "single")
    assert p.images_per_s == pytest.approx(512 / p.total_s)
    assert p.memory_bytes == p.state_bytes + p.activation_bytes > 0


def test_simulated_devices_add_their_work_and_dedicated_ones_do_not():
    compute = predictlib.compute_source(PROFILE)(STACK)
    shared = predictlib.predict_one(PROFILE, STACK, "dp-shard-map", 4, 256)
    assert shared.compute_s == pytest.approx(4 * compute.step_s(64))
    work = STRATEGIES["dp-shard-map"].cost(predictlib.problem(STACK, "dp-shard-map", {"data": 4}, 256, compute))
    dedicated = cost.predict(work, cost.cluster(lambda k, t: compute, cost.LINKS["10gbit"], None, "x"), 256, 4)
    assert dedicated.compute_s == pytest.approx(compute.step_s(64))
    # each gradient array all-reduced: 2 log2(N) latencies and a ring's 2(N-1)/N of its bytes
    link = cost.LINKS["10gbit"]
    arrays = [*compute.leaf_bytes, 12]
    assert len(arrays) == 37
    assert dedicated.comm_s == pytest.approx(sum(4 * link.latency_s + 1.5 * b / link.bytes_per_s for b in arrays))


def test_a_step_is_one_line_through_the_profiles_median_steps():
    steps = PROFILE["models"]["cnn"]["steps"]
    compute = predictlib.compute_source(PROFILE)("cnn")
    at = [compute.step_s(b) * 1000 for b in (8, 100, 300)]
    assert at[1] - at[0] == pytest.approx((at[2] - at[1]) * 92 / 200)   # affine in the batch
    # least squares in relative error through the medians: within the medians' own scatter
    assert statistics.median(abs(compute.step_s(b) * 1000 / m - 1)
                             for b, m in zip(steps["batch"], steps["step_ms_median"])) < 0.25
    line = cost.step_line([8, 16, 32], [2.0, 3.0, 5.0])
    assert line(64) == pytest.approx(9.0)


def test_ranks_beyond_the_cores_stretch_the_critical_path():
    compute = predictlib.compute_source(PROFILE)("cnn")
    ranks = cost.mpi_ranks(PROFILE, lambda key, _: compute)
    work = cost.Work((3.0, 1.0, 1.0, 1.0))          # one rank's extra work (a parameter server's update)
    p = cost.predict(work, ranks, 128, 4)
    assert p.compute_s == pytest.approx(6.0 / 2)    # every rank's work over 2 cores
    assert p.bubble_s == pytest.approx(3.0 * 4 / 2 - 3.0)   # rank 0 runs at 2/4 of a core
    two = cost.predict(cost.Work((3.0, 1.0)), ranks, 128, 2)
    assert two.compute_s + two.bubble_s == pytest.approx(3.0)   # a core each: no stretch


def test_a_pipeline_on_dedicated_devices_pays_the_schedules_bubble():
    compute = predictlib.compute_source(PROFILE)(STACK)
    for m in (1, 4, 16):
        problem = Problem(compute, {"stage": 4}, 512, microbatches=m, model={"model": "stack-mlp"})
        work = STRATEGIES["pipeline"].cost(problem)
        p = cost.predict(work, cost.cluster(lambda k, t: compute, cost.LINKS["nvlink"], None, "x"), 512, 4)
        slowest = max(work.stage_s)
        # fill and drain: one micro-batch of every other stage; S - 1 slots of equal stages
        assert p.bubble_s == pytest.approx(sum(work.stage_s) - slowest)
        equal = dataclasses.replace(work, stage_s=(slowest,) * 4)
        e = cost.predict(equal, cost.cluster(lambda k, t: compute, cost.LINKS["nvlink"], None, "x"), 512, 4)
        assert e.bubble_s / (e.bubble_s + e.compute_s - max(work.device_s)) == pytest.approx(3 / (m + 3))


@pytest.mark.parametrize("devices", [2, 4])
def test_a_conv_models_pipeline_runs_its_stages_side_by_side_an_mlps_adds_them_up(devices):
    dispatch, cores = PROFILE["dispatch_us"] / 1e6, PROFILE["cores"]
    one = predictlib.compute_source(PROFILE)("cnn", True)
    work = STRATEGIES["pipeline"].cost(predictlib.problem("cnn", "pipeline", {"stage": devices}, 128, one,
                                                          microbatches=8, implementation="mpmd"))
    side = predictlib.predict_one(PROFILE, "cnn", "pipeline", devices, 128, microbatches=8)
    # a core each at one-thread speed: the stages' summed work over the cores, or the critical
    # path (M slots of the slowest stage, the fill and drain, the update) where that is longer
    total = 8 * sum(work.stage_s) + sum(work.device_s)
    critical = 7 * max(work.stage_s) + sum(work.stage_s) + max(work.device_s)
    assert side.compute_s + side.bubble_s == pytest.approx(max(total / cores, critical) + work.programs * dispatch)
    assert any("side by side" in note for note in side.notes)
    every = predictlib.compute_source(PROFILE)(STACK)
    work = STRATEGIES["pipeline"].cost(predictlib.problem(STACK, "pipeline", {"stage": devices}, 128, every,
                                                          microbatches=8, implementation="mpmd"))
    added = predictlib.predict_one(PROFILE, STACK, "pipeline", devices, 128, microbatches=8)
    assert added.compute_s == pytest.approx(8 * sum(work.stage_s) + sum(work.device_s) + work.programs * dispatch)
    # and the committed points: the bounds study's CNN pipelines are priced side by side
    result = json.loads((DATA / "bounds/points/2/pipeline-gpipe/r0/result.json").read_text())
    pred, _ = cost_check.predict_point(PROFILE, result["config"], result["env"], result["strategy"])
    assert any("side by side" in note for note in pred.notes)


def test_a_pipelines_sends_over_a_link_overlap_its_stages_and_go_one_way():
    compute = predictlib.compute_source(PROFILE)("cnn", True)
    work = STRATEGIES["pipeline"].cost(predictlib.problem("cnn", "pipeline", {"stage": 2}, 128, compute,
                                                          microbatches=8, implementation="mpmd"))
    (send,) = [c for c in work.collectives if c.op == "send"]
    assert send.count == 2 * 8   # each micro-batch's activations one way, their gradient back
    stages, update = sum(work.stage_s), max(work.device_s)
    for rate in (1e6, 1e12):     # bytes/s
        link = cost.Link("x", rate, 0.0, "")
        seconds = functools.partial(cost.link_seconds, link)
        hop = send.bytes / rate  # one message, one way
        on_wire = cost.predict(work, cost.Machine("x", lambda k, t: compute, seconds, 2, None, wire_s=seconds), 128, 2)
        if rate == 1e6:          # the link sets the pace: M messages a direction, and the fill and drain
            assert on_wire.total_s == pytest.approx(8 * hop + stages + hop + update)
        else:                    # a fast link adds its fill and drain only: one message each way
            assert on_wire.comm_s == pytest.approx(2 * hop)
        assert on_wire.wire_s == pytest.approx(on_wire.comm_s)
        one_host = cost.predict(work, cost.Machine("x", lambda k, t: compute, seconds, 2, None), 128, 2)
        assert one_host.comm_s == pytest.approx(16 * hop)   # no wire of its own: not overlapped
    # across 2 emulated hosts the profile's swap took twice the bytes' time: a send is half of it
    fits = PROFILE["links"]["100mbit"]["distributed"]
    half = cost.fitted_collectives(fits, send_share=0.5)(cost.Collective("send", 5e5, 2))
    assert half == pytest.approx(cost.fitted_seconds(fits, "collective-permute", 2, 5e5) / 2)


def test_every_strategy_states_its_cost():
    compute = predictlib.compute_source(PROFILE)(STACK)
    for name, cls in STRATEGIES.items():
        axes = {"data": 2, "tensor": 2, "stage": 2} if name == "hybrid" else predictlib.mesh_axes(name, 4)[0]
        work = cls.cost(predictlib.problem(STACK, name, axes, 128, compute))
        assert work.device_s and work.state_bytes > 0, name


def test_plan_ranks_every_strategy_and_refuses_what_does_not_fit(capsys):
    # stack-mlp d4 w1024: ~0.4 GB of state with Adam; 0.2 GB per device fits only when sharded
    args = ["plan", "--model", "stack-mlp", "--depth", "4", "--width", "1024", "--devices", "8",
            "--memory", "200MB", "--device", "h100", "--link", "100gbit"]
    assert run(args) == 0
    out = capsys.readouterr().out
    rows = predictlib.plan_rows(PROFILE, "stack-mlp-d4-w1024", 8, 128, "h100", "100gbit", 200e6)
    fits = {r["strategy"] for r in rows if r["fits"]}
    refused = {r["strategy"] for r in rows if not r["fits"]}
    assert {"single", "dp-shard-map", "local-sgd"} <= refused and "fsdp" in fits
    assert all(r["prediction"].memory_bytes > 200e6 for r in rows if not r["fits"])
    assert not any(rows[i]["fits"] < rows[i + 1]["fits"] for i in range(len(rows) - 1))  # fitting first
    # printed: each strategy and mesh once, at its best micro-batches and schedule
    assert out.count("does not fit") == len({(r["strategy"], r["mesh"]) for r in rows if not r["fits"]})


def test_predict_prints_the_parts(capsys):
    assert run(["predict", "--model", "cnn", "--strategy", "pipeline", "--devices", "64", "--link", "10gbit"]) == 0
    out = capsys.readouterr().out
    assert "compute" in out and "communication" in out and "bubble" in out and "4 stages" in out


def test_the_error_table_lists_every_committed_point():
    rows = cost_check.check_rows(DATA)
    table = TABLES["cost-points"](DATA)
    assert len(table.splitlines()) == len(rows) + 2
    covered = [r for r in rows if "error" in r]
    assert covered and all(r["predicted_ms"] > 0 for r in covered)
    for r in covered:
        assert r["error_profile"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
        assert r["error"] == pytest.approx(r["anchored_ms"] / r["measured_ms"] - 1)
        # the machine's part scaled by the day's speed; an emulated link's wire time and a
        # pinned process's host time as they are
        fixed = r["wire_ms"] + r["host_ms"]
        assert r["anchored_ms"] == pytest.approx((r["predicted_ms"] - fixed) * r["scale"] + fixed)
    anchors = [r for r in covered if r["anchor"]]
    assert anchors and all(r["strategy"] == "single" for r in anchors)
    # an anchor is its own measurement, unless its study measured its configuration again
    # (the scaling study's two modes' `single`: anchored on the median of all their rounds)
    alone = [a for a in anchors if sum(cost_check._alike(a, b) for b in anchors) == 1]
    assert alone and all(a["error"] == pytest.approx(0) for a in alone)
    for a in anchors:
        pooled = [x for b in anchors if cost_check._alike(a, b) for x in b["rounds_ms"]]
        assert a["anchored_ms"] == pytest.approx(statistics.median(pooled))
    # one scale per study (and scaling mode) and model: every point of a group shares its anchor's
    for a in anchors:
        group = cost_check._group(a)
        assert {r["scale"] for r in covered if cost_check._group(r) == group} == {a["scale"]}


@pytest.mark.parametrize("args,needle", [
    (["--strategy", "hybrid", "--model", "cnn", "--devices", "8"], "cannot place --model cnn"),
    (["--strategy", "tensor", "--model", "cnn", "--devices", "3"], "divisor of 64"),
    (["--memory", "lots"], "write a size like 16GB"),
    (["--device", "tpu"], "--device one of"),
])
def test_predict_refuses_what_cannot_run_naming_the_fix(args, needle, capsys):
    assert run(["predict", *args]) == 2
    assert needle in capsys.readouterr().err


def test_profile_refuses_a_bad_link_before_any_work(tmp_path, capsys):
    assert run(["profile", "--links", "1gbit,fast", "--out", str(tmp_path)]) == 2
    assert "--links '1gbit,fast': 'fast' is not a bandwidth; give rates like 100mbit" in capsys.readouterr().err
    assert not (tmp_path / "profile.json").exists()


def test_the_bounds_study_is_checked_at_the_median_of_its_rounds_each_device_count_anchored():
    rows = [r for r in cost_check.check_rows(DATA) if r["study"] == "bounds"]
    assert rows and all("error" in r for r in rows)  # every point an mpmd pipeline, tensor or single
    for r in rows:
        rounds = [json.loads(p.read_text())["metrics"]["step_time_ms_median"]
                  for p in sorted((DATA / r["point"]).glob("r*/result.json"))]
        assert len(rounds) > 1 and r["measured_ms"] == pytest.approx(statistics.median(rounds))
        single = next(a for a in rows if a["anchor"] and a["devices"] == r["devices"])
        assert r["scale"] == single["scale"]  # each device count measured with its own single


def test_the_network_studys_points_are_priced_on_their_measured_link():
    """Every network point covered, each collective at what the profile measured across 2
    emulated hosts at the point's bandwidth (`profile --links`), the part beyond one host's
    time the link's; without measured links, one host's plus the bytes at the link's rate."""
    rows = [r for r in cost_check.check_rows(DATA) if r["study"] == "network"]
    assert rows and all("error" in r for r in rows)  # mpi4jax and jax.distributed alike
    assert all(r["comm_ms"] >= r["wire_ms"] >= 0 for r in rows)
    assert set(PROFILE["links"]) == {"100mbit", "1gbit", "10gbit", "unlimited"}
    for point, kind in (("network/100mbit/cnn-dp-shard-map", "distributed"),
                        ("network/1gbit/cnn-mpi-allreduce", "mpi")):
        measured = results.load(DATA / point / "result.json")
        bandwidth = measured.config["point"]["labels"]["bandwidth"]
        base, _ = cost_check.predict_point(PROFILE, measured.config, measured.env)
        links = {**PROFILE["links"], bandwidth: {**PROFILE["links"][bandwidth], kind: {
            op: {n: {**fit, "points": [[b, 2 * t] for b, t in fit["points"]]} for n, fit in fits.items()}
            for op, fits in PROFILE["links"][bandwidth][kind].items()}}}
        slower, _ = cost_check.predict_point({**PROFILE, "links": links}, measured.config, measured.env)
        assert base.comm_s > 0 and slower.comm_s == pytest.approx(2 * base.comm_s), point
        assert base.wire_s > 0
        formula, _ = cost_check.predict_point({**PROFILE, "links": {}}, measured.config, measured.env)
        assert formula.comm_s != pytest.approx(base.comm_s)  # the rate's formula: the fallback


def test_jax_distributed_processes_are_priced_on_their_own_collectives():
    """The processes of one global mesh pay the profile's cross-process collectives (gloo), not
    the simulated devices' nor mpi4jax's; every scaling-over-ranks point is covered."""
    assert PROFILE["distributed"], PROFILE.get("distributed_note")
    ranks = [r for r in cost_check.check_rows(DATA) if r["study"] == "scaling-ranks"]
    assert ranks and all("error" in r for r in ranks)
    r = next(r for r in ranks if r["point"] == "scaling/ranks/strong/cnn-dp-auto-r2")
    measured = results.load(DATA / r["point"] / "r0/result.json")
    config, env = measured.config, measured.env
    slower = {**PROFILE, "distributed": {op: {n: {**fit, "points": [[b, 10 * t] for b, t in fit["points"]]}
                                              for n, fit in fits.items()}
                                         for op, fits in PROFILE["distributed"].items()}}
    base, _ = cost_check.predict_point(PROFILE, config, env)
    ten, _ = cost_check.predict_point(slower, config, env)
    assert base.comm_s > 0 and ten.comm_s == pytest.approx(10 * base.comm_s)
    assert ten.compute_s == pytest.approx(base.compute_s)
    older = {k: v for k, v in PROFILE.items() if k != "distributed"}  # a profile without them
    assert cost_check.predict_point(older, config, env) == (None, "jax.distributed over processes: "
                                                                  "no profile of its collectives")


def test_the_collectives_across_jax_distributed_processes_are_profiled():
    from jaxpar.profiling import machine as profiling

    fits, note = profiling.mpi_profile((2,), profiling.QUICK_COLLECTIVE_BYTES, 2, module="jaxpar.profiling.dist_rank")
    assert note == "" and set(fits) == set(profiling.COLLECTIVE_OPS)
    for fit in (f["2"] for f in fits.values()):
        assert fit["bytes_per_s"] > 0 and len(fit["points"]) == 2 and all(t > 0 for _, t in fit["points"])


def test_pipelines_are_priced_in_the_form_they_were_measured():
    result = json.loads((DATA / "bounds/points/2/pipeline-gpipe/r0/result.json").read_text())
    assert result["strategy"]["implementation"] == "mpmd"
    pred, why = cost_check.predict_point(PROFILE, result["config"], result["env"], result["strategy"])
    assert pred is not None and why == ""
    spmd = {**result["strategy"], "implementation": "spmd"}
    assert cost_check.predict_point(PROFILE, result["config"], result["env"], spmd) == (
        None, "implementation replaced: measured as one SPMD program, not one program per stage")
    # one program per stage sends each real micro-batch over each boundary, forward and back;
    # the SPMD program shifts the largest boundary at every tick
    compute = predictlib.compute_source(PROFILE)("cnn")
    for impl, count in (("mpmd", 2 * 8), ("spmd", 2 * (8 + 4 - 1))):
        work = STRATEGIES["pipeline"].cost(Problem(compute, {"stage": 4}, 128, microbatches=8,
                                                   model={"model": "cnn"}, implementation=impl))
        sends = [c for c in work.collectives if c.op == ("send" if impl == "mpmd" else "collective-permute")]
        assert {c.count for c in sends} == {count}
        assert len(sends) == (3 if impl == "mpmd" else 1)


def test_gems_updates_both_copies_and_swaps_every_stages_gradient():
    compute = predictlib.compute_source(PROFILE)(STACK)
    problem = Problem(compute, {"stage": 4}, 512, microbatches=8, model={"model": "stack-mlp"}, implementation="mpmd")
    one, two = STRATEGIES["pipeline"].cost(problem), STRATEGIES["gems"].cost(problem)
    assert sum(two.device_s) == pytest.approx(2 * sum(one.device_s))
    # device d holds stage d of one copy and stage S-1-d of the other, each at its own size
    # (the SPMD layout pads both to the largest)
    stages = [sum(compute.layers[i].param_bytes for i in r) for r in stage_layers(problem, 4)]
    assert two.state_bytes == pytest.approx(3 * max(stages[d] + stages[3 - d] for d in range(4)))
    spmd = dataclasses.replace(problem, implementation="spmd")
    assert STRATEGIES["gems"].cost(spmd).state_bytes == 2 * STRATEGIES["pipeline"].cost(spmd).state_bytes
    swaps = [c for c in two.collectives if c not in one.collectives]
    assert sum(c.bytes * c.count for c in swaps) == pytest.approx(2 * compute.param_bytes)


@pytest.mark.parametrize("axes,impl,programs", [
    ({"stage": 4}, "mpmd", 4),                                        # one program per device
    ({"tensor": 2, "stage": 4}, "mpmd", 8 * (2 * 4 - 1) + 4),         # walked slot by slot
    ({"stage": 4}, "spmd", 0)])
def test_the_host_pays_a_dispatch_for_every_stage_program_it_drives(axes, impl, programs):
    compute = predictlib.compute_source(PROFILE)("cnn")
    machine = cost.simulated({**PROFILE, "dispatch_us": 50.0}, lambda k, t: compute)
    without = cost.simulated({**PROFILE, "dispatch_us": 0.0}, lambda k, t: compute)
    work = STRATEGIES["pipeline"].cost(Problem(compute, axes, 128, microbatches=8,
                                               model={"model": "cnn"}, implementation=impl))
    assert work.programs == programs
    extra = cost.predict(work, machine, 128, 4).compute_s - cost.predict(work, without, 128, 4).compute_s
    assert extra == pytest.approx(programs * 50e-6)


H100 = cost.load_profile(DATA / "cost-h100" / "profile.json")  # measured on a lent H100 node


def test_a_measured_gpu_profile_is_the_device_it_measured():
    """`--device profiled` with a GPU's profile: its measured step, dedicated devices over an
    assumed link, pipelines in the single-program form (`--pipeline-impl auto` on a GPU), and
    `--link measured` refused (one GPU: no collectives measured)."""
    steps = H100["models"]["cnn"]["steps"]
    at_128 = steps["step_ms_median"][steps["batch"].index(128)]
    p = predictlib.predict_one(H100, "cnn", "single", 1, 128, predictlib.PROFILED, "nvlink")
    assert 1000 * p.total_s == pytest.approx(at_128, rel=0.25)  # a line fitted through six batches
    dp = predictlib.predict_one(H100, "cnn", "dp-shard-map", 8, 1024, predictlib.PROFILED, "nvlink")
    assert dp.compute_s == pytest.approx(p.compute_s, rel=1e-6) and dp.comm_s > 0  # at once, 128 each
    machine = predictlib.machine(H100, predictlib.PROFILED, "nvlink", None)
    by_form = {impl: cost.predict(STRATEGIES["pipeline"].cost(predictlib.problem(
        "cnn", "pipeline", {"stage": 2}, 128, predictlib.compute_source(H100)("cnn"), implementation=impl)),
        machine, 128, 2).total_s for impl in ("spmd", "mpmd")}
    assert by_form["spmd"] != pytest.approx(by_form["mpmd"])
    assert predictlib.predict_one(H100, "cnn", "pipeline", 2, 128, predictlib.PROFILED, "nvlink").total_s \
        == pytest.approx(by_form["spmd"])
    with pytest.raises(predictlib.ConfigError, match="no collectives.*pick an assumed link"):
        predictlib.predict_one(H100, "cnn", "dp-shard-map", 2, 128)


def test_the_assumed_h100_is_checked_against_the_measured_one():
    rows = cost_check.assumed_h100_rows(DATA)
    assert {r["model"] for r in rows} == set(H100["models"]) and all(r["measured_ms"] > 0 for r in rows)
    for r in rows:
        assumed = predictlib.compute_source(PROFILE, "h100")(r["model"]).step_s(r["batch"])
        assert r["assumed_ms"] == pytest.approx(1000 * assumed) and r["ratio"] == r["assumed_ms"] / r["measured_ms"]
    assert any(r["machine_ms"] for r in rows)  # the machine command ran on the same kind of GPU


def test_a_pipeline_is_priced_cut_where_it_was_cut():
    """The rank study's 2-rank `pipeline` cut inside conv2 (its result says so): priced so,
    its stages balanced as `mpi-pipeline`'s; cut after conv2 the first stage holds ~85%."""
    result = json.loads((DATA / "scaling/ranks/strong/cnn-pipeline-r2/r0/result.json").read_text())
    assert result["strategy"]["cut_inside"]
    compute = predictlib.compute_source(PROFILE)("cnn")
    stages = {}
    for inside in (False, True):
        work = STRATEGIES["pipeline"].cost(Problem(compute, {"stage": 2}, 128, microbatches=8, model={"model": "cnn"},
                                                   implementation="mpmd", cut_inside=inside))
        stages[inside] = max(work.stage_s) / sum(work.stage_s)
    assert stages[False] > 0.8 and stages[True] < 0.6
    pred, why = cost_check.predict_point(PROFILE, result["config"], result["env"], result["strategy"])
    assert why == "" and pred is not None


def test_a_group_with_two_single_points_is_anchored_on_the_one_named_single():
    """The peers' MLP "best" came out as `single` too: one anchor per group, the study's own."""
    def row(point, measured):
        return {"study": "peers", "point": f"peers/points/mlp/{point}", "model": "mlp",
                "strategy": "single", "steps_per_dispatch": 1, "one_thread": False,
                "predicted_ms": 2.0, "measured_ms": measured, "rounds_ms": [measured], "wire_ms": 0.0,
                "host_ms": 0.0, "batch": 128, "process_devices": None}
    best, single = row("jaxpar-best", 3.0), row("jaxpar-single", 4.0)
    cost_check.anchor([best, single])
    assert single["anchor"] and single["error"] == pytest.approx(0)
    assert not best["anchor"] and best["error"] == pytest.approx(4.0 / 3.0 - 1)


def test_every_schedule_is_priced_from_its_own_replay():
    """Interleaved and zero-bubble schedules are replayed with the stages' measured times: on
    dedicated devices they predict less bubble than 1F1B at the same M (interleaving about
    half, ZB-H1 about a third), the same compute, and their sends only where stages change
    device (ZBV's middle boundary stays on its device)."""
    compute = predictlib.compute_source(PROFILE)(STACK)
    machine = cost.cluster(lambda key, fast: compute, cost.Link("free", 1e15, 0.0, "test"), None, "test")
    problem = Problem(compute, {"stage": 2}, 512, microbatches=4, model={"model": "stack-mlp"},
                      implementation="mpmd")
    priced = {name: cost.predict(STRATEGIES["pipeline"].cost(dataclasses.replace(problem, schedule=name)),
                                 machine, 512, 2) for name in ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")}
    assert priced["interleaved-1f1b"].bubble_s < 0.7 * priced["1f1b"].bubble_s
    assert priced["zb-h1"].bubble_s < 0.5 * priced["1f1b"].bubble_s
    for name in ("interleaved-1f1b", "zb-h1"):
        assert priced[name].compute_s == pytest.approx(priced["1f1b"].compute_s, rel=0.05)
    zbv = STRATEGIES["pipeline"].cost(dataclasses.replace(problem, schedule="zbv"))
    assert len([c for c in zbv.collectives if c.op == "send"]) == 2  # 4 stages, 3 boundaries, 1 local
