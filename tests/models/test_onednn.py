"""oneDNN's convolutions (`--conv-impl onednn`) equal lax's: forward, input and kernel gradient,
at every geometry the models use and a few they do not, under vmap, shard_map and a jit that
XLA partitions (by the batch, by channels); and where oneDNN is missing, "auto" keeps the "cpu" forms and says why.

    python -m pytest -q tests/models/test_onednn.py
"""

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.models import layers, onednn

from conftest import requires_devices

pytestmark = pytest.mark.skipif(onednn.unavailable() is not None,
                                reason=f"oneDNN's convolutions unavailable: {onednn.unavailable()}")

NHWC = ("NHWC", "HWIO", "NHWC")


def normal(*shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def value_and_grads(conv, x, w, strides, padding):
    """A generic scalar of the output and its gradients w.r.t. the input and the kernel."""
    def loss(x, w):
        y = conv(x, w, strides, padding, dimension_numbers=NHWC)
        return jnp.sum(jnp.sin(y) * jnp.cos(y + 1.0))
    return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)


def assert_close(got, want, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("batch, size, cin, cout, kernel, stride, padding", [
    (8, 28, 1, 16, 3, 1, "SAME"),      # the stem (one channel)
    (8, 28, 16, 16, 3, 1, "SAME"),     # ResNet-8's convolutions ...
    (8, 28, 16, 32, 3, 2, "SAME"),     # ... strided
    (8, 28, 16, 32, 1, 2, "SAME"),     # ... 1x1 strided projection
    (8, 7, 64, 64, 3, 1, "SAME"),
    (5, 9, 3, 5, 3, 2, "VALID"),       # an odd batch: chunks of unequal size
    (1, 7, 4, 6, 3, 1, ((2, 0), (1, 3))),  # one image, uneven explicit padding
    (3, 6, 2, 3, (3, 1), (1, 2), "SAME"),  # a non-square kernel and strides
])
def test_equals_lax(batch, size, cin, cout, kernel, stride, padding):
    kh, kw = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    strides = stride if isinstance(stride, tuple) else (stride, stride)
    # He-scaled kernel: outputs of order 1, where sin and cos do not amplify rounding.
    x, w = normal(batch, size, size, cin, seed=0), normal(kh, kw, cin, cout, seed=1) / np.sqrt(kh * kw * cin)
    assert_close(value_and_grads(layers.onednn_conv, x, w, strides, padding),
                 value_and_grads(lax.conv_general_dilated, x, w, strides, padding))


@pytest.mark.parametrize("kernels", [3, None], ids=["kernel-per-element", "shared-kernel"])
def test_under_vmap_equals_lax(kernels):
    x = normal(3, 4, 10, 10, 5, seed=2)
    w = normal(*((kernels,) if kernels else ()), 3, 3, 5, 7, seed=3) / np.sqrt(45)

    def stacked(conv):
        one = lambda x, w: conv(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
        loss = lambda x, w: jnp.sum(jnp.sin(jax.vmap(one, (0, 0 if kernels else None))(x, w)))
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
    assert_close(stacked(layers.onednn_conv), stacked(lax.conv_general_dilated))


@requires_devices(2)
def test_a_batch_split_by_xla_stays_split():
    """Under a jit whose batch is sharded, each device convolves its share: no image is
    gathered (the calls' partitioning rule), and the kernel gradient is summed over devices."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    x = jax.device_put(normal(8, 14, 14, 8, seed=4), NamedSharding(mesh, P("data")))
    w = jax.device_put(normal(3, 3, 8, 16, seed=5) / np.sqrt(72), NamedSharding(mesh, P()))

    def loss(conv):
        return lambda x, w: jnp.sum(jnp.tanh(conv(x, w, (1, 1), "SAME", dimension_numbers=NHWC)))
    grads = jax.jit(jax.grad(loss(layers.onednn_conv), (0, 1)))
    assert_close(grads(x, w), jax.jit(jax.grad(loss(lax.conv_general_dilated), (0, 1)))(x, w))
    text = grads.lower(x, w).compile().as_text()
    assert "all-gather" not in text
    assert text.count("all-reduce(") >= 1  # the kernel gradient's sum


@requires_devices(2)
@pytest.mark.parametrize("split", ["output", "input"])
def test_a_channel_split_by_xla_stays_split(split):
    """A kernel sharded by output channels (tensor-auto's first layer of a pair) or by input
    channels (the second) is convolved where it lies: no kernel or image is gathered, and
    the partial sums of the input-channel split (its forward, and the output split's input
    gradient) are summed across the devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))  # Auto axes, as tensor-auto's
    kernel_spec = P(None, None, None, "tensor") if split == "output" else P(None, None, "tensor")
    image_spec = P() if split == "output" else P(None, None, None, "tensor")
    x = jax.device_put(normal(8, 14, 14, 8, seed=6), NamedSharding(mesh, image_spec))
    w = jax.device_put(normal(3, 3, 8, 16, seed=7) / np.sqrt(72), NamedSharding(mesh, kernel_spec))

    def loss(conv):
        return lambda x, w: jnp.sum(jnp.tanh(conv(x, w, (1, 1), "SAME", dimension_numbers=NHWC)))
    grads = jax.jit(jax.grad(loss(layers.onednn_conv), (0, 1)), out_shardings=(
        NamedSharding(mesh, image_spec), NamedSharding(mesh, kernel_spec)))
    got = grads(x, w)
    assert_close(got, jax.jit(jax.grad(loss(lax.conv_general_dilated), (0, 1)))(x, w))
    assert got[1].sharding.spec == kernel_spec
    text = grads.lower(x, w).compile().as_text()
    assert "all-gather" not in text
    assert text.count("all-reduce(") >= 1


def test_unavailable_keeps_the_cpu_forms_and_says_how_to_install(monkeypatch):
    def missing(package):
        raise importlib.metadata.PackageNotFoundError(package)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    onednn._library.cache_clear()
    try:
        assert "pip install onednn-devel-cpu-gomp" in onednn.unavailable()
        assert layers.resolve_conv_impl("auto") == "cpu"
        with pytest.raises(ConfigError, match="--conv-impl cpu"):
            layers.resolve_conv_impl("onednn")
    finally:
        monkeypatch.undo()
        onednn._library.cache_clear()
    assert onednn.unavailable() is None and layers.resolve_conv_impl("auto") == "onednn"
