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
    assert run(["hparam", "--search", "bayes", "--out", str(tmp_path)]) == 2
    assert "--search 'bayes' is not one of: grid, random" in capsys.readouterr().err
    assert run(["hparam", "--epochs", "0,2", "--out", str(tmp_path)]) == 2
    assert "--epochs 0,2: each must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "hparam.json").exists()


def test_random_search_over_epochs_and_learning_rate(tmp_path):
    """Seed 003's search: epochs and learning rate, drawn at random. A trial of E epochs trains
    E passes (vmapped: the first E of the longest), evaluated where its own epochs end."""
    out = tmp_path / "hparam"
    assert run(["hparam", "--quick", "--search", "random", "--trials", "8", "--epochs", "1,2",
                "--lrs", "0.01,0.1", "--momenta", "0.9", "--depths", "1", "--batch-size", "500",
                "--out", str(out)]) == 0
    result = json.loads((out / "hparam.json").read_text())
    config, (g,) = result["config"], result["metrics"]["groups"]
    lrs = [lr for _, lr, _ in config["trial_list"]]
    assert len(lrs) == 8 and all(0.01 <= lr <= 0.1 for lr in lrs) and len(set(lrs)) > 4
    per_epoch = 11000 // 500  # synthetic: 12,000 examples less 1,000 for validation
    assert config["trial_steps"] == [e * per_epoch for e in config["trial_epochs"]]
    assert set(config["trial_epochs"]) <= {1, 2}
    assert g["val_accuracy"] == g["val_accuracy_sequential"]  # each evaluated where it ends
    for epochs, par, seq in zip(config["trial_epochs"], g["losses_vmapped"], g["losses_sequential"]):
        ended = [s > epochs * per_epoch for s in g["loss_steps"]]
        assert [v is None for v in par] == [v is None for v in seq] == ended
        np.testing.assert_allclose([v for v in par if v is not None], [v for v in seq if v is not None],
                                   rtol=1e-5, atol=1e-6)
    best = g["best"]
    assert best["epochs"] == config["trial_epochs"][best["trial"]] and best["val_accuracy"] == max(g["val_accuracy"])
    # the same --search-seed draws the same trials
    from experiments.studies.hparam.study import QUICK, draws
    import dataclasses
    again = dataclasses.replace(QUICK, search="random", trials=8, epochs=(1, 2), lrs=(0.01, 0.1), momenta=(0.9,))
    assert [list(t[:3]) for t in draws(again)] == config["trial_list"]
