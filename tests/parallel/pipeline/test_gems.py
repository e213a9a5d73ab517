"""`gems` (two bidirectional replicas on the same stages) equals `single` on its combined
batch; its bubble is below GPipe's at the same M; its bytes equal theory.

Both replicas' micro-batches make one global batch, their gradients are summed across the
mirror devices, so the parameters stay one model: step-1 gradients, parameters after 5
SGD steps and losses equal `single` (the ResNet: the per-micro-batch reference).

    python -m pytest -q tests/parallel/pipeline/test_gems.py
"""

import jax
import pytest

import equivalence as eq
import pipeline_cases as pc
from conftest import requires_devices
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline import schedules


CUTS = [("mlp", 2), ("mlp", 4), ("cnn", 2), ("cnn", 4), ("resnet", 2)]


@requires_devices(4)
@pytest.mark.parametrize("model,stages,impl",  # the SPMD program on its lighter cases
                         [(*c, "mpmd") for c in CUTS] + [(*c, "spmd") for c in CUTS[:3]])
def test_gems_equals_single_on_its_combined_batch(model, stages, impl):
    cfg = pc.config(model, strategy="gems", mesh=f"stage={stages}", microbatches=4, pipeline_impl=impl)
    got = eq.run(cfg, steps=5, devices=stages)
    pc.assert_equivalent(pc.reference(model, 4), got)
    s = got.strategy
    ref_state = s.state_to_reference(got.state)
    eq.assert_tree_close(ref_state, s.state_to_reference(s.state_from_reference(ref_state)))
    # both copies of every stage stayed one model, bit for bit
    if impl == "spmd":  # device d's second copy is stage S-1-d
        rows = jax.device_get(got.state.params["rep"])
        for d in range(stages):
            assert (rows[d, 1] == rows[stages - 1 - d, 0]).all()
    else:  # copies in the order (replica, stage); replica 1's stage s on device S-1-s
        params = jax.device_get(got.state.params)
        for st in range(stages):
            assert jax.tree.all(jax.tree.map(lambda a, b: (a == b).all(), params[st], params[stages + st]))
            on = {d for leaf in jax.tree.leaves(got.state.params[stages + st]) for d in leaf.devices()}
            assert on == {s.devices[stages - 1 - st]}


@requires_devices(4)
def test_bubble_below_gpipe_and_bytes_equal_theory():
    cfg = pc.config("cnn", strategy="gems", mesh="stage=4", microbatches=4, pipeline_impl="spmd")
    got = eq.run(cfg, steps=1, devices=4)
    s = got.strategy
    d = s.describe()
    assert d["bubble_fraction"] == pytest.approx(schedules.gems_bubble_theory(4, 4)) == pytest.approx(0.2)
    assert d["bubble_fraction"] < schedules.bubble_theory(4, 4)  # GPipe's and 1F1B's 3/7
    assert max(d["peak_in_flight_per_stage"]) == 4                # 1F1B's busiest stage: S
    programs = s.compile("step", got.state, s.place_batch(eq.batches(16, 1)[0]))
    eq.assert_explicit_collectives_equal_theory(s.accounting(programs, got.state))


@requires_devices(2)
def test_two_copies_of_the_parameters_per_device():
    """GEMS's price: every device holds two stages (one per replica) where a pipeline holds one."""
    spmd = dict(mesh="stage=2", microbatches=4, pipeline_impl="spmd")
    pipe = eq.run(pc.config("mlp", strategy="pipeline", **spmd), steps=1, devices=2)
    gems = eq.run(pc.config("mlp", strategy="gems", **spmd), steps=1, devices=2)
    size = lambda t: t.state.params["rep"].addressable_shards[0].data.size  # noqa: E731
    assert size(gems) == 2 * size(pipe)
    # one program per stage: device d holds stages d and S-1-d, each at its own size
    host = eq.run(pc.config("mlp", strategy="gems", mesh="stage=2", microbatches=4, pipeline_impl="mpmd"),
                  steps=1, devices=2)
    per_device = {}
    for copy in host.state.params:
        for leaf in jax.tree.leaves(copy):
            (device,) = leaf.devices()
            per_device[device] = per_device.get(device, 0) + leaf.size
    assert set(per_device.values()) == {sum(x.size for x in jax.tree.leaves(host.params))}
    d = host.strategy.describe()
    assert d["bubble_fraction"] < schedules.bubble_theory(2, 4) and d["implementation"] == "mpmd"


@pytest.mark.parametrize("options,needle", [(dict(mesh="stage=3"), "even number of stages"),
                                            (dict(mesh="stage=2", microbatches=3), "must be even")])
def test_odd_stages_or_microbatches_name_the_option(options, needle):
    cfg = eq.config(model="mlp", strategy="gems", width=32, depth=3, batch_size=24,
                    **{"microbatches": 4, **options})
    with pytest.raises(ConfigError, match=needle):
        eq.run(cfg, steps=1, devices=int(options["mesh"][-1]))
