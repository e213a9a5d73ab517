"""Convolutions by oneDNN inside XLA:CPU programs: `--conv-impl onednn` (and "auto" on a CPU).

XLA:CPU's own convolutions run ResNet-8's 3x3, strided and 1x1 convolutions and their gradients
2-4x slower than oneDNN, the library PyTorch's CPU convolutions use (layers.py lists what was
tried within XLA). Here a 2-D NHWC convolution is three FFI custom calls (onednn.cc): the
forward, the input gradient and the kernel gradient, each a oneDNN primitive (its AVX-512 /
AVX2 kernels generated when the shape is first seen). Everything around them (batch norm,
ReLU, the residual adds, the optimizer) stays XLA's, fused as before.

Measured on this project's 2-core machine, batch 128, forward + input gradient + kernel
gradient of each ResNet-8 convolution (ms; XLA's then oneDNN's): 28x28x16->16 18.1 -> 8.1,
28x28x16->32 stride 2 21.3 -> 6.8, 14x14x32->32 18.1 -> 8.0, 7x7x64->64 17.7 -> 7.3; PyTorch's
own (channels-last) 2.5 + 3.0 + 2.4 for the first, jaxpar's 2.6 + 2.3 + 2.2. The step: ResNet-8
94 -> 60 ms, the CNN 30 -> 24 ms (with host_memory.py's malloc settings in both).

Threads: each call splits its batch into one chunk per thread of XLA's own intra-op pool and
runs every chunk as a one-threaded primitive on it, so the convolution uses exactly the
threads XLA uses (one per device under --single-thread) instead of an OpenMP team beside
them; one primitive on oneDNN's OpenMP threads measured the same alone and no better in
the step.

oneDNN comes from PyPI (`onednn-devel-cpu-gomp`: headers and library; a dependency on Linux
x86-64); the custom calls are built by the C++ compiler on first use (jaxpar/runtime/native.py,
seconds). PyPI's newer oneDNN (`onednn`, 3.13) is a SYCL build that pulls ~600 MB of Intel
runtimes, and ran these convolutions one-threaded only 4% faster than this 3.2: not worth it. Where either is missing, `unavailable()` says why and "auto" keeps the "cpu" forms.

Every strategy runs them: inside shard_map and pmap each device calls them on its own share;
a jit that XLA partitions (dp-auto, fsdp, tensor-auto, ...) splits each call as its operands
are split, by the batch and by channels (custom_partitioning: partial results summed over
the devices that hold them); vmap folds a batched input into the batch or writes one call
per element out.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import mesh
from jaxpar.runtime import native

SOURCE = Path(__file__).with_name("onednn.cc")
ONEDNN_PACKAGES = ("onednn-devel-cpu-gomp", "onednn-cpu-gomp")  # headers, and the library itself
VERSION = "2023.2.0"  # as pyproject.toml pins it (experiments/infra/node_carry.py carries it)
INSTALL = f"pip install {ONEDNN_PACKAGES[0]}=={VERSION}"
_FORWARD, _INPUT_GRAD, _KERNEL_GRAD = ("jaxpar_conv_forward", "jaxpar_conv_input_grad",
                                       "jaxpar_conv_kernel_grad")


def unavailable() -> str | None:
    """None when oneDNN's convolutions run here; else why not."""
    if jax.default_backend() != "cpu":
        return "not on a CPU backend"
    try:
        _library()
    except native.Unavailable as e:
        return str(e)
    return None


def _find(package: str, name: str) -> Path:
    """The installed file of `package` whose path ends in `name` (a wheel's files may live
    outside site-packages: these put headers in <prefix>/include, the library in <prefix>/lib)."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise native.Unavailable(f"oneDNN is not installed ({INSTALL})") from None
    for file in files:
        if file.as_posix().endswith(name):
            return Path(file.locate()).resolve()
    raise native.Unavailable(f"{package} has no {name}; reinstall it ({INSTALL})")


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The built custom calls, loaded and registered with XLA:CPU (once per process)."""
    include = _find(ONEDNN_PACKAGES[0], "include/oneapi/dnnl/dnnl.hpp").parents[2]
    lib = _find(ONEDNN_PACKAGES[1], "/libdnnl.so.3").parent
    flags = (f"-I{include}", "-fopenmp", str(lib / "libdnnl.so.3"), f"-Wl,-rpath,{lib}")
    return native.register(native.build_library(SOURCE, flags), {
        _FORWARD: "JaxparConvForward", _INPUT_GRAD: "JaxparConvInputGrad",
        _KERNEL_GRAD: "JaxparConvKernelGrad"})


class _Version(ctypes.Structure):  # dnnl_version_t (dnnl_common_types.h)
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


def used() -> dict | None:
    """oneDNN's version and the instruction set its kernels use on this CPU (what results
    record in env.ran), once its convolutions were loaded in this process; else None."""
    if _library.cache_info().currsize == 0:
        return None
    return _identity()


@functools.lru_cache(maxsize=None)
def _identity() -> dict:
    dnnl = ctypes.CDLL(str(_find(ONEDNN_PACKAGES[1], "/libdnnl.so.3")))
    dnnl.dnnl_version.restype = ctypes.POINTER(_Version)
    dnnl.dnnl_get_effective_cpu_isa.restype = ctypes.c_int
    v = dnnl.dnnl_version().contents
    isa = dnnl.dnnl_get_effective_cpu_isa()
    return {"version": f"{v.major}.{v.minor}.{v.patch}", "isa": _isa_names().get(isa, hex(isa))}


def _isa_names() -> dict[int, str]:
    """dnnl_cpu_isa_t's values -> names, read from the installed header (the enum grows with
    each oneDNN release)."""
    header = _find(ONEDNN_PACKAGES[0], "include/oneapi/dnnl/dnnl_types.h").read_text()
    body = header[:header.index("} dnnl_cpu_isa_t;")].rsplit("typedef enum {", 1)[1]
    return {int(value, 16): name for name, value in
            re.findall(r"dnnl_cpu_isa_(\w+) = (0x[0-9a-f]+)", body)}


def _call(target: str, out_shape, a, b, strides, pads):
    (sh, sw), ((pt, pb), (pl, pr)) = strides, pads
    out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    aval = jax.typeof(a)
    if getattr(aval, "mat", None) is not None and aval.mat.varying:
        # Inside shard_map: the result varies over the manual axes `a` varies over.
        out = jax.ShapeDtypeStruct(out_shape, jnp.float32, manual_axis_type=aval.mat,
                                   sharding=NamedSharding(aval.sharding.mesh, PartitionSpec()))
    call = jax.ffi.ffi_call(target, out)  # 4-D operands only: vmap is `_batchable`'s
    # --single-thread: one thread per device, as XLA's own ops get (0: all of XLA's pool).
    threads = np.int64(1 if mesh.single_threaded() else 0)
    return call(a, b, sh=np.int64(sh), sw=np.int64(sw), pt=np.int64(pt), pb=np.int64(pb),
                pl=np.int64(pl), pr=np.int64(pr), threads=threads)


def output_shape(x_shape, w_shape, strides, pads) -> tuple[int, int, int, int]:
    n, h, w, _ = x_shape
    kh, kw, _, cout = w_shape
    return (n, (h + sum(pads[0]) - kh) // strides[0] + 1,
            (w + sum(pads[1]) - kw) // strides[1] + 1, cout)


def _result_shape(target, size, strides, pads, a, b):
    """What `target` returns for operands `a`, `b`: `size` is the input's spatial size for the
    input gradient, the kernel's for the kernel gradient (neither follows from the operands)."""
    if target == _FORWARD:
        return output_shape(a.shape, b.shape, strides, pads)
    if target == _INPUT_GRAD:
        return (a.shape[0], *size, b.shape[2])
    return (*size, a.shape[3], b.shape[3])


_SPATIAL = frozenset("hwpqij")  # image and kernel window factors: never split


def _mesh_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry's mesh axes (None, one name, or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _split_plan(rule: str, specs) -> tuple[list[tuple], tuple, tuple[str, ...]]:
    """How the call runs split: for each operand and the result, the mesh axes of each of its
    dimensions, and the mesh axes to sum the local results over.

    `rule` names each dimension's factor ("b h w c, i j c o -> b p q o"); `specs` are the
    operands' PartitionSpecs as XLA proposes them. The batch keeps its axes, then the channel
    factors the result keeps (the forward's output channels, a gradient's channels), then the
    one summed over (the forward's input channels, the input gradient's output channels, the
    kernel gradient's batch), each taking its axes from the first operand split along it,
    unless another factor already took them; window factors are never split. A summed factor
    that is split leaves partial results, summed over its axes (a kernel gradient split by the
    batch, a forward split by input channels)."""
    inputs, result = rule.split("->")
    operands = [f.split() for f in inputs.split(",")]
    result = result.split()
    kept = [f for f in result if f not in _SPATIAL]
    summed = [f for op in operands for f in op if f not in _SPATIAL and f not in result]
    order = (["b"] if "b" in kept + summed else []) + [f for f in kept + summed if f != "b"]
    chosen, taken = {}, set()
    for factor in dict.fromkeys(order):
        for op, spec in zip(operands, specs):
            i = op.index(factor) if factor in op else len(op)
            entry = spec[i] if spec is not None and i < len(spec) else None  # specs may be short
            if entry is not None and not taken & set(_mesh_axes(entry)):
                chosen[factor] = entry
                taken |= set(_mesh_axes(entry))
                break
    args = [tuple(chosen.get(f) for f in op) for op in operands]
    sums = tuple(a for f in dict.fromkeys(summed) if f in chosen for a in _mesh_axes(chosen[f]))
    return args, tuple(chosen.get(f) for f in result), sums


def _partitioned(target: str, rule: str):
    """The call as XLA's SPMD partitioner may split it (jit over a mesh: dp-auto, fsdp,
    tensor-auto, hybrid, ...): each device runs it on its shares, as `_split_plan` reads them
    from the operands' shardings: by the batch (images split, kernels whole, the kernel
    gradient summed over devices) and by channels (a kernel split by output channels gives
    outputs split by channels; split by input channels, partial outputs summed), as
    tensor-auto's PartitionSpecs split them. Inside shard_map, or on one device, it is the
    plain call."""

    @functools.partial(custom_partitioning, static_argnums=(0, 1, 2))
    def call(size, strides, pads, a, b):
        return _call(target, _result_shape(target, size, strides, pads, a, b), a, b, strides, pads)

    def plan(device_mesh, arg_shapes):
        specs = [getattr(getattr(a, "sharding", None), "spec", None) for a in arg_shapes]
        args, out, sums = _split_plan(rule, specs)
        named = lambda spec: NamedSharding(device_mesh, PartitionSpec(*spec))  # noqa: E731
        return tuple(named(a) for a in args), named(out), sums

    def infer(size, strides, pads, device_mesh, arg_shapes, result_shape):
        return plan(device_mesh, arg_shapes)[1]

    def partition(size, strides, pads, device_mesh, arg_shapes, result_shape):
        args, out, sums = plan(device_mesh, arg_shapes)

        def lower(a, b):
            local = _call(target, _result_shape(target, size, strides, pads, a, b), a, b,
                          strides, pads)
            return jax.lax.psum(local, sums) if sums else local
        return device_mesh, lower, out, args

    call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                       sharding_rule=rule)
    return call


def _batchable(target: str, call):
    """`call` under vmap (a model vmapped over stages or micro-batches): images batched under
    an unbatched kernel fold into the batch; else one call per element, written out (XLA:CPU
    loops run convolutions slowly; custom_partitioning has no batching rule of its own)."""
    def bound(size, strides, pads, a, b):
        @jax.custom_batching.custom_vmap
        def one(a, b):
            return call(size, strides, pads, a, b)

        @one.def_vmap
        def rule(axis_size, in_batched, a, b):
            a_batched, b_batched = in_batched
            if a_batched and not b_batched and target != _KERNEL_GRAD:
                out = one(a.reshape(-1, *a.shape[2:]), b)
                return out.reshape(axis_size, -1, *out.shape[1:]), True
            return jnp.stack([one(a[i] if a_batched else a, b[i] if b_batched else b)
                              for i in range(axis_size)]), True

        return one(a, b)
    return bound


_forward = _batchable(_FORWARD, _partitioned(_FORWARD, "b h w c, i j c o -> b p q o"))
_input_grad = _batchable(_INPUT_GRAD, _partitioned(_INPUT_GRAD, "b p q o, i j c o -> b h w c"))
_kernel_grad = _batchable(_KERNEL_GRAD, _partitioned(_KERNEL_GRAD, "b h w c, b p q o -> i j c o"))


def conv(x: jax.Array, w: jax.Array, strides: tuple[int, int],
         pads: tuple[tuple[int, int], tuple[int, int]]) -> jax.Array:
    """NHWC float32 `x` convolved with HWIO `w` (explicit padding) by oneDNN."""
    _library()
    # Inside shard_map, an operand replicated over axes the other varies along (a kernel
    # beside per-device images; images beside a stage's own kernel) is cast to vary too: the
    # calls need operands that vary alike. Autodiff sums its gradient over those axes.
    x_type, w_type = (getattr(jax.typeof(v), "mat", None) for v in (x, w))
    if x_type is not None and w_type is not None:
        if extra := tuple(sorted(x_type.varying - w_type.varying)):
            w = jax.lax.pcast(w, extra, to="varying")
        if extra := tuple(sorted(w_type.varying - x_type.varying)):
            x = jax.lax.pcast(x, extra, to="varying")
    return _conv(x, w, strides, pads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x, w, strides, pads):
    return _forward(None, strides, pads, x, w)


def _conv_fwd(x, w, strides, pads):
    return _conv(x, w, strides, pads), (x, w)


def _conv_bwd(strides, pads, residuals, g):
    x, w = residuals
    dx = _input_grad(x.shape[1:3], strides, pads, g, w)  # compiled away when unused (images)
    dw = _kernel_grad(w.shape[:2], strides, pads, x, g)
    return dx, dw


_conv.defvjp(_conv_fwd, _conv_bwd)


_CALL_IN_HLO = re.compile(r"= f32\[([\d,]*)\][^\n]*custom_call_target=\"(jaxpar_conv_\w+)\""
                          r"[^\n]*operand_layout_constraints=\{f32\[([\d,]*)\](?:\{[\d,]*\})?, "
                          r"f32\[([\d,]*)\]")


def hlo_flops(hlo_text: str) -> float:
    """FLOPs of the calls in a compiled program's HLO text, which XLA's cost analysis cannot
    count (it gives each -1, added back here): 2 x the output's elements x the kernel's
    window x input channels, for the forward and for each gradient alike."""
    total = 0.0
    for result, target, first, second in _CALL_IN_HLO.findall(hlo_text):
        shapes = [tuple(int(d) for d in s.split(",") if d) for s in (result, first, second)]
        out, kernel = {_FORWARD: (shapes[0], shapes[2]), _INPUT_GRAD: (shapes[1], shapes[2]),
                       _KERNEL_GRAD: (shapes[2], shapes[0])}[target]
        total += 2.0 * math.prod(out) * math.prod(kernel[:3]) + 1.0
    return total
