"""Nothing CPU-only on a GPU: every choice jaxpar makes by backend follows the backend, which
each test fakes (there is no GPU here). Before JAX starts (XLA flags, one pinned thread per
device) the backend is what `mesh.cpu_backend_expected` foresees from JAX_PLATFORMS and the
installed plugins; after, `jax.default_backend()`.

    python -m pytest -q tests/test_backend_choices.py
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.runtime import distributed
from jaxpar import mesh, train
from jaxpar.errors import ConfigError
from jaxpar.models import cnn, layers, make_model, onednn, resnet
from jaxpar.parallel.data_parallel import common as dp_common


@pytest.fixture
def no_flags(monkeypatch):
    """XLA_FLAGS empty for the test (restored after), and affinity changes recorded, not made."""
    monkeypatch.setenv("XLA_FLAGS", "")
    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(set(cores)))
    return pinned


def fake_backend(monkeypatch, name: str) -> None:
    """Before JAX starts (no JAX_PLATFORMS, a plugin or none) and after (default_backend)."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(mesh, "accelerator_plugins", lambda: [] if name == "cpu" else ["xla_cuda13"])
    monkeypatch.setattr(jax, "default_backend", lambda: name)


@pytest.mark.parametrize("platforms, plugins, expected", [
    ("cpu", ["xla_cuda13"], True),        # JAX_PLATFORMS decides: the GPU plugin is not used
    ("cuda", [], False),
    ("cuda,cpu", [], False),              # the first named is the default backend
    ("", ["xla_cuda13"], False),          # a CUDA plugin installed: the GPU
    ("", ["libtpu"], False),
    ("", [], True),                       # nothing but jaxlib: the CPU
])
def test_the_backend_is_foreseen_before_jax_starts(monkeypatch, platforms, plugins, expected):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setattr(mesh, "accelerator_plugins", lambda: plugins)
    assert mesh.cpu_backend_expected() is expected


def test_an_installed_plugin_is_found_as_jax_finds_it(monkeypatch, tmp_path):
    (tmp_path / "jax_plugins" / "xla_fake").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "xla_fake" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    try:
        assert "xla_fake" in mesh.accelerator_plugins()
    finally:  # the fake namespace module must not outlive the test (monkeypatch restores
        sys.modules.pop("jax_plugins", None)  # only what it saw: nothing was there before)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_xla_cpu_flags_are_set_only_for_the_cpu(monkeypatch, no_flags, backend):
    fake_backend(monkeypatch, backend)
    mesh.eigen_cpu_convolutions()
    assert (mesh.EIGEN_CONVOLUTIONS_FLAG in os.environ["XLA_FLAGS"]) is (backend == "cpu")


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_one_pinned_thread_per_device_only_on_the_cpu(monkeypatch, no_flags, backend):
    fake_backend(monkeypatch, backend)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setenv("PMI_RANK", "1")  # rank 1 of 2, two devices each: cores 2 and 3
    monkeypatch.setenv("PMI_SIZE", "2")
    distributed.single_thread(devices=2)
    if backend == "cpu":
        assert mesh.single_threaded() and no_flags == [{2, 3}]
    else:
        assert os.environ["XLA_FLAGS"] == "" and no_flags == []


@pytest.mark.parametrize("backend, impl", [("cpu", "onednn"), ("gpu", "xla"), ("tpu", "xla")])
def test_layer_forms_follow_the_backend(monkeypatch, backend, impl):
    fake_backend(monkeypatch, backend)
    if backend == "cpu" and onednn.unavailable():
        impl = "cpu"  # oneDNN not installed here: the CPU's own forms
    assert layers.resolve_conv_impl("auto") == impl
    assert layers.resolve_conv_impl("xla") == "xla" and layers.resolve_conv_impl("cpu") == "cpu"  # asked for: kept
    model = cnn.CNN(rngs=nnx.Rngs(0))
    assert model.pool is layers.POOL[impl]
    assert model.conv1.conv_general_dilated is layers.CONV[impl]
    net = resnet.ResNet(rngs=nnx.Rngs(0))
    assert net.stem_conv.conv_general_dilated is layers.CONV[impl]


def test_onednn_is_refused_off_the_cpu(monkeypatch):
    fake_backend(monkeypatch, "gpu")
    assert onednn.unavailable() == "not on a CPU backend"
    with pytest.raises(ConfigError, match="not on a CPU backend"):
        layers.resolve_conv_impl("onednn")


@pytest.mark.parametrize("platforms, kept", [("cpu", True), ("cuda", False)])
def test_malloc_keeps_freed_memory_only_for_the_cpu(platforms, kept):
    """Set when `import jaxpar` runs (before JAX's threads allocate): a fresh process each."""
    env = {**os.environ, "JAX_PLATFORMS": platforms}
    env.pop("JAXPAR_MALLOC", None)
    state = subprocess.run([sys.executable, "-c", "import jaxpar; from jaxpar.runtime import host_memory; "
                            "print(host_memory.state())"], env=env, capture_output=True,
                           text=True, timeout=120, check=True).stdout.strip()
    assert state.startswith("kept") is kept, state


@pytest.mark.parametrize("backend, interval", [("cpu", 1), ("gpu", 10)])
def test_the_loop_waits_every_step_only_on_the_cpu(monkeypatch, backend, interval):
    fake_backend(monkeypatch, backend)
    assert train.sync_interval() == interval


@pytest.mark.parametrize("backend, loops", [("cpu", False), ("gpu", True)])
def test_gradient_accumulation_is_a_loop_except_on_the_cpu(monkeypatch, backend, loops):
    """XLA:CPU runs convolutions inside loops slowly: written out there, a scan elsewhere."""
    fake_backend(monkeypatch, backend)
    model = make_model("mlp", seed=0, depth=1, width=8)
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    images = np.random.default_rng(0).integers(0, 256, (8, 28, 28, 1)).astype(np.uint8)
    batch = {"image": images, "label": jnp.arange(8) % 10, "weight": jnp.ones(8)}
    text = str(jax.make_jaxpr(lambda p: dp_common.accumulated_grads(
        p, graphdef, state, batch, jnp.float32(8), k=4))(params))
    assert ("scan" in text) is loops
    grads, _ = dp_common.accumulated_grads(params, graphdef, state, batch, jnp.float32(8), k=4)
    whole, _ = dp_common.accumulated_grads(params, graphdef, state, batch, jnp.float32(8), k=1)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend, transfers_wanted", [("cpu", True), ("gpu", False)])
def test_moves_across_processes_are_transfers_only_on_the_cpu(monkeypatch, backend, transfers_wanted):
    """XLA:CPU's collective-permute makes the two processes take turns; on GPUs it rides NCCL."""
    from jaxpar.parallel.transport import transfers

    fake_backend(monkeypatch, backend)
    assert transfers.wanted() is transfers_wanted


@pytest.mark.parametrize("backend, processes, inside", [("cpu", 1, False), ("cpu", 2, True),
                                                        ("gpu", 1, True)])
def test_stage_programs_cut_inside_a_layer_where_each_stage_has_a_worker(monkeypatch, backend, processes, inside):
    """`pipeline`'s stage programs cut the CNN inside conv2 on accelerators and across
    processes; simulated CPU devices in one process share the cores `single` fills."""
    import equivalence as eq
    from jaxpar.train import make_strategy

    staged = make_strategy(eq.config(strategy="pipeline", microbatches=4, pipeline_impl="mpmd"))
    fake_backend(monkeypatch, backend)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    assert staged.cuts_inside_layers() is inside
