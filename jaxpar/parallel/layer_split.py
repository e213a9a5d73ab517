"""`layer-split`: naive model parallelism, consecutive layers on consecutive devices.

The model parallelism of the early papers: the model's layers (`model.layers()`, any model)
are cut into S consecutive stages balanced by FLOPs (`jaxpar.parallel.partition`, or
`--stage-boundaries`); stage s lives on device s, and one whole batch goes through them in
turn, so one device works at a time: the baseline a pipeline beats.

Each stage has its own jitted programs on its own device, so stages of any shapes need no
padding: a forward that returns its output and its `jax.vjp` (a pytree of the residuals,
which stays on the stage's device), a backward that applies that vjp to the incoming
gradient (no recomputed forward: like GPipe without rematerialisation, the baseline does
each FLOP once), and an optimizer update with the shared `apply_update` over that stage's
parameters and optimizer state. Activations and their gradients move between devices with
`device_put`; there are no collectives. Batch norm sees the whole batch, as in `single`.

    python -m experiments train --strategy layer-split --mesh stage=2 --devices 2 \
        --model cnn --dataset synthetic --steps 20
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxpar import measure
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE
from jaxpar import data as datalib
from jaxpar.models import sequence
from jaxpar.parallel import layout, partition, processes
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.stages import leaves, nest


def _get(tree, path):
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            tree = tree[k.key]
        elif isinstance(k, jax.tree_util.SequenceKey):
            tree = tree[k.idx]
        else:
            tree = getattr(tree, k.name)
    return tree


def pick(structure, sources):
    """A tree shaped like `structure`, each leaf taken from the first source holding its path.

    Stage trees are sub-dicts of the reference tree with the same keys (blocks keep their
    global index), so this both gathers stages into the reference layout and cuts it up.
    """
    def one(path, _):
        for src in sources:
            try:
                return _get(src, path)
            except (KeyError, IndexError, AttributeError, TypeError):
                continue
        raise KeyError(jax.tree_util.keystr(path))
    return jax.tree_util.tree_map_with_path(one, structure)


class LayerSplit(Strategy):
    name = "layer-split"
    family = "model parallel"
    summary = ("the naive baseline: consecutive layers on consecutive devices, one batch at a "
               "time, separate programs per stage")
    models = None  # any model: a sequence of layers, stages of any shapes
    default_axes = {STAGE: -1}
    axes = (STAGE,)
    options = ("stage_boundaries",)
    # Stages on the devices of one global mesh under jax.distributed; between processes an
    # activation moves by a two-device collective-permute (`processes.move`).
    multiprocess = True

    @classmethod
    def check(cls, config, axes):
        return partition.boundary_problems(config.parallel.stage_boundaries,
                                           partition.layer_names(config.model), axes.get(STAGE, 1))

    # --- layout ----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.devices = list(mesh.devices.flat)
        self.stages = S = len(self.devices)
        problems = self.check(self.config, {STAGE: S})
        if problems:
            raise ConfigError(" ".join(problems))
        self.starts = partition.cut(self.config, S) if S > 1 else (0,)
        layers = model.layers()
        self.ranges = [range(a, b) for a, b in zip(self.starts, (*self.starts[1:], len(layers)))]
        self.keys = [[k for i in r for k in layers[i].keys] for r in self.ranges]
        self.names = [[layers[i].name for i in r] for r in self.ranges]
        # elements per example each stage hands to the next (shapes only)
        image_shape = datalib.spec(self.config.data).image_shape
        h, self.boundaries = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32), []
        for r in self.ranges[:-1]:
            h = jax.eval_shape(lambda x, r=r: sequence.apply([layers[i] for i in r], x), h)
            self.boundaries.append(h.size)
        self.graphdef, params, model_state = steplib.split_model(model)
        self.shapes, self.state_shapes = layout.abstract(params), layout.abstract(model_state)
        self._build_programs()
        return self.state_from_reference(steplib.init_state(params, model_state, tx))

    def _stage_params(self, tree, s):
        """Stage s's sub-dict of `tree` (parameters, or batch-norm statistics): its layers'."""
        owned = lambda path: any(path[:len(k)] == tuple(k) for k in self.keys[s])  # noqa: E731
        return nest([(path, x) for path, x in leaves(tree) if owned(path)])

    def state_from_reference(self, ref):
        ref = jax.device_get(ref)
        params, opts, stats = [], [], []
        for s, dev in enumerate(self.devices):
            p = self._stage_params(ref.params, s)
            opt = pick(jax.eval_shape(self.tx.init, p), [ref.opt_state])
            on = SingleDeviceSharding(dev)
            params.append(processes.place(p, on))
            opts.append(processes.place(opt, on))
            stats.append(processes.place(self._stage_params(ref.model_state, s), on))
        return steplib.TrainState(step=processes.place(ref.step, SingleDeviceSharding(self.devices[0])),
                                  params=tuple(params), opt_state=tuple(opts),
                                  model_state=tuple(stats))

    def state_to_reference(self, state):
        state = processes.fetch(state)
        params = pick(self.shapes, list(state.params))
        opt = pick(jax.eval_shape(self.tx.init, self.shapes), list(state.opt_state))
        return steplib.TrainState(step=state.step, params=params, opt_state=opt,
                                  model_state=pick(self.state_shapes, list(state.model_state)))

    def place_batch(self, batch):
        # Images go to the first stage, labels and weights to the last (where the loss is).
        first, last = (SingleDeviceSharding(d) for d in (self.devices[0], self.devices[-1]))
        return {"image": processes.place(batch["image"], first),
                "label": processes.place(batch["label"], last),
                "weight": processes.place(batch["weight"], last)}

    def host_sums(self, sums):
        return {k: float(v) for k, v in processes.fetch(sums).items()}  # from the last stage

    # --- per-stage programs ----------------------------------------------------------------
    def _forward(self, s, params, stats, x, train):
        """Stage s on `x`: its output and its batch-norm statistics after the call."""
        # Other stages' entries are zeros made inside the program; unused, so XLA drops them.
        zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)  # noqa: E731
        model = nnx.merge(self.graphdef, pick(self.shapes, [params, zeros(self.shapes)]),
                          pick(self.state_shapes, [stats, zeros(self.state_shapes)]))
        layers = model.layers()
        h = steplib.normalize(x) if s == 0 else x
        for i in self.ranges[s]:
            h = layers[i](h, train)
        new = self._stage_params(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), s)
        return h, (new if train else stats)

    def _last_loss(self, params, stats, x, batch):
        logits, new = self._forward(self.stages - 1, params, stats, x, True)
        loss, sums = steplib.loss_from_logits(logits, batch)
        return loss, (sums, new)

    def _build_programs(self):
        S = self.stages
        for s in range(S - 1):
            self._register(f"fwd{s}", lambda p, z, x, s=s: self._forward(s, p, z, x, False)[0])
            # training forward: the output and its jax.vjp (a pytree holding the residuals,
            # kept on this device), so the backward program does not recompute the forward
            self._register(f"train_fwd{s}", lambda p, z, x, s=s: self._forward_vjp(s, p, z, x))
            self._register(f"bwd{s}", lambda vjp, g, s=s: self._backward(s, vjp, g))
        argnums = (0,) if S == 1 else (0, 2)
        self._register("last", lambda p, z, x, b: jax.grad(self._last_loss, argnums, has_aux=True)(p, z, x, b))
        self._register("last_eval", lambda p, z, x, b: steplib.loss_from_logits(
            self._forward(S - 1, p, z, x, False)[0], b)[1])
        for s in range(S):
            self._register(f"update{s}", self._update, donate_argnums=(0, 1))

    def _forward_vjp(self, s, params, stats, x):
        """(output, its vjp, the stage's batch-norm statistics after the call)."""
        if s == 0:  # the input is the image batch: no gradient to send back
            return jax.vjp(lambda p: self._forward(0, p, stats, x, True), params, has_aux=True)
        return jax.vjp(lambda p, x: self._forward(s, p, stats, x, True), params, x, has_aux=True)

    @staticmethod
    def _backward(s, vjp, g):
        return (vjp(g)[0], None) if s == 0 else vjp(g)

    def _update(self, params, opt_state, grads):
        st = steplib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=opt_state, model_state={})
        st = steplib.apply_update(st, grads, self.tx)
        return st.params, st.opt_state

    def _prog(self, name, kind):
        """Stage program `name` as AOT-compiled for `kind` ('step', 'eval_step'), else jitted."""
        return self.compiled.get(f"{kind}:{name}") or getattr(self, f"_jit_{name}")

    def _grads(self, state, batch, kind="gradients"):
        """Forward stage by stage, then backward in reverse: per-stage grads, metric sums and
        batch-norm statistics."""
        S, x, vjps, stats = self.stages, batch["image"], [], []
        for s in range(S - 1):
            x, vjp, new = self._prog(f"train_fwd{s}", kind)(state.params[s], state.model_state[s], x)
            vjps.append(vjp)
            stats.append(new)
            x = processes.move(x, self.devices[s + 1])
        labels = {k: batch[k] for k in ("label", "weight")}
        grads, (sums, new) = self._prog("last", kind)(state.params[-1], state.model_state[-1], x, labels)
        stats.append(new)
        stage_grads = [None] * S
        stage_grads[-1] = grads[0]
        g = grads[1] if S > 1 else None
        for s in reversed(range(S - 1)):
            g = processes.move(g, self.devices[s])
            stage_grads[s], g = self._prog(f"bwd{s}", kind)(vjps[s], g)
        return stage_grads, sums, tuple(stats)

    def step(self, state, batch):
        stage_grads, sums, stats = self._grads(state, batch, "step")
        params, opts = zip(*[self._prog(f"update{s}", "step")(state.params[s], state.opt_state[s], g)
                             for s, g in enumerate(stage_grads)])
        return state.replace(step=state.step + 1, params=params, opt_state=opts,
                             model_state=stats), sums

    def gradients(self, state, batch):
        stage_grads, _, _ = self._grads(state, batch)
        return pick(self.shapes, processes.fetch(stage_grads))

    def eval_step(self, state, batch):
        x = batch["image"]
        for s in range(self.stages - 1):
            x = processes.move(self._prog(f"fwd{s}", "eval_step")(state.params[s], state.model_state[s], x),
                               self.devices[s + 1])
        return self._prog("last_eval", "eval_step")(state.params[-1], state.model_state[-1], x,
                                                   {k: batch[k] for k in ("label", "weight")})

    def compile(self, name, state, batch):
        """AOT-compile every stage program `name` ('step' or 'eval_step') runs, each on its
        stage's device; returns them all (`measure.Programs`), one device each."""
        start = time.perf_counter()
        on = lambda tree, s: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                           sharding=SingleDeviceSharding(self.devices[s])), tree)
        S, x = self.stages, batch["image"]
        labels = {k: batch[k] for k in ("label", "weight")}
        parts = []

        def build(prog, *args):
            executable = getattr(self, f"_jit_{prog}").lower(*args).compile()
            self.compiled[f"{name}:{prog}"] = executable
            parts.append(measure.Program(prog, executable, devices=1))
            return executable.out_info  # output shapes, for the next program's arguments

        vjps = []
        for s in range(S - 1):
            if name == "step":
                h, vjp, _ = build(f"train_fwd{s}", state.params[s], state.model_state[s], x)
                vjps.append(vjp)
            else:
                h = build(f"fwd{s}", state.params[s], state.model_state[s], x)
            x = on(h, s + 1)
        if name == "step":
            (grads, _) = build("last", state.params[-1], state.model_state[-1], x, labels)
            g = grads[1] if S > 1 else None
            for s in reversed(range(S - 1)):
                _, g = build(f"bwd{s}", vjps[s], on(g, s))
            for s in range(S):
                build(f"update{s}", state.params[s], state.opt_state[s], on(state.params[s], s))
        else:
            build("last_eval", state.params[-1], state.model_state[-1], x, labels)
        return measure.Programs(name, time.perf_counter() - start, tuple(parts))

    # --- accounting ------------------------------------------------------------------------
    def stage_param_bytes(self) -> list[int]:
        return [int(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(
            self._stage_params(self.shapes, st)))) for st in range(self.stages)]

    def theory(self) -> dict[str, int]:
        return {"total": 0}  # activations move with device_put between programs

    def _stage_of(self, program: str) -> int:
        """The stage whose device runs `program` ('train_fwd1' -> 1, 'last' -> the last)."""
        return self.stages - 1 if program == "last" else int(re.search(r"\d+$", program).group())

    def accounting(self, programs, state) -> dict:
        # Memory per device (the base's) is the most any stage program needs; per stage, the
        # most of the programs on its device.
        memory = {p.name: p.stats["memory"] for p in programs.parts}
        per_stage = [measure.max_memory([m for prog, m in memory.items() if self._stage_of(prog) == s])
                     for s in range(self.stages)]
        # Activations are outputs here, not temporaries: a stage's forward returns the
        # residuals its backward program consumes later; the last stage does both in one.
        held = [memory[f"train_fwd{s}"]["output_bytes"] + memory[f"bwd{s}"]["temp_bytes"]
                for s in range(self.stages - 1)]
        return {**super().accounting(programs, state),
                "param_bytes_per_device": max(self.stage_param_bytes()),
                "memory_per_stage": per_stage,
                "activation_bytes_per_device": max([*held, memory["last"]["temp_bytes"]])}

    def describe(self):
        return {**super().describe(), "stages": self.stages, "stage_starts": list(self.starts),
                "stage_layers": self.names,
                "stage_flops_per_example": partition.stage_costs(self.config, self.starts),
                "stage_param_bytes": self.stage_param_bytes(),
                "boundary_elements_per_example": self.boundaries,
                # each boundary's activations forward and their gradients back, once a step
                "stage_transfer_bytes_per_step": 2 * self.config.data.batch_size * sum(self.boundaries) * 4,
                "note": "one batch at a time, one device busy at a time; activations move "
                        "with device_put (no collectives); each stage's backward applies the "
                        "vjp its forward kept (no recomputed forward)"}
