"""Convolution and max-pooling chosen per backend: lax's (cuDNN on GPU), oneDNN's, or forms XLA:CPU runs fast.

Batch norm's per-backend forms, chosen by the same `conv_impl`, are in batchnorm.py.

    python -m experiments bench --model resnet --conv-impl onednn   # against cpu, xla

`conv_impl` (a model option, `--conv-impl`): "xla" = `lax.conv_general_dilated` and
`reduce_window` pooling, what cuDNN runs best; "cpu" = the forms below; "onednn" = the "cpu"
forms with every convolution and its gradients run by oneDNN (onednn.py); "auto" = "onednn" on
a CPU backend where oneDNN is installed and builds, else "cpu" there, and "xla" elsewhere,
resolved from `jax.default_backend()` when the model is built. Only the computation changes,
never the parameters: checkpoints load under any.

oneDNN's convolutions beat everything below (ResNet-8's step at batch 128 on 2 cores: cpu
94 ms, onednn 60 ms, run one after the other; the CNN's 30 -> 24 ms). The "cpu" forms stay
for machines without oneDNN (it ships for Linux x86-64 only) and as the record of what XLA
alone allows.

What XLA:CPU (JAX 0.10) runs slowly, and the replacement. Measured as process CPU time per
step of the default CNN (batch 128, Adam), interleaved in one process; the machine was shared,
so wall times were inflated and noisy while CPU times repeated within a few percent:
xla 137 ms, cpu 34 ms.
- 2x2 max-pooling's gradient (`select_and_scatter`) cost more than the rest of the step
  together. Here the pool is a reshape to [N, H/2, 2, W/2, 2, C] reduced over the window axes
  that records which of the four inputs won (int8), and the gradient is one select on that
  index. Ties go to the first maximum of the window, as lax's do, so the gradients equal lax's
  exactly, ties included.
- A convolution of a one-channel input (the stem on grayscale images: 9 multiply-adds per
  output) runs slowly as a lax convolution (52 ms with lax's stem instead of 34 ms). Here it
  is nine shifted multiply-adds, one elementwise fusion, and its kernel gradient is one
  [9, N*H*W] @ [N*H*W, C_out] matmul.
- A 1x1 convolution (ResNet's strided projections) is a strided slice and a matmul.
Everything else stays lax's, run by XLA's own multi-threaded (Eigen) convolution: jaxpar
turns XLA:CPU's default YNNPACK convolution off when it is imported (`jaxpar.mesh.
eigen_cpu_convolutions`), because YNNPACK runs each convolution on one thread: on 2 cores the
CNN's second convolution took 4.1 / 4.0 / 8.3 ms (forward / input / kernel gradient) there and
2.2 / 2.4 / 3.2 ms in Eigen, and the CNN step 22.7 ms against 14-18 ms. (The CPU-time
measurements below, made before, hid this: one thread's CPU time is the same either way.)
Each rewrite of the 3x3 convolution tried lost to lax's (CPU time):
- im2col for every convolution (nine shifted slices concatenated on the channel axis, one
  matmul: the issue's starting point): the CNN step took 1.2x (wall, quiet machine) to 2.6x
  (CPU, busy machine) as long; ResNet's 16-channel 28x28 convolutions with their gradients
  6x (the concatenation dominates);
- a kernel gradient as nine tap matmuls, or as an im2col matmul, under lax's forward:
  1.1-5x lax's own kernel gradient at every shape of the CNN and ResNet-8;
- the pooling gradient as four interior-padded `lax.pad`s: twice as fast alone, 1.7x slower
  inside the step (it fuses worse with the ReLU and the convolution around it);
- plain autodiff through the reshape-max (ties share the gradient): no faster than the
  index, and unlike lax on ties.
Tried later and lost too (default CNN, interleaved in one process):
- keeping the pool's winner index in memory (reductions, which XLA does not recompute)
  instead of recomputing it and the stem convolution in the backward pass: 7% faster at
  batch 64 on one core, 40% slower at batch 128 (one or two threads), as is the stem as a
  matmul whose output is kept; the recomputation costs arithmetic, the kept tensors memory
  traffic that no longer fits the caches;
- the kernel gradient of the 3x3 convolution as an NT matmul of transposed im2col patches
  (5.4 ms against lax's 3.8 at batch 64, one core), or over two batch halves (4.0);
- im2col built from taps padded one by one (far faster than padding first, yet the step
  took 36 ms at batch 64 on one core against 15);
- the XLA flags for XNNPACK, oneDNN, YNNPACK convolution fusion, 512-bit vectors and the
  concurrency-optimised scheduler (within noise, or slower).
ResNet-8 (batch 128, Adam; jax.profiler's per-op trace of the step, and pieces timed alone;
the machine was shared and loaded, so milliseconds are comparable within one run only):
its 3x3 convolutions themselves are ~20% of the step; ~25-40% goes to the transposed copies
that lax's kernel gradients make of their input ([N,H,W,C] -> [C,H,W,N], batch minor), 2.3 ms
alone for a 28x28x16 activation but 5-15 ms in the step, because XLA fuses the batch norm,
ReLU and residual add that produce the activation into the copy and recomputes them reading
every input with a stride of H*W*C; the rest is batch norm and elementwise passes. What won:
batch norm's closed-form backward (batchnorm.py: the step's CPU time 8-9% below the same
step with Flax's batch norm, 239 -> 218 ms under load; lax's forms: 243). What lost or
could not be had:
- the kernel gradient of a stride-1 convolution as one matmul of width-shifted input copies
  and height-shifted cotangent copies ([N*(H+2)*W, 3C]^T [N*(H+2)*W, 3C']): the copies (6x
  the activation) cost more than the transposes they replace (profiled op time 2x);
- the kernel gradient on the batch laid side by side along the width ([1, H+2, N*(W+2), C],
  so the copy lax makes moves the channels of one row, not the batch): correct, and 1.1-1.4x
  lax's at the three stride-1 shapes of ResNet-8 (a ReLU producer fused, as in the step);
- keeping the producer out of the transposed copy: `lax.optimization_barrier` is removed by
  XLA:CPU before fusion, and an identity `lax.cond` around the activation made the profiled
  step 2.5x slower; turning YNNPACK's reductions off too (`-reduce` in the flag above):
  8-10% slower;
- a stride-2 convolution as space-to-depth (2x2 stride-1 convolution on 4C channels): its
  forward and kernel gradient cost 2x lax's; its input gradient, which avoids lax's
  zero-inserted (lhs-dilated) convolution, wins at 28x28x16 -> 32 (10.5 -> 7.2 ms) and loses
  at 14x14x32 -> 64 (4.2 -> 6.7 ms): ~2% of the step, not taken.
Batch norm cost the CNN ~27 ms of its 61 ms step before batchnorm.py.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.errors import ConfigError
from jaxpar.models import onednn

CONV_IMPLS = ("auto", "xla", "cpu", "onednn")
_NHWC = ("NHWC", "HWIO", "NHWC")


def resolve_conv_impl(conv_impl: str) -> str:
    """"xla", "cpu" or "onednn" for `conv_impl`, reading the backend for "auto": oneDNN's
    convolutions on a CPU where they build (onednn.py), else the "cpu" forms; lax's elsewhere."""
    if conv_impl not in CONV_IMPLS:
        raise ConfigError(f"unknown --conv-impl {conv_impl!r}; choices: {', '.join(CONV_IMPLS)} "
                          "(auto: onednn, or cpu without oneDNN, on a CPU backend; xla elsewhere)")
    if conv_impl == "auto":
        if jax.default_backend() != "cpu":
            return "xla"
        return "cpu" if onednn.unavailable() else "onednn"
    if conv_impl == "onednn" and (why := onednn.unavailable()):
        raise ConfigError(f"--conv-impl onednn: {why}; use --conv-impl cpu or auto")
    return conv_impl


def _taps(x: jax.Array, kernel: tuple[int, int], strides: tuple[int, int],
          pads: tuple[tuple[int, int], ...]) -> list[jax.Array]:
    """The input each kernel tap (i, j) sees: padded `x` shifted by (i, j), every stride."""
    (kh, kw), (sh, sw) = kernel, strides
    x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    return [x[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw, :]
            for i in range(kh) for j in range(kw)]


def _lax_conv(x, w, strides, pads):
    return lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=_NHWC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _stem_conv(x, w, strides, pads):
    """Convolution of a one-channel input as multiply-adds of shifted copies (one fusion)."""
    kh, kw = w.shape[:2]
    taps = _taps(x, (kh, kw), strides, pads)
    return sum(tap * w[k // kw, k % kw, 0] for k, tap in enumerate(taps))


def _stem_fwd(x, w, strides, pads):
    return _stem_conv(x, w, strides, pads), (x, w)


def _stem_bwd(strides, pads, residuals, g):
    x, w = residuals
    kh, kw, _, cout = w.shape
    # Autodiff would reduce nine products over N*H*W separately; one matmul does all nine.
    patches = jnp.concatenate(_taps(x, (kh, kw), strides, pads), axis=-1)
    dw = jnp.dot(patches.reshape(-1, kh * kw).T, g.reshape(-1, cout)).reshape(w.shape)
    # The input gradient (of images: usually unused, and then compiled away) is lax's.
    dx = jax.vjp(lambda x: _lax_conv(x, w, strides, pads), x)[1](g)[0]
    return dx, dw


_stem_conv.defvjp(_stem_fwd, _stem_bwd)


def _pointwise_conv(x, w, strides, pads):
    """1x1 convolution: a strided slice and a matmul (autodiff's gradients are matmuls too)."""
    (tap,) = _taps(x, (1, 1), strides, pads)
    return jnp.dot(tap, w[0, 0])


def _plain(lhs, rhs, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
           precision, preferred_element_type) -> bool:
    """A float32 2-D NHWC/HWIO convolution without dilation, groups or precision settings."""
    dilated = any(d != 1 for d in (*(lhs_dilation or ()), *(rhs_dilation or ())))
    return (lhs.ndim == 4 and not dilated and feature_group_count == 1
            and lhs.dtype == rhs.dtype == jnp.float32
            and precision is None and preferred_element_type is None
            and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
            == lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC))


def _explicit(lhs, rhs, window_strides, padding):
    """(strides, ((top, bottom), (left, right))) of a 2-D convolution, padding resolved."""
    strides = tuple(window_strides)
    pads = (lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], strides, padding)
            if isinstance(padding, str) else padding)
    return strides, tuple(map(tuple, pads))


def cpu_conv(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
             padding: str | Sequence[tuple[int, int]], lhs_dilation=None, rhs_dilation=None,
             dimension_numbers=None, feature_group_count: int = 1, precision=None,
             preferred_element_type=None, **kwargs) -> jax.Array:
    """`lax.conv_general_dilated`, with the shapes XLA:CPU runs slowly computed another way.

    A drop-in `conv_general_dilated` for `nnx.Conv`: one-input-channel and 1x1 convolutions of
    2-D NHWC inputs take the forms above; every other call goes to lax unchanged.
    """
    kh, kw, cin, _ = rhs.shape
    if (_plain(lhs, rhs, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
               precision, preferred_element_type) and (cin == 1 or kh == kw == 1)):
        strides, pads = _explicit(lhs, rhs, window_strides, padding)
        return (_pointwise_conv if kh == kw == 1 else _stem_conv)(lhs, rhs, strides, pads)
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
        feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type, **kwargs)


def _pool_with_index(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """2x2 window maxima of even-sized NHWC `x` and which input won (0..3, first on ties)."""
    n, h, w, c = x.shape
    win = x.reshape(n, h // 2, 2, w // 2, 2, c)
    best, index = win[:, :, 0, :, 0], jnp.zeros((n, h // 2, w // 2, c), jnp.int8)
    for k in (1, 2, 3):  # window order (0,0) (0,1) (1,0) (1,1); `>` keeps the first of ties
        cand = win[:, :, k // 2, :, k % 2]
        wins = cand > best
        best, index = jnp.where(wins, cand, best), jnp.where(wins, jnp.int8(k), index)
    return best, index


@jax.custom_vjp
def _max_pool_even(x: jax.Array) -> jax.Array:
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def _pool_fwd(x):
    return _pool_with_index(x)


def _pool_bwd(index, g):
    n, h2, w2, c = g.shape
    window = jnp.arange(4, dtype=jnp.int8).reshape(1, 1, 2, 1, 2, 1)
    dx = jnp.where(index[:, :, None, :, None, :] == window, g[:, :, None, :, None, :], 0)
    return (dx.reshape(n, 2 * h2, 2 * w2, c),)


_max_pool_even.defvjp(_pool_fwd, _pool_bwd)


def cpu_max_pool(x: jax.Array) -> jax.Array:
    """2x2 stride-2 VALID max-pooling of NHWC `x` (odd sizes drop the last row/column, as lax)."""
    h, w = x.shape[1], x.shape[2]
    return _max_pool_even(x[:, :h - h % 2, :w - w % 2, :])


def xla_max_pool(x: jax.Array) -> jax.Array:
    """lax's 2x2 stride-2 VALID max-pooling (`reduce_window`), the reference and the GPU form."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def onednn_conv(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int],
                padding: str | Sequence[tuple[int, int]], lhs_dilation=None, rhs_dilation=None,
                dimension_numbers=None, feature_group_count: int = 1, precision=None,
                preferred_element_type=None, **kwargs) -> jax.Array:
    """`cpu_conv`, with every plain convolution (`_plain`: the models' all) by oneDNN
    (onednn.py): the one-channel stem too (its forward and kernel gradient in 1.0 ms against
    the nine multiply-adds' 2.0, ResNet-8's at batch 128)."""
    if _plain(lhs, rhs, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
              precision, preferred_element_type):
        return onednn.conv(lhs, rhs, *_explicit(lhs, rhs, window_strides, padding))
    return cpu_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                    dimension_numbers, feature_group_count, precision, preferred_element_type,
                    **kwargs)


CONV = {"xla": lax.conv_general_dilated, "cpu": cpu_conv, "onednn": onednn_conv}
POOL = {"xla": xla_max_pool, "cpu": cpu_max_pool, "onednn": cpu_max_pool}
