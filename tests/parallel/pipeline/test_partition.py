"""Cutting a model's layers into stages (`jaxpar/parallel/pipeline/partition.py`): XLA's FLOPs per
layer, the min-max cut, and --stage-boundaries checked with the fix named.

    python -m pytest -q tests/parallel/pipeline/test_partition.py
"""

import itertools
import random

import pytest

from jaxpar.config import ModelConfig, TrainConfig, with_options
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline import partition


def test_a_linear_layers_training_flops_are_three_matmuls():
    """forward x W, backward dW = x^T g and dx = g W^T: 6 in out FLOPs per example (the bias,
    ReLU and their gradients add a few per output); the first layer has no dx."""
    layers = dict(partition.model_layers(ModelConfig("mlp", width=256, depth=2)))
    assert layers["hidden1"] == pytest.approx(6 * 256 * 256, rel=0.01)
    assert layers["hidden0"] == pytest.approx(4 * 784 * 256, rel=0.01)


def test_flops_come_from_the_compiled_program_where_the_lowered_one_has_none(monkeypatch):
    """A backend that analyses only compiled programs (jax 0.11's CUDA plugin: a GPU profile
    had every layer at zero FLOPs) still gives each layer its FLOPs."""
    import jax

    want = dict(partition.model_layers(ModelConfig("mlp", width=64, depth=1)))
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    partition._model_layers.cache_clear()
    try:
        got = dict(partition.model_layers(ModelConfig("mlp", width=64, depth=1)))
    finally:
        partition._model_layers.cache_clear()
    assert got.keys() == want.keys()
    assert all(0.5 * want[k] < got[k] <= want[k] for k in want)  # XLA simplifies a little


def test_the_cnns_second_conv_costs_most():
    names, costs = zip(*partition.model_layers(ModelConfig("cnn")))
    assert names == ("conv1", "conv2", "fc1", "fc2")
    assert max(costs) == costs[1] > sum(costs) / 2  # 4% of the parameters, most of the work


def test_the_cut_minimises_the_largest_stage():
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.randint(1, 20) for _ in range(rng.randint(2, 8))]
        stages = rng.randint(1, len(costs))
        starts = partition.balanced(costs, stages)
        assert starts[0] == 0 and len(starts) == stages and list(starts) == sorted(set(starts))

        def worst(cut):
            ends = (*cut[1:], len(costs))
            return max(sum(costs[a:b]) for a, b in zip(cut, ends))

        best = min(worst((0, *c)) for c in itertools.combinations(range(1, len(costs)), stages - 1))
        assert worst(starts) == best


def test_boundaries_override_the_cut_and_bad_ones_name_the_fix():
    config = with_options(TrainConfig(), model="cnn", stage_boundaries=(1, 3))
    assert partition.cut(config, 3) == (0, 1, 3)
    names = partition.layer_names(config.model)
    assert partition.boundary_problems(None, names, 4) == []
    for bad, stages in (((3, 1), 3), ((1,), 3), ((0, 2), 3), ((1, 4), 3)):
        (problem,) = partition.boundary_problems(bad, names, stages)
        assert "--stage-boundaries" in problem and "0 conv1, 1 conv2, 2 fc1, 3 fc2" in problem
    (problem,) = partition.boundary_problems(None, names, 5)
    assert "--mesh stage=5" in problem and "4 layers" in problem
    with pytest.raises(ConfigError, match="--stage-boundaries 3,1"):
        partition.cut(with_options(config, stage_boundaries=(3, 1)), 3)
