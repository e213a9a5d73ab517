"""`pipeline` (GPipe and 1F1B) equals `single` for every model, in both formulations (one
SPMD program, `--pipeline-impl spmd`; one program per stage driven from the host, `mpmd`);
its communication, padding and memory match theory.

The seeds' models (mlp, cnn, resnet) on 2 and 4 stages cut by FLOPs (stages of uneven layer
counts and different shapes) and by --stage-boundaries; the ResNet, whose batch norm runs
per micro-batch, against the per-micro-batch reference (`pipeline_cases.micro_reference`),
and against `single` itself with one micro-batch. Bad shapes name the option to change."""

import functools
import re

import jax
import numpy as np
import pytest

import equivalence as eq
import pipeline_cases as pc
from conftest import requires_devices
from jaxpar.profiling import measure
from jaxpar.errors import ConfigError, MeshError

STACK = dict(model="stack-mlp", width=32, depth=4, batch_size=32, lr=0.01)
VIT = dict(model="vit", width=32, depth=2, batch_size=16, lr=0.01)


@functools.lru_cache(maxsize=None)
def reference(model):
    return eq.run(eq.config(**(STACK if model == "stack-mlp" else VIT)), steps=5)


IMPLS = ["spmd", "mpmd"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (2, 2)])
def test_stack_mlp_equals_single(schedule, stages, micro, impl):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", microbatches=micro,
                    schedule=schedule, pipeline_impl=impl, **STACK)
    eq.assert_equivalent(reference("stack-mlp"), eq.run(cfg, steps=5, devices=stages))


# Each formulation with each schedule runs the stack-mlp above; a model's own layers meet each
# formulation under one schedule (the suite's time): SPMD with GPipe, one program per stage
# with 1F1B, each cut into 2 stages and into 4 by one of them.
SPMD, MPMD = ("spmd", "gpipe"), ("mpmd", "1f1b")


@pytest.mark.parametrize("stages,impl,schedule", [(2, *SPMD), (4, *MPMD)])
def test_vit_equals_single(schedule, stages, impl):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", microbatches=4, schedule=schedule,
                    pipeline_impl=impl, **VIT)
    eq.assert_equivalent(reference("vit"), eq.run(cfg, steps=5, devices=stages))


# Every model meets both formulations, on 2 stages under one and 4 under the other; the cuts
# by --stage-boundaries once each.
SEED_CUTS = [("mlp", 2, None, *SPMD), ("mlp", 4, None, *MPMD), ("cnn", 2, None, *MPMD),
             ("cnn", 4, None, *SPMD), ("resnet", 2, None, *SPMD), ("resnet", 4, None, *MPMD),
             ("cnn", 2, (1,), *SPMD), ("resnet", 3, (2, 3), *MPMD)]


@requires_devices(4)
@pytest.mark.parametrize("model,stages,boundaries,impl,schedule", SEED_CUTS)
def test_seed_models_equal_single(schedule, model, stages, boundaries, impl):
    cfg = pc.config(model, strategy="pipeline", mesh=f"stage={stages}", microbatches=4,
                    schedule=schedule, stage_boundaries=boundaries, pipeline_impl=impl)
    got = eq.run(cfg, steps=5, devices=stages)
    pc.assert_equivalent(pc.reference(model, 4), got)
    if boundaries:
        assert got.strategy.describe()["stage_starts"] == [0, *boundaries]


@requires_devices(2)
@pytest.mark.parametrize("impl", IMPLS)
def test_resnet_with_one_microbatch_equals_single_batch_norm_included(impl):
    """One micro-batch normalises over the whole batch, as `single` does.

    Two steps, so that the second gradient is taken at the first update's parameters and
    batch-norm statistics. Not more: the ResNet's batch-norm biases that feed another batch
    norm have gradients that nearly cancel (rounding noise, ~1e-3 of the tree's norm), so a few
    steps on, two programs with different kernels fall into rounding clusters up to ~2e-3 apart
    on those leaves while their first gradients agree to ~2e-6. Which pairs cluster depends on
    the kernels, not on the strategy (measured with the suite's compile flags, worst leaf after
    2, 3, 5 steps: the SPMD pipeline 7e-7, 7e-7, 2e-3; one program per stage 6e-7, 3e-5, 7e-7;
    with XLA's default flags both passed at 5 steps)."""
    cfg = pc.config("resnet", strategy="pipeline", mesh="stage=2", microbatches=1, pipeline_impl=impl)
    pc.assert_equivalent(eq.run(pc.config("resnet"), steps=2), eq.run(cfg, steps=2, devices=2))


@pytest.mark.parametrize("impl", IMPLS)
def test_remat_changes_memory_not_results(impl):
    cfg = eq.config(strategy="pipeline", mesh="stage=2", microbatches=4, remat=True, pipeline_impl=impl, **STACK)
    eq.assert_equivalent(reference("stack-mlp"), eq.run(cfg, steps=5, devices=2))


def _accounting(schedule, micro=8, remat=False, stages=2, impl="spmd"):
    cfg = eq.config(strategy="pipeline", mesh=f"stage={stages}", microbatches=micro, schedule=schedule,
                    remat=remat, model="stack-mlp", width=64, depth=4, batch_size=128, pipeline_impl=impl)
    t = eq.run(cfg, steps=1, devices=stages, global_batches=eq.batches(128, 1))
    programs = t.strategy.compile("step", t.state, t.strategy.place_batch(eq.batches(128, 1)[0]))
    return t.strategy.accounting(programs, t.state), t


@pytest.mark.parametrize("impl", IMPLS)
def test_1f1b_holds_less_activation_memory_than_gpipe(impl):
    gpipe, _ = _accounting("gpipe", impl=impl)  # M = 8 >= 2S = 4
    remat, _ = _accounting("gpipe", remat=True, impl=impl)
    one_f, _ = _accounting("1f1b", impl=impl)
    assert one_f["activation_bytes_per_device"] < gpipe["activation_bytes_per_device"]
    assert remat["activation_bytes_per_device"] < gpipe["activation_bytes_per_device"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_collective_bytes_equal_the_schedule_theory(schedule):
    acc, _ = _accounting(schedule, micro=4)
    assert acc["collective_bytes_by_op"]["collective-permute"] == acc["collective_bytes_theory"]["collective-permute"]
    assert acc["collective_bytes_per_step"] == acc["collective_bytes_theory"]["total"]


def test_each_device_holds_its_stage_padded_to_the_largest():
    _, t = _accounting("gpipe", micro=4, stages=4)
    d = t.strategy.describe()
    sizes = d["param_elements_per_stage"]  # stem+block0 | block1 | block2 | block3+head
    assert sum(sizes) == sum(x.size for x in jax.tree.leaves(t.params)) and len(set(sizes)) > 1
    rows = t.state.params["rep"]
    assert rows.addressable_shards[0].data.size == max(sizes)  # one stage per device
    assert d["param_padding_elements"] == 4 * max(sizes) - sum(sizes)


@requires_devices(4)
def test_padding_bytes_equal_theory_from_the_cnns_shapes():
    """The CNN cut after every layer hands on [14,14,32], [7,7,64], [128] per example: every
    send is as wide as the widest, and each micro-batch crosses each boundary twice."""
    cfg = pc.config("cnn", strategy="pipeline", mesh="stage=4", microbatches=4, stage_boundaries=(1, 2, 3),
                    pipeline_impl="spmd")
    d = eq.run(cfg, steps=1, devices=4).strategy.describe()
    rows, widest = 16 // 4, max(pc.CNN_BOUNDARIES)
    assert d["boundary_elements_per_example"] == pc.CNN_BOUNDARIES
    assert d["padding_bytes_per_step"] == 2 * 4 * sum((widest - n) * rows * 4 for n in pc.CNN_BOUNDARIES)


@pytest.mark.parametrize("options,needle", [
    (dict(depth=1, mesh="stage=4"), "--depth"),                # 3 layers, 4 stages
    (dict(microbatches=5, mesh="stage=2"), "--microbatches"),
    (dict(stage_boundaries=(2, 2), mesh="stage=3"), "--stage-boundaries 2,2"),
    (dict(stage_boundaries=(6,), mesh="stage=2"), "0 stem, 1 block0"),
])
def test_bad_shapes_name_the_option(options, needle):
    base = {**STACK, **options}
    with pytest.raises(ConfigError, match=needle):
        eq.run(eq.config(strategy="pipeline", **base), steps=1, devices=int(options["mesh"][-1]))


def test_pipeline_mesh_must_have_a_stage_axis():
    with pytest.raises(MeshError, match="--mesh stage"):
        eq.run(eq.config(strategy="pipeline", mesh="data=2", **STACK), steps=1, devices=2)


@pytest.mark.parametrize("impl", IMPLS)
def test_describe_reports_schedule_and_bubble(impl):
    cfg = eq.config(strategy="pipeline", mesh="stage=2", microbatches=4, schedule="1f1b",
                    pipeline_impl=impl, **STACK)
    d = eq.run(cfg, steps=1, devices=2).strategy.describe()
    assert d["implementation"] == impl
    assert d["slots"] == 2 * (4 + 2 - 1) and d["bubble_fraction"] == pytest.approx(1 / 5)
    assert np.isclose(d["bubble_theory"], 1 / 5)


@requires_devices(4)
def test_host_stages_move_each_boundary_once_each_way_without_padding():
    """One program per stage: the CNN's stages take their own shapes, each micro-batch's
    activation crosses each boundary forward once and its gradient back once (no padding:
    the bytes the compiled programs send), no collective runs, and the compiled step is
    each stage's one program."""
    cfg = pc.config("cnn", strategy="pipeline", mesh="stage=4", microbatches=4,
                    stage_boundaries=(1, 2, 3), pipeline_impl="mpmd")
    t = eq.run(cfg, steps=1, devices=4)
    s, batch = t.strategy, t.strategy.place_batch(eq.batches(16, 1)[0])
    d = s.describe()
    assert d["boundary_elements_per_example"] == pc.CNN_BOUNDARIES and "padding_bytes_per_step" not in d
    assert d["stage_transfer_bytes_per_step"] == 2 * 16 * sum(pc.CNN_BOUNDARIES) * 4
    programs = s.compile("step", t.state, batch)
    assert programs.collective_bytes["total"] == 0
    assert {p.name: p.calls for p in programs.parts} == {f"rank_step{k}@0": 1 for k in range(4)}
    sends = [re.search(r"operand_layout_constraints=\{([a-z0-9]+\[[\d,]*\])", line).group(1)  # x's
             for p in programs.parts for line in p.executable.as_text().splitlines()
             if 'custom_call_target="jaxpar_chan_send"' in line]
    assert sum(measure.shape_bytes(x) for x in sends) == d["stage_transfer_bytes_per_step"]
    counts = dict(s.trace_counts)
    jax.device_get(s.step(t.state, batch)[1])
    assert dict(s.trace_counts) == counts  # the compiled stage programs ran: no retrace


@pytest.mark.parametrize("backend,impl", [("cpu", "mpmd"), ("gpu", "spmd"), ("tpu", "spmd")])
def test_auto_picks_the_formulation_by_backend(monkeypatch, backend, impl):
    from jaxpar.parallel.pipeline import strategy as pipeline_strategy
    from jaxpar.train import make_strategy
    monkeypatch.setattr(pipeline_strategy.jax, "default_backend", lambda: backend)
    assert pipeline_strategy.resolve_impl("auto") == impl
    for name in ("pipeline", "gems", "hybrid"):
        strategy = make_strategy(eq.config(strategy=name, microbatches=4, **STACK))
        assert strategy.implementation == impl and strategy.name == name


def test_hybrid_across_processes_takes_the_spmd_program(monkeypatch):
    """A hybrid stage's sub-mesh may span processes: auto keeps the one SPMD program there,
    and an explicit mpmd is refused with the fix."""
    from jaxpar.parallel.pipeline import hybrid
    from jaxpar.train import make_strategy
    monkeypatch.setattr(hybrid.jax, "process_count", lambda: 2)
    assert make_strategy(eq.config(strategy="hybrid", microbatches=4, **STACK)).implementation == "spmd"
    with pytest.raises(ConfigError, match="pipeline-impl spmd"):
        make_strategy(eq.config(strategy="hybrid", microbatches=4, pipeline_impl="mpmd", **STACK))


@requires_devices(8)
def test_hundreds_of_steps_with_a_program_per_stage_do_not_hang():
    """Every stage's program dispatched at once, their messages inside them (`host.column`):
    a stage that waited on one not yet started (8 programs at once on 2 cores), or a message
    lost, hangs or fails here."""
    from jaxpar.train import fit

    cfg = eq.config(strategy="pipeline", mesh="stage=8", microbatches=8, schedule="1f1b",
                    model="stack-mlp", width=16, depth=8, batch_size=32, steps=300,
                    synthetic_size=2000, val_size=100, epochs=1, pipeline_impl="mpmd", lr=0.01)
    out = fit(cfg)
    assert out.strategy.describe()["step_programs"].startswith("one per device")
    assert out.result.metrics["steps"] == 300 and np.isfinite(out.result.metrics["final_loss"])
