"""Moving optimizer state between layouts (`jaxpar/parallel/layout.py`) alongside parameters.

    python -m pytest -q tests/parallel/test_layout.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.parallel import layout


def test_param_shaped_fields_are_mapped_and_scalars_left_alone():
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    state = optax.adam(1e-3).init(params)  # (ScaleByAdamState(count, mu, nu), EmptyState())
    flat = layout.map_param_trees(state, params, lambda t: jax.tree.map(jnp.ravel, t))
    assert flat[0].mu["w"].shape == (6,) and flat[0].nu["w"].shape == (6,)
    assert flat[0].count.shape == ()  # the step count is not parameter-shaped
    assert jax.tree.structure(flat) == jax.tree.structure(state)


def test_abstract_holds_shapes_not_data():
    tree = layout.abstract({"w": np.ones((2, 3), np.float32)})
    assert tree["w"] == jax.ShapeDtypeStruct((2, 3), np.float32)


def test_fetch_brings_device_arrays_to_the_host():
    got = layout.host_copy({"x": jnp.arange(3)})
    assert isinstance(got["x"], np.ndarray) and got["x"].tolist() == [0, 1, 2]
