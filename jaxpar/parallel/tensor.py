"""`tensor`: Megatron-LM tensor parallelism (Shoeybi et al. 2019) in explicit `jax.shard_map`.

Each block's dense layers are split over the TENSOR axis: the first layer by columns
(`up`; in the ViT also `query`/`key`/`value`, whose column slices hold whole heads), the
second by rows (`down`; in the ViT also `out`). A device computes its slice of the hidden
units (its heads) from the whole input and a partial sum of the output; one `psum` over
TENSOR completes it, and the row layer's bias is added once, after the sum. Backward, the
input of the column layer needs the sum of every device's contribution: one more
all-reduce. So a stack-mlp block costs 2 all-reduces of its activation per step, a ViT
block 4 (attention and MLP each).

The block input is cast to varying over TENSOR explicitly (`lax.pcast`, Megatron's `f`
operator: identity forward, all-reduce backward), once per sub-block, so q, k and v share
one backward all-reduce. Everything outside the split layers is replicated and sees the
same (invariant) values on every device, so its gradient is already the whole gradient;
nothing is all-reduced for it over TENSOR. An optional DATA axis splits the batch as in
dp-shard-map.

Parameters keep their global shapes and are stored sharded (`NamedSharding`), so
`state_to_reference` is a gather and checkpoints move freely between strategies.

    python -m experiments train --strategy tensor --model vit --devices 4 --mesh data=2,tensor=2
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import data as datalib
from jaxpar import mesh as meshlib
from jaxpar import profile
from jaxpar import step as steplib
from jaxpar.config import ConfigError
from jaxpar.mesh import DATA, TENSOR
from jaxpar.models.mlp import ACTIVATIONS
from jaxpar.models.vit import TransformerBlock
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.blocks import BLOCKS, require_blocks
from jaxpar.parallel.dp_common import global_sums
from jaxpar.parallel.layout import map_param_trees

COLUMN = ("up", "query", "key", "value")  # split by output columns (whole heads for q/k/v)
ROW = ("down", "out")                     # split by input rows; output all-reduced


def param_specs(params) -> dict:
    """PartitionSpecs of the Megatron layout for a reference-layout parameter tree."""

    def spec(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        if len(keys) < 4 or keys[0] != BLOCKS:
            return P()
        layer, kind = keys[2], keys[3]
        if layer in COLUMN:
            return P(None, TENSOR) if kind == "kernel" else P(TENSOR)
        if layer in ROW and kind == "kernel":
            return P(TENSOR, None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def _row_parallel(linear: nnx.Linear, x: jax.Array) -> jax.Array:
    """x @ W summed over the TENSOR shards (THE all-reduce), then the bias, once."""
    return lax.psum(x @ linear.kernel[...], TENSOR) + linear.bias[...]


def _enter(h: jax.Array) -> jax.Array:
    """Megatron's `f`: identity forward; its transpose all-reduces the input's gradient."""
    return lax.pcast(h, TENSOR, to="varying")


class _MLPBlockTP(nnx.Module):
    """stack-mlp's ResidualBlock on this device's slice: h + psum(act(h @ up_i) @ down_i) + b."""

    def __init__(self, block):
        self.activation, self.up, self.down = block.activation, block.up, block.down

    def __call__(self, h):
        return h + _row_parallel(self.down, ACTIVATIONS[self.activation](self.up(_enter(h))))


class _ViTBlockTP(nnx.Module):
    """The ViT's TransformerBlock with this device's heads and MLP slice."""

    attention_heads = TransformerBlock.attention_heads  # heads read from the local q width

    def __init__(self, block):
        for name in ("head_dim", "ln1", "query", "key", "value", "out", "ln2", "up", "down"):
            setattr(self, name, getattr(block, name))

    def __call__(self, h):
        h = h + _row_parallel(self.out, self.attention_heads(_enter(self.ln1(h))))
        return h + _row_parallel(self.down, nnx.gelu(self.up(_enter(self.ln2(h)))))


TP_BLOCKS = {"ResidualBlock": _MLPBlockTP, "TransformerBlock": _ViTBlockTP}


class TensorLayout(Strategy):
    """The mesh, checks and Megatron parameter layout shared by `tensor` and `tensor-auto`."""

    default_axes = {DATA: 1, TENSOR: -1}
    uses_collectives = True

    def make_mesh(self, devices):
        axes = meshlib.parse_mesh(self.config.parallel.mesh)
        extra = [a for a, s in axes.items() if a not in (DATA, TENSOR) and s != 1]
        if extra:
            raise meshlib.MeshError(
                f"--strategy {self.name} uses the {DATA} and {TENSOR} axes; drop "
                f"{', '.join(extra)} from --mesh (or use --strategy hybrid)")
        if not axes:
            axes = dict(self.default_axes)
        elif TENSOR not in axes:
            axes = {DATA: axes[DATA], TENSOR: 1}
        else:  # the data axis takes whatever devices the tensor axis leaves
            axes = {DATA: axes.get(DATA, -1), TENSOR: axes[TENSOR]}
        return meshlib.make_mesh(axes, devices)

    def _setup(self, model, tx, mesh):
        """Check the model against the mesh; return the reference state."""
        self.mesh, self.tx = mesh, tx
        self.t, self.d = mesh.shape[TENSOR], mesh.shape[DATA]
        self.depth = require_blocks(model, self.name)
        block = getattr(model, BLOCKS)[0]
        width = block.up.in_features
        if width % self.t:
            raise ConfigError(f"--width {width} is not divisible by the tensor degree {self.t}; "
                              f"change --width or --mesh {TENSOR}=")
        if hasattr(block, "head_dim"):
            heads = block.query.out_features // block.head_dim
            if heads % self.t:
                raise ConfigError(f"the ViT's {heads} heads do not divide over {TENSOR}={self.t}; "
                                  f"choose --mesh {TENSOR}= a divisor of {heads}")
        self.row_layers = sum(1 for name in ROW if hasattr(block, name))
        self.graphdef, params, model_state = steplib.split_model(model)
        self.template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        self.param_specs = param_specs(params)
        # activation elements per example (the residual stream): what each all-reduce moves
        embed = lambda p, x: nnx.merge(self.graphdef, p, model_state).embed(steplib.normalize(x))
        act = jax.eval_shape(embed, params, jax.ShapeDtypeStruct((1, 28, 28, 1), jnp.uint8))
        self.act_bytes_per_example = int(np.prod(act.shape)) * act.dtype.itemsize
        ref = steplib.init_state(params, model_state, tx)
        self.state_specs = map_param_trees(ref, params, lambda t: param_specs(t), other=lambda _: P())
        self.state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.state_specs)
        # a size-1 DATA axis is left out of the specs: values then stay invariant over it
        self.batch_spec = P(DATA) if self.d > 1 else P()
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)
        return ref

    # --- batches and layouts ----------------------------------------------------------------
    def padded_size(self, batch_size: int) -> int:
        return -(-batch_size // self.d) * self.d

    def place_batch(self, batch):
        padded = datalib.pad_batch(batch, self.padded_size(len(batch["label"])))
        return jax.device_put(padded, self.batch_sharding)

    def state_to_reference(self, state):
        return jax.device_get(state)  # global arrays: gathering the shards is the reference layout

    def state_from_reference(self, ref):
        return jax.device_put(ref, self.state_shardings)

    # --- accounting -------------------------------------------------------------------------
    def describe(self) -> dict:
        return {**super().describe(),
                "axes": {DATA: "batch", TENSOR: "block hidden units / attention heads"}}

    def theory(self) -> dict[str, int]:
        """Megatron: per row-parallel layer one all-reduce of the activation forward and one
        backward (stack-mlp block: 2; ViT block: 4), of this device's rows of the batch. With
        a DATA axis, also dp-shard-map's all-reduce of this device's gradient slice plus 3 f32
        scalars."""
        rows = self.padded_size(self.config.data.batch_size) // self.d
        per_op = rows * self.act_bytes_per_example
        count = 2 * self.row_layers * self.depth if self.t > 1 else 0
        tensor_bytes = count * per_op
        data_bytes = 0
        if self.d > 1:
            local = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
                NamedSharding(self.mesh, s).shard_shape(x.shape), x.dtype), self.template, self.param_specs)
            data_bytes = profile.tree_bytes(local) + 12
        total = tensor_bytes + data_bytes
        out = {"tensor_all_reduces": count, "tensor_all_reduce_bytes": tensor_bytes,
               "data_all_reduce_bytes": data_bytes, "total": total}
        if total:
            out["all-reduce"] = total
        return out

    def accounting(self, step_stats, state):
        """The base figures plus parameter bytes per device (blocks ~1/T of the whole)."""
        out = super().accounting(step_stats, state)
        first = lambda x: x.addressable_shards[0].data.nbytes
        out["param_bytes_per_device"] = int(sum(first(x) for x in jax.tree.leaves(state.params)))
        out["block_param_bytes_per_device"] = int(sum(
            first(x) for x in jax.tree.leaves(state.params[BLOCKS])))
        out["block_param_bytes_total"] = profile.tree_bytes(self.template[BLOCKS])
        return out


class Tensor(TensorLayout):
    name = "tensor"

    def init(self, model, tx, mesh):
        ref = self._setup(model, tx, mesh)
        tp_model = nnx.clone(model)
        blocks = getattr(tp_model, BLOCKS)
        setattr(tp_model, BLOCKS, nnx.List([TP_BLOCKS[type(b).__name__](b) for b in blocks]))
        self.tp_graphdef = nnx.split(tp_model, nnx.Param, ...)[0]
        shard = functools.partial(jax.shard_map, mesh=mesh)
        ins = (self.state_specs, self.batch_spec)
        self._register("step", shard(self._step, in_specs=ins, out_specs=(self.state_specs, P())),
                       donate_argnums=0)
        self._register("gradients", shard(lambda s, b: self._grads(s, b)[0], in_specs=ins,
                                          out_specs=self.param_specs))
        self._register("eval_step", shard(self._eval, in_specs=ins, out_specs=P()))
        return self.state_from_reference(ref)

    def _grads(self, state, batch):
        denom = batch["weight"].sum()
        params = state.params
        if self.d > 1:  # dp-shard-map's recipe: varying params, one explicit psum over DATA
            denom = lax.psum(denom, DATA)
            params = lax.pcast(params, DATA, to="varying")
        # No reduction over TENSOR: replicated params see identical values on every device,
        # so their gradients are whole already; sharded params' gradients are their own slice.
        grads, (model_state, sums) = steplib.grad_fn(params, self.tp_graphdef, state.model_state,
                                                     batch, denom)
        if self.d > 1:
            grads = lax.psum(grads, DATA)
            sums = global_sums(sums, denom)
        return grads, model_state, sums

    def _step(self, state, batch):
        grads, model_state, sums = self._grads(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _eval(self, state, batch):
        sums = steplib.eval_step(self.tp_graphdef, state, batch)
        return lax.psum(sums, DATA) if self.d > 1 else sums
