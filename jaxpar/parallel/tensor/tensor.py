"""`tensor`: Megatron-style tensor parallelism written out in `jax.shard_map`.

Shoeybi et al. 2019, fig. 3; `_TensorBase` is what it shares with `tensor-auto`.

Each block is split as `jaxpar.parallel.tensor.megatron` says: column-parallel `up` (and the ViT's
`query`/`key`/`value`, whole heads per device), row-parallel `down`/`out` whose partial
products meet in one `psum` over TENSOR, one all-reduce per sub-block forward and one
backward. Each ResNet block's conv pair splits the same way by channels (first conv by
output channels, second by input channels, one all-reduce); the CNN splits every layer
(conv1 over the batch's rows, conv2 and fc1 by output channels and features, fc2 by input
rows, reduce-scattered over the batch; `jaxpar.parallel.tensor.channels`). Stems, heads,
LayerNorms and the position embedding are replicated. A DATA axis, if the mesh has one,
shards the batch (batch norm then normalises per data shard).

    python -m experiments train --strategy tensor --mesh tensor=2 --devices 2 --model cnn \
        --dataset synthetic --steps 20
"""

from __future__ import annotations

import functools
import math

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.tensor import cost
from jaxpar import data as datalib
from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.mesh import DATA, TENSOR
from jaxpar.models import CNN, ResNet, ViT
from jaxpar.parallel.tensor import channels, comm_forms, megatron
from jaxpar.parallel.transport import processes
from jaxpar.parallel.base import Strategy


def param_specs(params) -> dict:
    """PartitionSpec per leaf from its path (`megatron.param_spec`): Megatron column/row
    splits inside blocks, channel splits of conv pairs, everything else replicated. Also
    for batch-norm statistics (they follow their channels)."""
    def spec(path, _):
        return megatron.param_spec(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path))
    return jax.tree_util.tree_map_with_path(spec, params)


def state_specs(state: steplib.TrainState, tx, pspecs) -> steplib.TrainState:
    """Specs for the whole TrainState: optimizer moments follow their parameters."""
    ospecs = optax.tree_map_params(tx, lambda _, s: s, state.opt_state, pspecs,
                                   transform_non_params=lambda _: P(),
                                   is_leaf=lambda x: isinstance(x, P))
    return steplib.TrainState(step=P(), params=pspecs, opt_state=ospecs,
                              model_state=param_specs(state.model_state))


def sharded_names(pspecs) -> list[str]:
    """Layer/kind names that are split, e.g. ['up.kernel', 'up.bias', 'down.kernel']."""
    names = []
    for path, spec in jax.tree_util.tree_flatten_with_path(pspecs, is_leaf=lambda x: isinstance(x, P))[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        name = ".".join(keys[2:]) if keys[0] == "blocks" else ".".join(keys)
        if spec != P() and name not in names:
            names.append(name)
    return names


def local_param_bytes(params) -> int:
    """Parameter bytes held by the first device (its shards plus the replicated rest)."""
    return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params)))


class _TensorBase(Strategy):
    """What `tensor` and `tensor-auto` share: mesh checks, the sharded state, accounting."""

    cost_model = staticmethod(cost.tensor)

    family = "model parallel"
    # blocks whose layers split column -> row; the CNN's and ResNet blocks' conv pairs by channels
    models = ("cnn", "resnet", "stack-mlp", "vit")
    default_axes = {TENSOR: -1}
    options = ("steps_per_dispatch",)
    axes = (DATA, TENSOR)
    comm = comm_forms.NATIVE  # the CNN split's gathers and scatters (`tensor` chooses per mesh)
    multiprocess = True  # one global mesh under jax.distributed (tensor within a process by default)

    @classmethod
    def check(cls, config, axes):
        return megatron.split_problems(config, axes.get(TENSOR, 1), cls.name)

    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        shape = meshlib.mesh_shape(mesh)
        self.degree, self.data = shape.get(TENSOR, 1), shape.get(DATA, 1)
        megatron.check_divisible(model, self.degree, self.name)
        self.model = model  # for the theory, read from its shapes
        self.graphdef, params, model_state = steplib.split_model(model)
        ref = steplib.init_state(params, model_state, tx)
        self.pspecs = param_specs(params)
        self.specs = state_specs(ref, tx, self.pspecs)
        self.shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                                      is_leaf=lambda x: isinstance(x, P))
        self.batch_axes = self._batch_axes(shape)
        self.batch_spec = P(self.batch_axes) if self.batch_axes else P()
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)
        self._build_programs()
        state = self.state_from_reference(ref)
        self.param_bytes = local_param_bytes(state.params)
        return state

    def _build_programs(self) -> None:
        raise NotImplementedError

    def _batch_axes(self, shape: dict) -> tuple[str, ...]:
        """The mesh axes the batch's rows are sharded over."""
        return (DATA,) if DATA in shape else ()

    def rows_multiple(self) -> int:
        # every mesh axis the batch's rows are sharded over divides them
        return math.prod(meshlib.mesh_shape(self.mesh)[axis] for axis in self.batch_axes)

    def place_batch(self, batch):
        return processes.place(self.pad(batch), self.batch_sharding)

    def state_from_reference(self, ref):
        return processes.place(ref, self.shardings)

    def theory(self) -> dict[str, int]:
        batch_local = self.config.data.batch_size // self.data
        if isinstance(self.model, (CNN, ResNet)):  # channel-split conv pairs
            shape = datalib.spec(self.config.data).image_shape
            ops = channels.split_collective_bytes(self.model, batch_local, shape, self.degree) if self.degree > 1 else {}
            if self.degree > 1 and self.comm is comm_forms.PERMUTE:
                ops = channels.as_permutes(ops, self.degree, denominator=self.data == 1)
            if self.data > 1:  # over DATA: the gradient and the 3 metric sums; the CNN's
                # scattered rows also sum the weight total (its loss denominator) on its own
                sums = 3 + (1 if channels.scatters_rows(self.model) and self.degree > 1 else 0)
                ops["all-reduce"] = ops.get("all-reduce", 0) + self.param_bytes + sums * cost.F32
            return {**ops, "total": sum(ops.values())}
        total = cost.tensor_collective_bytes(
            batch_local=batch_local, width=self.model.blocks[0].up.in_features,
            depth=len(self.model.blocks), degree=self.degree, vit=isinstance(self.model, ViT),
            data=self.data, param_bytes_local=self.param_bytes)
        return {"total": total}

    def accounting(self, programs, state) -> dict:
        return {**super().accounting(programs, state), "param_bytes_per_device": self.param_bytes}

    def describe(self):
        return {**super().describe(), "tensor_degree": self.degree, "data_degree": self.data,
                "sharded_params": sharded_names(self.pspecs),
                "replicated": "stems, pos_embed, LayerNorms, heads, row-layer biases, shortcuts",
                "param_bytes_per_device": self.param_bytes}


class Tensor(_TensorBase):
    name = "tensor"
    summary = ("Megatron column->row split over `tensor` in `jax.shard_map` (stack-mlp MLP "
               "blocks; ViT heads; the CNN's layers; ResNet conv pairs by channels)")

    def _build_programs(self):
        # only the CNN's split gathers and scatters (`channels.cnn_layers`); the blocks' psums stay XLA's
        self.comm = comm_forms.choose(self.mesh) if channels.scatters_rows(self.model) else comm_forms.NATIVE
        batch_specs = {"image": self.batch_spec, "label": self.batch_spec,
                       "weight": self.batch_spec}
        smap = functools.partial(jax.shard_map, mesh=self.mesh)
        step = smap(self._local_step, in_specs=(self.specs, batch_specs),
                    out_specs=(self.specs, P()))
        grads = smap(self._local_grads, in_specs=(self.specs, batch_specs),
                     out_specs=self.pspecs)
        evals = smap(self._local_eval, in_specs=(self.specs, batch_specs), out_specs=P())
        self._register("step", step, donate_argnums=0)
        self._register("gradients", grads)
        self._register("eval_step", evals)

    def describe(self):
        # the form of the CNN split's gathers and scatters (comm_forms: permutes across CPU processes)
        return {**super().describe(), "collective_form": self.comm.name}

    def _batch_axes(self, shape: dict) -> tuple[str, ...]:
        # The CNN's split reads B/T rows of the batch per device (`channels.scatters_rows`)
        rows = (TENSOR,) if channels.scatters_rows(self.model) else ()
        return super()._batch_axes(shape) + rows

    def _loss(self, params, model_state, batch, denom, train=True):
        """The loss of this device's shard of the model, its metric sums and batch-norm
        statistics after the call."""
        model = nnx.merge(self.graphdef, params, model_state)
        h = steplib.normalize(batch["image"])
        for layer, split in zip(model.layers(), megatron.split_layers(model, self.comm)):
            h = (split or layer)(h, train)
        scattered = channels.scatters_rows(model)
        if scattered:  # each device holds B/T rows' logits: its loss over the whole batch's weight
            denom = self.comm.total(batch["weight"].sum(), TENSOR) if denom is None else denom
        loss, sums = steplib.loss_from_logits(h, batch, denom)
        if scattered:
            sums = jax.lax.psum(sums, TENSOR)
        new_state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))) if train else model_state
        return loss, (new_state, sums)

    def _grads_and_sums(self, state, batch):
        params, denom = state.params, None
        if self.data > 1:
            # Per-shard loss over the global weight total, params cast DATA-varying so the
            # gradient is this shard's share, summed explicitly below (not implicitly).
            params = jax.lax.pcast(params, DATA, to="varying")
            denom = jax.lax.psum(batch["weight"].sum(), self.batch_axes)
        grads, (model_state, sums) = jax.grad(self._loss, has_aux=True)(
            params, state.model_state, batch, denom)
        if self.data > 1:
            grads, sums = jax.lax.psum((grads, sums), DATA)
            model_state = jax.lax.pmean(model_state, DATA)
        return grads, model_state, sums

    def _local_step(self, state, batch):
        grads, model_state, sums = self._grads_and_sums(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _local_grads(self, state, batch):
        return self._grads_and_sums(state, batch)[0]

    def _local_eval(self, state, batch):
        _, (_, sums) = self._loss(state.params, state.model_state, batch, None, train=False)
        return jax.lax.psum(sums, DATA) if self.data > 1 else sums
