"""Property test of `train`'s command line with hypothesis: any combination of options and
values (valid or not: strings where numbers belong, huge and negative numbers, NaN, meshes
that do not fit) either trains and writes a result with finite metrics, stops as diverged
(exit 3, `status: diverged`), or exits 2 with one paragraph, no traceback and nothing written.

Runs in-process on the 8 simulated devices of conftest.py, one step on a small synthetic set.
"""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings, strategies as st

from experiments.__main__ import EXIT_USAGE, run
from jaxpar.models import MODELS
from jaxpar.optim import LR_SCHEDULES, OPTIMIZERS
from jaxpar.parallel import STRATEGIES

EXIT_DIVERGED = 3
EXAMPLES = 20  # ~2 s each (most are refused at once); the budget of CI is 20 minutes in all

anything = st.sampled_from(["abc", "", "1e400", "-0", "nan", "inf", "2.5"])
counts = st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32]), st.integers(-2, 6),
                   st.sampled_from([10**9]), anything)
reals = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                  st.sampled_from([1e-3, 0.1, 0.9, 1e6]), anything)
OPTIONS = {
    "--strategy": st.sampled_from([*STRATEGIES, "nosuch"]),
    "--model": st.sampled_from([*MODELS, "nosuch"]),
    "--optimizer": st.sampled_from([*OPTIMIZERS, "nosuch"]),
    "--lr-schedule": st.sampled_from(LR_SCHEDULES),
    "--mesh": st.sampled_from(["data=8", "data=2", "data=3", "tensor=2,data=4", "stage=2",
                               "stage=8", "data=2,tensor=2,stage=2", "data=-1", "data=0", "x=1",
                               "data"]),
    "--lr": reals, "--momentum": reals, "--target-accuracy": reals,
    "--batch-size": counts, "--eval-batch-size": counts, "--accumulate": counts,
    "--microbatches": counts, "--sync-every": counts, "--width": counts, "--depth": counts,
    "--val-size": counts, "--warmup-steps": counts, "--devices": counts,
}
argvs = st.lists(st.sampled_from(sorted(OPTIONS)), unique=True, max_size=5).flatmap(
    lambda flags: st.tuples(*[st.tuples(st.just(f), OPTIONS[f].map(str)) for f in flags]))


def _finite(x) -> bool:
    return x is None or isinstance(x, (str, bool, dict, list)) or math.isfinite(x)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(options=argvs)
def test_train_either_succeeds_stops_as_diverged_or_refuses_cleanly(tmp_path_factory, capsys, options):
    out = tmp_path_factory.mktemp("run") / "out"
    argv = ["train", "--dataset", "synthetic", "--synthetic-size", "600", "--val-size", "100",
            "--steps", "1", "--no-progress", "--out", str(out)]
    if "--model" not in dict(options):  # a small default model, unless the model is drawn
        argv += ["--model", "mlp", "--width", "16", "--depth", "1"]
    for flag, value in options:
        argv += [f"{flag}={value}"]  # `=`: a value such as -1 is not read as a flag
    try:
        code = run(argv)
    except SystemExit as e:  # argparse: a value of the wrong type or an unknown choice
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code == EXIT_USAGE:
        assert len(err.strip().splitlines()) == 1, err
        assert not out.exists(), f"{argv}: refused, yet wrote {list(out.iterdir())}"
        return
    result = json.loads((out / "result.json").read_text())
    if code == EXIT_DIVERGED:
        assert result["status"] == "diverged", result.get("status")
        return
    assert code == 0, (argv, err)
    assert all(_finite(v) for v in result["metrics"].values()), (argv, result["metrics"])
