"""Mesh parsing and construction; errors name --mesh / --devices."""

import os

import jax
import pytest

from jaxpar import mesh
from jaxpar.mesh import DATA, STAGE, TENSOR, MeshError


def test_parse_and_resolve():
    assert mesh.parse_mesh("data=2,tensor=2") == {DATA: 2, TENSOR: 2}
    assert mesh.parse_mesh("") == {}
    assert mesh.resolve_axes({DATA: -1, TENSOR: 2}, 8) == {DATA: 4, TENSOR: 2}


def test_make_mesh_shapes():
    m = mesh.make_mesh({DATA: 2, TENSOR: 2, STAGE: 2})
    assert mesh.mesh_shape(m) == {DATA: 2, TENSOR: 2, STAGE: 2}
    m = mesh.make_mesh({DATA: -1}, jax.devices()[:4])
    assert mesh.mesh_shape(m) == {DATA: 4}


@pytest.mark.parametrize("spec", ["batch=2", "data", "data=x", "data=0"])
def test_bad_spec_names_mesh(spec):
    with pytest.raises(MeshError, match="--mesh"):
        mesh.parse_mesh(spec)


def test_mesh_larger_than_devices_names_devices():
    with pytest.raises(MeshError, match="--devices 16"):
        mesh.make_mesh({DATA: 16}, jax.devices()[:8])


def test_axes_that_do_not_multiply_to_device_count():
    with pytest.raises(MeshError, match="--devices|--mesh"):
        mesh.make_mesh({DATA: 3}, jax.devices()[:8])
    with pytest.raises(MeshError, match="--mesh"):
        mesh.make_mesh({DATA: -1, TENSOR: 3}, jax.devices()[:8])


def test_axis_names_are_constants():
    assert mesh.DATA == "data"


def test_over_processes_the_default_keeps_tensor_within_and_stage_across():
    axes = mesh.arrange({DATA: 2, TENSOR: 2, STAGE: 2})
    assert list(axes) == [STAGE, DATA, TENSOR]  # outermost first: the last sit within a process
    assert mesh.process_layout(axes, per_process=2) == {STAGE: "across", DATA: "across", TENSOR: "within"}
    assert mesh.process_layout(axes, per_process=4) == {STAGE: "across", DATA: "within", TENSOR: "within"}
    assert mesh.process_layout({STAGE: 4}, per_process=2) == {STAGE: "both"}
    assert mesh.process_layout({DATA: 1, TENSOR: 2}, per_process=1) == {TENSOR: "across"}  # size 1 left out
    text = mesh.describe_layout(axes, processes=4, per_process=2)
    assert text.startswith("mesh stage=2,data=2,tensor=2 on 4 processes x 2 device(s)")
    assert "tensor within each process" in text and "stage, data across processes" in text


def test_eigen_convolutions_unless_xla_flags_says_what_ynnpack_fuses(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    mesh.eigen_cpu_convolutions()
    assert mesh.EIGEN_CONVOLUTIONS_FLAG in os.environ["XLA_FLAGS"].split()
    mesh.eigen_cpu_convolutions()  # twice: still once
    assert os.environ["XLA_FLAGS"].split().count(mesh.EIGEN_CONVOLUTIONS_FLAG) == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot")
    mesh.eigen_cpu_convolutions()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=individual_dot"


def test_this_process_compiles_convolutions_outside_ynnpack():
    # The flag took effect (import jaxpar set it before the backend started): XLA's HLO for a
    # convolution holds a plain `convolution`, not a YNNPACK fusion (its one-thread path).
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU's code generation")
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    hlo = conv.lower(jax.numpy.ones((8, 14, 14, 32)), jax.numpy.ones((3, 3, 32, 64))).compile().as_text()
    assert " convolution(" in hlo and "__ynn_fusion" not in hlo
