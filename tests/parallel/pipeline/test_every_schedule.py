"""Every pipeline schedule equals `single` on the host-driven runtime (one program per device,
and walked from the host), on 2 and 4 stages, on the stack-mlp and the CNN; zero-bubble
schedules with --remat too; a state moves between schedules (and their stage cuts) through
the single-device layout and goes on as `single` does. Across processes: tests/mpi.

    python -m pytest -q tests/parallel/pipeline/test_every_schedule.py
"""

from __future__ import annotations

import functools

import jax
import pytest

import equivalence as eq
from conftest import requires_devices
from jaxpar.optim import make_optimizer
from jaxpar.parallel.transport import p2p
from jaxpar.train import build_model, make_strategy

STACK = dict(model="stack-mlp", width=32, depth=6, batch_size=32, lr=0.01)  # 8 layers
CNN = dict(model="cnn", width=None, depth=None, batch_size=16, lr=0.02)
NEW = ["interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev"]


def micro(schedule: str, stages: int) -> int:
    return 2 * stages if schedule == "dualpipev" else 4  # dualpipev: a micro-batch per stage


@functools.lru_cache(maxsize=None)
def reference(model: str, steps: int = 3):
    return eq.run(eq.config(**(STACK if model == "stack-mlp" else CNN)), steps=steps)


@requires_devices(4)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", NEW)
def test_stack_mlp_equals_single_one_program_per_device(schedule, stages):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", schedule=schedule, pipeline_impl="mpmd",
                    microbatches=micro(schedule, stages), **STACK)
    got = eq.run(cfg, steps=3, devices=stages)
    eq.assert_equivalent(reference("stack-mlp"), got)
    d = got.strategy.describe()
    assert d["schedule"] == schedule and d["step_programs"].startswith("one per device")
    assert d["stages"] == stages * d["virtual_stages"] and len(d["stage_devices"]) == d["stages"]


@pytest.mark.parametrize("schedule", NEW)
def test_walked_from_the_host_equals_single(schedule, monkeypatch):
    monkeypatch.setattr(p2p, "unavailable", lambda: "walked (the test's)")
    cfg = eq.config(strategy="pipeline", mesh="stage=2", schedule=schedule, pipeline_impl="mpmd",
                    microbatches=micro(schedule, 2), **STACK)
    got = eq.run(cfg, steps=3, devices=2)
    eq.assert_equivalent(reference("stack-mlp"), got)
    assert got.strategy.describe()["step_programs"].startswith("per stage and slot")


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved-1f1b", "zbv"])
def test_cnn_equals_single(schedule):
    cfg = eq.config(strategy="pipeline", mesh="stage=2", schedule=schedule, pipeline_impl="mpmd",
                    microbatches=4, **CNN)
    eq.assert_equivalent(reference("cnn"), eq.run(cfg, steps=3, devices=2))


@pytest.mark.parametrize("walked", [False, True])
@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipev"])
def test_remat_composes_with_the_split_backward(schedule, walked, monkeypatch):
    if walked:
        monkeypatch.setattr(p2p, "unavailable", lambda: "walked (the test's)")
    cfg = eq.config(strategy="pipeline", mesh="stage=2", schedule=schedule, remat=True, pipeline_impl="mpmd",
                    microbatches=micro(schedule, 2), **STACK)
    eq.assert_equivalent(reference("stack-mlp"), eq.run(cfg, steps=3, devices=2))


def test_a_state_moves_between_schedules_and_goes_on_as_single():
    """Two steps under zb-h1 (2 stages), the state to the single-device layout, then under
    interleaved-1f1b (4 stages on 2 devices, another cut): the same steps as `single`'s."""
    first = eq.config(strategy="pipeline", mesh="stage=2", schedule="zb-h1", pipeline_impl="mpmd", **STACK)
    second = eq.config(strategy="pipeline", mesh="stage=2", schedule="interleaved-1f1b", pipeline_impl="mpmd",
                       **STACK)
    batches = eq.batches(STACK["batch_size"], 4)
    ref = eq.run(eq.config(**STACK), steps=4, global_batches=batches)
    a = eq.run(first, steps=2, devices=2, global_batches=batches[:2])
    handed = a.strategy.state_to_reference(a.state)
    strategy = make_strategy(second)
    strategy.init(build_model(second), make_optimizer(second.optim, total_steps=4),
                  strategy.make_mesh(jax.devices()[:2]))
    state = strategy.state_from_reference(handed)
    for batch in batches[2:]:
        state, sums = strategy.step(state, strategy.place_batch(batch))
        strategy.host_sums(sums)
    eq.assert_tree_close(ref.params, strategy.to_reference(state))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_each_action_timed_alone_leaves_the_step_as_it_was(schedule):
    """`bench --timeline`'s action times: a walk whose programs run one at a time charges
    every action of the table (a last stage's backward, run inside its forward's program,
    nothing; the first stage's forwards and backwards their own time) and changes nothing:
    the gradients after it are those before."""
    cfg = eq.config(strategy="pipeline", mesh="stage=2", schedule=schedule, pipeline_impl="mpmd",
                    microbatches=4, **STACK)
    got = eq.run(cfg, steps=1, devices=2)
    strategy, batch = got.strategy, got.strategy.place_batch(eq.batches(STACK["batch_size"], 1)[0])
    before = strategy.gradients(got.state, batch)
    (took,) = strategy.serial_steps(got.state, batch, walks=1)
    assert set(took.actions) == {a for lst in strategy.schedule.lists for a in lst}
    last = strategy.schedule.stages - 1
    for a, seconds in took.actions.items():
        inside_its_forward = a.stage == last and a.kind in ("B", "I")
        assert (seconds == 0) == inside_its_forward, (a, seconds)
    assert set(took.outside) == {0, 1} and all(s > 0 for s in took.outside.values())
    assert all(s > 0 for s in strategy.walked_seconds(got.state, batch, iters=2))
    eq.assert_tree_close(before, strategy.gradients(got.state, batch), tol=0.0, what="gradients")
