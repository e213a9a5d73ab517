"""The hparam study in its quick mode: the vmapped search (trial axis sharded over the test's
devices) trains exactly the trials one-by-one runs train, and records the best configuration."""

import json

import numpy as np

from experiments.__main__ import run


def test_vmapped_search_equals_trials_one_by_one(tmp_path):
    out = tmp_path / "data" / "hparam"
    assert run(["hparam", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "hparam.json").read_text())
    assert result["config"]["steps"] == 10 and "cpu_cores" in result["env"]
    groups = result["metrics"]["groups"]
    assert {(g["width"], g["depth"]) for g in groups} == {(32, 1), (32, 2)}  # shape groups
    trials = result["config"]["trial_list"]
    for g in groups:
        par, seq = np.array(g["losses_vmapped"]), np.array(g["losses_sequential"])
        assert par.shape == seq.shape == (len(trials), 10) and g["loss_steps"] == list(range(1, 11))
        np.testing.assert_allclose(par, seq, rtol=1e-5, atol=1e-6)
        assert g["max_val_accuracy_diff"] == 0.0 and g["best_sequential"]["trial"] == g["best"]["trial"]
        acc = g["val_accuracy"]
        best = g["best"]
        assert best["val_accuracy"] == max(acc) and trials[best["trial"]] == [best["seed"], best["lr"], best["momentum"]]
        m = g["best_over_seeds"]
        assert m["seeds"] == 2 and m == g["best_over_seeds_sequential"]
        assert g["vmapped_s"] > 0 and g["sequential_s"] > 0 and g["vmapped_compile_s"] > 0
    overall = result["metrics"]["best"]
    assert overall["val_accuracy"] == max(g["best"]["val_accuracy"] for g in groups)

    assert run(["figures", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "hparam_speedup.png").stat().st_size > 0


def test_bad_options_exit_2_with_the_fix(tmp_path, capsys):
    assert run(["hparam", "--lrs", "0.1,x", "--out", str(tmp_path)]) == 2
    assert "--lrs takes comma-separated floats" in capsys.readouterr().err
    assert run(["hparam", "--devices", "3", "--out", str(tmp_path)]) == 2  # 16 trials
    assert "must divide the 16 trials" in capsys.readouterr().err
    assert not (tmp_path / "hparam.json").exists()
