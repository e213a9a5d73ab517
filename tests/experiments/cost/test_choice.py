"""The cost model as a user asks it: which configuration to run (the order in each sitting,
`plan`'s pick against the measured fastest), how sure it is (intervals and their calibration),
how it does on a study it never saw, and where it misses and why; the terms it takes from the
committed points each from a measurement of its cause."""

from __future__ import annotations

import math
import statistics

import pytest

from conftest import ROOT
from experiments.__main__ import run
from experiments.cost import check, loso, misses, plan_check, pricing, ranking, terms, uncertainty
from experiments.cost.predict import mark_ties
from jaxpar import cost

DATA = ROOT / "figures" / "data"
PROFILE = pricing.load_profile(str(DATA / "cost" / "profile.json"))


@pytest.fixture(scope="module")
def rows():
    return check.check_rows(DATA)


def test_kendall_tau_counts_pairs_and_ties_within_the_noise():
    assert ranking.kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert ranking.kendall_tau([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # two measured values 4% apart are a tie within 5% of noise: only the clear pairs count
    assert ranking.kendall_tau([1, 2, 3], [10.4, 10.0, 30], tied=0.05) == pytest.approx(1 / math.sqrt(3 * 2) * 2)
    assert ranking.kendall_tau([1, 1, 1], [1, 2, 3]) is None
    assert ranking.ranks_of([3.0, 1.0, 2.0]) == [1.0, 0.0, 0.5]


def test_every_sitting_of_three_or_more_configurations_is_ranked(rows):
    groups = ranking.ranked_groups(rows)
    assert len(groups) >= 30
    for g in groups:
        assert g["configurations"] >= ranking.MIN_CONFIGURATIONS and 0 <= g["noise"] < 1
        assert g["best_ms"] <= g["pick_ms"]
        assert g["hit"] == (g["pick_ms"] <= g["best_ms"] * (1 + g["noise"]))
        # anchors never rank: their prediction is their measurement
        assert not any(label == "single" for label, _, _ in g["points"] if g["study"] != "pipeline")
    summary = ranking.rank_summary(groups)
    assert summary["groups"] == len(groups) and 0 <= summary["hits"] <= len(groups)
    # the measurement agrees with itself only so far: one round's order against another's
    assert summary["with_rounds"] > 10 and summary["tau_rounds_median"] < 1


def test_the_network_studys_bandwidths_are_sittings_of_their_own(rows):
    sittings = {g["sitting"] for g in ranking.ranked_groups(rows) if g["study"] == "network"}
    assert sittings == {"network/100mbit", "network/1gbit", "network/10gbit", "network/unlimited"}


def test_a_formulation_term_is_the_median_of_its_measured_pairs(rows):
    formulations = terms.formulation_terms(rows)
    pmap = formulations[("dp-pmap", False)]
    pairs = [p for p in terms.formulation_pairs(rows) if p["strategy"] == "dp-pmap" and not p["processes"]]
    assert pmap.factor == pytest.approx(statistics.median(p["ratio"] for p in pairs)) and pmap.factor > 1
    assert all(p["sitting"].split("/")[0] != "network" for p in pairs)   # links drown an API's cost
    # left out, a study's pairs are not used
    without = terms.formulation_terms(rows, leave_out="scaling")[("dp-pmap", False)]
    assert len(without.ratios) == len(pmap.ratios) - sum(p["sitting"].startswith("scaling/") for p in pairs)
    for r in rows:
        if "predicted_ms" in r and r["wire_ms"] == 0:
            f = terms.factor_of(formulations, r["strategy"], r["ranks"])
            raw = r["raw_compute_ms"] + r["raw_comm_ms"] + r["raw_bubble_ms"]
            assert r["predicted_ms"] == pytest.approx(raw * f + r["host_ms"])


def test_a_pinned_processs_host_time_is_solved_from_two_models_in_one_sitting(rows):
    host = terms.pinned_host(rows)
    assert len(host.solved) >= 2 and 0 < host.seconds < 0.01
    for sitting, h, speed in host.solved:
        singles = {r["model"]: r for r in rows if r["sitting"] == sitting and terms._pinned_single(r)}
        for r in list(singles.values())[:2]:   # both measured steps: m = s p + h
            assert r["measured_ms"] == pytest.approx(speed * r["raw_compute_ms"] + 1000 * h)
    for r in rows:
        if "host_ms" in r and r["pinned"]:   # each core runs every process's pinned to it
            assert r["host_ms"] == pytest.approx(1000 * host.seconds * max(1, r["devices"] / PROFILE["cores"]))
    assert {r["host_ms"] for r in rows if "host_ms" in r and not r["pinned"]} == {0.0}


def test_collectives_on_shared_cores_are_priced_at_their_bytes_part():
    fits = PROFILE["collectives"]
    c = cost.Collective("all-reduce", 1e6, 4)
    whole, shared = cost.fitted_collectives(fits)(c), cost.shared_pool_collectives(fits)(c)
    assert shared == pytest.approx(whole - cost.fitted_seconds(fits, "all-reduce", 4, 0.0)) and 0 < shared < whole


def test_an_interval_holds_about_as_often_as_it_claims(rows):
    table = uncertainty.calibration(rows, PROFILE)
    overall = table[-1]
    assert overall["study"] == "all" and overall["points"] == sum(c["points"] for c in table[:-1])
    # the model's own spread is fitted on the other studies: each study's coverage is out of sample
    assert 0.70 <= overall["all"] <= 0.90
    assert overall["profile"] < overall["measured"] <= overall["all"]
    lo, hi = uncertainty.interval(10.0, 0.1)
    assert lo == pytest.approx(10 * math.exp(-uncertainty.Z80 * 0.1)) and hi == pytest.approx(100 / lo)


def test_each_study_is_predicted_by_the_model_fitted_without_it(rows):
    summary = {r["study"]: r for r in loso.loso_summary(rows, PROFILE["cores"])}
    assert set(summary) - {"all"} == {s for s, _ in check.CHECKED_STUDIES}
    for s, r in summary.items():
        assert r["in"]["points"] == r["out"]["points"] == r["blind"]["points"]
    # nothing fitted but the formulations' and the host's terms: left out, a study keeps its errors close
    assert summary["all"]["out"]["median"] < 1.5 * summary["all"]["in"]["median"]
    scaled = loso.left_out_rows(rows, "bounds", False, PROFILE["cores"])
    own = {r["point"]: r["scale"] for r in rows if r["study"] == "bounds"}
    assert all(r["scale"] != own[r["point"]] for r in scaled)   # other studies' speed, not its own


def test_every_miss_has_one_cause_and_every_cause_a_measurement():
    table = misses.misses_by_cause(DATA)
    before = [r for r in check.check_rows(DATA, base=True) if "error" in r and not r["anchor"]]
    assert sum(m["before"] for m in table) == sum(abs(r["error"]) > misses.MISS for r in before)
    assert all(m["measured"] for m in table if m["cause"] != "other")


def test_plan_is_checked_against_the_measured_fastest(rows):
    table = plan_check.plan_validation(rows, PROFILE, terms.fitted_terms(rows))
    assert len(table) == len(ranking.sitting_groups(rows, key="predicted_ms"))
    for e in table:
        assert e["best_ms"] > 0 and isinstance(e["among_hit"], bool)
        if e["pick_measured"] is not None:
            assert e["pick_hit"] == (e["pick_measured"] <= e["best_ms"] * (1 + e["noise"]))


def test_plan_weighs_micro_batches_and_schedules_and_processes(rows):
    fitted = terms.fitted_terms(rows)
    plan = pricing.plan_rows(PROFILE, "cnn", 2, 128, pricing.PROFILED, "measured", None, fitted=fitted)
    pipelines = {(r["microbatches"], r["schedule"]) for r in plan if r["strategy"] == "pipeline"}
    assert {(1, "gpipe"), (8, "1f1b")} <= pipelines
    ranks = pricing.plan_rows(PROFILE, "cnn", 2, 128, pricing.PROFILED, "measured", None, processes=True,
                              fitted=fitted)
    names = {r["strategy"] for r in ranks}
    assert {"mpi-allreduce", "dp-shard-map", "pipeline", "single"} <= names and "gems" not in names
    one = next(r for r in ranks if r["strategy"] == "dp-auto")["prediction"]
    assert one.compute_s > fitted.host_s > 0   # a pinned process's host time in every process's step
    pmap = next(r for r in plan if r["strategy"] == "dp-pmap")["prediction"]
    shard = next(r for r in plan if r["strategy"] == "dp-shard-map")["prediction"]
    assert pmap.total_s == pytest.approx(shard.total_s * fitted.factor("dp-pmap", False))


def test_plan_names_a_tie_where_intervals_overlap():
    sig = uncertainty.Sigmas({}, {"all": 0.1}, 0.0, 0.0)
    fitted = type("F", (), {"sigmas": sig})()
    pred = lambda ms: cost.Prediction(ms / 1000, 0, 0, 1, 0, 128, 2)  # noqa: E731
    rows = [{"strategy": "single", "mesh": "default", "prediction": pred(10), "fits": True},
            {"strategy": "fsdp", "mesh": "default", "prediction": pred(11), "fits": True},
            {"strategy": "tensor", "mesh": "default", "prediction": pred(20), "fits": True}]
    marked = mark_ties(rows, fitted, "cnn", processes=False)
    assert [r["tie"] for r in marked] == [True, True, False]


def test_plan_refuses_before_running_what_its_state_does_not_fit(capsys):
    """A memory budget below a replica's state (the CNN's 5 MB of parameters and Adam moments)
    on this machine: plan refuses every configuration holding it whole, however fast, and
    picks the one that fits (fsdp, 1/4 of it a device)."""
    budget = 4e6
    plan = pricing.plan_rows(PROFILE, "cnn", 4, 16, pricing.PROFILED, "measured", budget)
    refused = [r for r in plan if not r["fits"]]
    assert {"single", "dp-shard-map", "mpi-allreduce", "pipeline"} <= {r["strategy"] for r in refused}
    assert all(r["prediction"].memory_bytes > budget for r in refused)
    assert plan[0]["fits"] and plan[0]["strategy"] == "fsdp"
    assert min(r["prediction"].total_s for r in refused) < plan[0]["prediction"].total_s   # faster, refused
    assert run(["plan", "--model", "cnn", "--devices", "4", "--batch-size", "16", "--memory", "4MB",
                "--data", str(DATA)]) == 0
    out = capsys.readouterr().out
    assert out.count("does not fit") == len({(r["strategy"], r["mesh"]) for r in refused})
    assert "pick: fsdp" in out or "a tie: fsdp" in out


def test_predict_prints_an_interval_on_this_machine(capsys):
    assert run(["predict", "--model", "cnn", "--strategy", "dp-shard-map", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "80% interval" in out
    assert run(["predict", "--model", "cnn", "--strategy", "dp-shard-map", "--ranks", "2"]) == 0
    assert "2 processes" in capsys.readouterr().out
    assert run(["predict", "--model", "cnn", "--devices", "8", "--device", "h100", "--link", "nvlink"]) == 0
    assert "no interval" in capsys.readouterr().out
