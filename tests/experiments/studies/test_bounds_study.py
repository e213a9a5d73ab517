"""The bounds study: `single` first at each device count, every model-parallel strategy beside
it with the limit it is held to, the pipelines as one program per stage on CPU; a bad device
count is refused before any work."""

import pytest

from experiments.studies import bounds
from jaxpar.errors import ConfigError


def test_plan_puts_single_first_and_states_each_limit():
    planned = bounds.bounds_points(bounds.BoundsConfig())
    schedules = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev"]
    assert [(n, label) for n, label, _, _ in planned][:10] == [
        (2, "single"), *((2, f"pipeline {s}") for s in schedules), (2, "gems"), (2, "tensor")]
    # the CNN's 4 layers hold 2 chunks on each of 2 devices, not on each of 4
    assert [label for n, label, _, _ in planned if n == 4] == [
        "single", "pipeline gpipe", "pipeline 1f1b", "pipeline zb-h1", "gems", "tensor"]
    limits = {(n, label): limit for n, label, _, limit in planned}
    assert limits[2, "pipeline gpipe"] == limits[2, "pipeline 1f1b"] == 1.3
    assert limits[2, "gems"] == limits[2, "tensor"] == 1.5
    assert {limits[4, label] for label in ("pipeline gpipe", "pipeline 1f1b", "gems", "tensor")} == {2.0}
    by = {(n, label): p.config for n, label, p, _ in planned}
    assert by[2, "pipeline 1f1b"].parallel.schedule == "1f1b" and by[2, "gems"].parallel.microbatches == 8
    assert by[4, "tensor"].parallel.mesh == "tensor=4" and by[4, "single"].model.model == "cnn"
    assert len({p.folder for _, _, p, _ in planned}) == len(planned)


def test_one_device_is_refused():
    with pytest.raises(ConfigError, match="--device-counts must be >= 2"):
        bounds.bounds_points(bounds.BoundsConfig(device_counts=(1, 2)))


def test_a_timeline_needs_stages_as_programs():
    """`bench --timeline` of a strategy that runs as one program is refused before any work."""
    import equivalence as eq
    from jaxpar.bench import benchmark

    with pytest.raises(ConfigError, match="--timeline needs stages run as separate programs"):
        benchmark(eq.config(strategy="single"), iters=1, warmup=0, matmul_peak=False, timeline=True)
