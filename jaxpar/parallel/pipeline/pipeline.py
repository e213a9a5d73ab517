"""`pipeline`: any model's layers cut into S stages over the STAGE axis, GPipe or 1F1B.

The model's layers (`model.layers()`) are cut into S consecutive stages balanced by FLOPs
(`jaxpar.parallel.pipeline.partition`, or `--stage-boundaries`); stage s lives on device s, held as
`jaxpar.parallel.pipeline.padded` lays it out (flat padded vectors, one `lax.switch` branch per
stage; the padding is reported by `describe`). The global batch is cut into M micro-batches;
activations move stage to stage with `lax.ppermute` inside `jax.shard_map`.

- gpipe: a `lax.scan` over M + S - 1 forward ticks; `jax.grad` of that loop runs the
  backward ticks in reverse: fill-drain, every micro-batch's activations kept (`--remat`:
  only each stage's input, the stage recomputed in the backward). XLA keeps the residuals
  of every `lax.switch` branch that differ in shape (zeros for the branches not taken), so
  without `--remat` a device holds every stage's residual types, not only its own.
- 1f1b: a loop over the slots of `schedules.one_f_one_b` (`_slots`): each slot a device
  runs one forward or one backward (a `jax.vjp` that recomputes its stage from the stage
  input kept in its inbox), so stage s keeps at most S - s stage inputs, not M.

Batch norm inside a stage normalises with each micro-batch's own statistics (M > 1 differs
from `single`, which normalises over the whole batch); the running statistics move once a
step, by the mean of the micro-batches' updates.

    python -m experiments train --strategy pipeline --mesh stage=2 --devices 2 \\
        --model cnn --microbatches 4 --schedule 1f1b --dataset synthetic --steps 50
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import data as datalib
from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE, TENSOR
from jaxpar.parallel.pipeline import inner_cut as finer, schedules
from jaxpar.parallel import layout
from jaxpar.parallel.transport import processes
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.layout import map_param_trees
from jaxpar.parallel.pipeline.common import PipelineFace, resolve_impl
from jaxpar.parallel.pipeline.mpmd import PipelineMPMD
from jaxpar.parallel.pipeline.padded import REP, SPLIT, Stages

F32 = 4


def vary(x, axes: tuple[str, ...]):
    """`x` cast to varying over `axes` (those it is not varying over already): every branch
    of a `lax.switch`, and every carry of a loop, must agree on the axes it varies over."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


class Pipeline(PipelineFace, Strategy):
    """The SPMD formulation, and the strategy's entry in the registry (`formulation` picks)."""

    copies = 1                   # replica copies of the model on the stage devices (gems: 2)
    implementation = "spmd"
    host_formulation: type[Strategy] | None = PipelineMPMD

    @classmethod
    def formulation(cls, config):
        impl = resolve_impl(config.parallel.pipeline_impl)
        return cls.host_formulation if impl == "mpmd" and cls.host_formulation else cls

    # --- set-up -----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        cfg = self.config
        self.mesh, self.tx = mesh, tx
        problems = self.check(cfg, meshlib.mesh_shape(mesh))
        if problems:
            raise ConfigError(" ".join(problems))
        self.S, self.M = mesh.shape[STAGE], cfg.parallel.microbatches
        shards = mesh.shape[self.data_axis] if self.data_axis else 1
        self.rows = cfg.data.batch_size // (shards * self.M)
        self.plan = finer.plan(cfg, self.S, inside=False)  # one SPMD program: whole layers
        self.starts = self.plan.starts
        self.stages = self._stages(model)
        self.graphdef, params, model_state = steplib.split_model(model)
        self.ref_params, self.ref_state = layout.abstract(params), layout.abstract(model_state)
        packed = self._pack(jax.device_get(steplib.init_state(params, model_state, tx)))
        self.packed = layout.abstract(packed.params)
        self.param_specs = {k: self._spec(k) for k in self.packed}
        # every parameter-shaped tree (parameters, optimizer moments, batch-norm statistics)
        # is stage rows; scalars (step counts) are replicated
        self.state_specs = map_param_trees(packed, self.packed, lambda t: {k: self._spec(k) for k in t},
                                           other=lambda _: P())
        self.batch_spec = P(self.data_axis) if self.data_axis else P()
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)
        self.table = schedules.schedule(self.schedule_name, self.S, self.M)
        self.program = schedules.slot_program(self.table)
        shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=(self.state_specs, self.batch_spec))
        self._register("step", shard(self._step, out_specs=(self.state_specs, P())), donate_argnums=0)
        self._register("gradients", shard(lambda s, b: self._grads(s, b)[0], out_specs=self.param_specs))
        self._register("eval_step", shard(self._eval, out_specs=P()))
        return self._place(packed)

    @property
    def schedule_name(self) -> str:
        return self.config.parallel.schedule

    def _stages(self, model) -> Stages:
        return Stages(model, self.starts, self.rows, image_shape=self.image_shape)

    @property
    def image_shape(self) -> tuple[int, ...]:
        return datalib.spec(self.config.data).image_shape

    def _spec(self, kind: str) -> P:
        return P(STAGE, TENSOR) if kind == SPLIT else P(STAGE)

    # --- layouts ----------------------------------------------------------------------------
    def _pack(self, ref):
        pack = self.stages.params.pack
        # no batch norm: no statistics vectors (a zero-size array loses its sharding in a step)
        stats = self.stages.state.pack(ref.model_state) if self.has_state else {}
        return ref.replace(params=pack(ref.params),
                           opt_state=map_param_trees(ref.opt_state, self.ref_params, pack),
                           model_state=stats)

    def state_to_reference(self, state):
        state = layout.host_copy(state)
        unpack = self.stages.params.unpack
        return state.replace(params=unpack(state.params),
                             opt_state=map_param_trees(state.opt_state, self.packed, unpack),
                             model_state=self.stages.state.unpack(state.model_state) if self.has_state else {})

    def state_from_reference(self, ref):
        return self._place(self._pack(jax.device_get(ref)))

    def _place(self, packed):
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.state_specs)
        return processes.place(packed, shardings)

    def rows_multiple(self) -> int:
        # Training batches also cut into M micro-batches per shard (checked up front);
        # evaluation runs one micro-batch, so its batches need only split over the shards.
        return self.mesh.shape[self.data_axis] if self.data_axis else 1

    def place_batch(self, batch):
        # Every stage sees the batch (its data shard): stage 0 reads images, the last stage
        # labels and weights.
        return processes.place(self.pad(batch), self.batch_sharding)

    def gradients(self, state, batch):
        return self.stages.params.unpack(layout.host_copy(self._call("gradients", state, batch)))

    # --- pieces shared by both schedules ------------------------------------------------------
    @property
    def sum_axes(self) -> tuple[str, ...]:
        """Axes over which per-device metrics are summed (and the batch is split: DATA)."""
        return (STAGE,) + ((self.data_axis,) if self.data_axis else ())

    def _vary(self, tree, kind: str = REP):
        axes = self.sum_axes + ((TENSOR,) if kind == SPLIT else ())
        return jax.tree.map(lambda x: vary(x, axes), tree)

    def _vary_buffers(self, buffers):
        return {k: self._vary(v, k) for k, v in buffers.items()}

    def _mine(self, buffers, copy):
        """This device's vectors of one replica copy from its [1, (1,) copies, n] shards."""
        return {k: (v[0] if k == REP else v[0, 0])[copy] for k, v in buffers.items()}

    @staticmethod
    def _local(vectors):
        """[copies, n] vectors back in the layout of this device's shard ([1, (1,) copies, n])."""
        return {k: v[None] if k == REP else v[None, None] for k, v in vectors.items()}

    def _denom(self, batch):
        total = batch["weight"].sum()
        return lax.psum(total, self.data_axis) if self.data_axis else total

    def _micro(self, batch, m_count):
        return jax.tree.map(lambda x: x.reshape(m_count, -1, *x.shape[1:]), batch)

    def _forward(self, s, params, state, inp, train):
        run = functools.partial(self.stages.forward, s, train=train)
        out, new = (jax.checkpoint(run) if self.config.parallel.remat else run)(params, state, inp)
        return self._vary(out), self._vary_buffers(new)

    @property
    def has_state(self) -> bool:
        return self.stages.state.width[REP] > 0  # batch-norm statistics

    # --- GPipe: grad of a forward tick loop ------------------------------------------------------
    def _gpipe_loss(self, params, state, batch, m_count, train=True):
        """This stage's share of the loss (non-zero on the last stage), its metric sums and its
        batch-norm statistics summed over its micro-batches."""
        S, s = self.S, lax.axis_index(STAGE)
        p, z = self._mine(params, 0), self._mine(state, 0)
        mb, denom = self._micro(batch, m_count), self._denom(batch)
        branches = [functools.partial(self._tick_branch, st, train) for st in range(S)]
        zeros = lambda tree: self._vary_buffers(jax.tree.map(jnp.zeros_like, tree))  # noqa: E731
        rows = mb["label"].shape[1]

        def tick(carry, t):
            recv, loss, sums, z_sum = carry
            first = jax.tree.map(lambda x: x[jnp.clip(t, 0, m_count - 1)], mb)
            out, z_new = lax.switch(s, branches, p, z, first["image"], recv)
            mine = (t - s >= 0) & (t - s < m_count)  # a real micro-batch on this stage
            z_sum = jax.tree.map(lambda a, b: a + jnp.where(mine, b, 0.0), z_sum, z_new)
            m_out = t - (S - 1)
            last = jax.tree.map(lambda x: x[jnp.clip(m_out, 0, m_count - 1)], mb)
            loss_m, sums_m = steplib.loss_from_logits(out[:, :self.stages.classes], last, denom)
            keep = (s == S - 1) & (m_out >= 0)
            loss = loss + jnp.where(keep, loss_m, 0.0)
            sums = jax.tree.map(lambda a, b: a + jnp.where(keep, b, 0.0), sums, sums_m)
            send = lax.ppermute(out, STAGE, [(i, i + 1) for i in range(S - 1)])
            return (send, loss, sums, z_sum), None

        init = (self._vary(jnp.zeros((rows, self.stages.width), jnp.float32)),
                self._vary(jnp.zeros((), jnp.float32)),
                self._vary({k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}), zeros(z))
        (_, loss, sums, z_sum), _ = lax.scan(tick, init, jnp.arange(m_count + S - 1))
        return loss, (sums, z_sum)

    def _tick_branch(self, s, train, p, z, image, recv):
        return self._forward(s, p, z, image if s == 0 else recv, train)

    # --- 1F1B and GEMS: a slot loop over a schedule table ----------------------------------------
    def _slots(self, params, state, batch):
        """Run `self.table` slot by slot (`schedules.slot_program`). Returns per replica copy
        the gradients and summed batch-norm statistics (local shapes), and the metric sums."""
        ops, recv, size = jnp.asarray(self.program[0]), jnp.asarray(self.program[1]), self.program[2]
        d, S = lax.axis_index(STAGE), self.S
        mb, denom = self._micro(batch, self.M), self._denom(batch)
        branches = ([self._idle] + [functools.partial(self._slot_forward, st) for st in range(S)]
                    + [functools.partial(self._slot_backward, st) for st in range(S)])
        zeros = lambda tree: self._vary_buffers(jax.tree.map(jnp.zeros_like, tree))  # noqa: E731
        rows = mb["label"].shape[1]

        def slot(carry, t):
            inbox, grads, z_sum, sums = carry
            kind, st, r, m, act, grad = (ops[t, d, i] for i in range(6))
            x = jax.tree.map(lambda a: a[m], mb)
            pick = lambda tree: {k: v[r] for k, v in self._mine(tree, slice(None)).items()}  # noqa: E731
            index = jnp.where(kind == 0, 0, jnp.where(kind == 1, 1 + st, 1 + S + st))
            send, dp, dz, sums_m = lax.switch(index, branches, pick(params), pick(state), x,
                                              inbox[jnp.maximum(act, 0)], inbox[jnp.maximum(grad, 0)], denom)
            grads = {k: v.at[r].add(dp[k]) for k, v in grads.items()}
            z_sum = {k: v.at[r].add(dz[k]) for k, v in z_sum.items()}
            sums = jax.tree.map(jnp.add, sums, sums_m)
            from_left = lax.ppermute(send, STAGE, [(i, i + 1) for i in range(S - 1)])
            from_right = lax.ppermute(send, STAGE, [(i + 1, i) for i in range(S - 1)])
            for got, where in ((from_left, recv[t, d, 0]), (from_right, recv[t, d, 1])):
                inbox = jnp.where(where >= 0, inbox.at[jnp.maximum(where, 0)].set(got), inbox)
            return (inbox, grads, z_sum, sums), None

        init = (self._vary(jnp.zeros((size, rows, self.stages.width), jnp.float32)),
                zeros(self._mine(params, slice(None))), zeros(self._mine(state, slice(None))),
                self._vary({k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}))
        (_, grads, z_sum, sums), _ = lax.scan(slot, init, jnp.arange(len(self.table)))
        return grads, z_sum, sums

    def _idle(self, p, z, x, act, grad, denom):
        rows = x["label"].shape[0]
        return (self._vary(jnp.zeros((rows, self.stages.width), jnp.float32)),
                self._vary_buffers(jax.tree.map(jnp.zeros_like, p)),
                self._vary_buffers(jax.tree.map(jnp.zeros_like, z)),
                self._vary({k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}))

    def _slot_forward(self, s, p, z, x, act, grad, denom):
        if s == self.S - 1:  # its backward recomputes it and takes the loss
            return self._idle(p, z, x, act, grad, denom)
        out, _ = self._forward(s, p, z, x["image"] if s == 0 else act, True)
        return (out, *self._idle(p, z, x, act, grad, denom)[1:])

    def _slot_backward(self, s, p, z, x, act, grad, denom):
        """Recompute stage s from its input, then its vjp: the gradients of its parameters,
        of its input (sent back), its batch-norm statistics and, on the last stage, the loss's
        metric sums."""
        last = s == self.S - 1

        def run(q, h):
            out, z_new = self._forward(s, q, z, x["image"] if s == 0 else h, True)
            if not last:
                return out, (z_new, self._idle(p, z, x, act, grad, denom)[3])
            loss, sums = steplib.loss_from_logits(out[:, :self.stages.classes], x, denom)
            return loss, (z_new, self._vary(sums))

        if s == 0:
            _, vjp, (z_new, sums) = jax.vjp(lambda q: run(q, act), p, has_aux=True)
            dh = jnp.zeros_like(act)
        else:
            _, vjp, (z_new, sums) = jax.vjp(run, p, act, has_aux=True)
        ct = self._vary(jnp.ones((), jnp.float32)) if last else grad
        dp, *rest = vjp(ct)
        dh = rest[0] if s > 0 else self._vary(dh)
        return self._vary(dh), self._vary_buffers(dp), z_new, sums

    # --- programs ---------------------------------------------------------------------------
    def _vary_params(self, params):
        """Parameters are per stage already; with a DATA axis cast them varying over it too,
        so each shard's gradient is its own share, summed explicitly (`_combine`)."""
        if not self.data_axis:
            return params
        return {k: lax.pcast(v, self.data_axis, to="varying") for k, v in params.items()}

    def _grads(self, state, batch):
        """(gradients, batch-norm statistics after the step, metric sums), local layouts."""
        params = self._vary_params(state.params)
        if self.schedule_name == "gpipe":
            grads, (sums, z_sum) = jax.grad(lambda p: self._gpipe_loss(p, state.model_state, batch, self.M),
                                            has_aux=True)(params)
            z_sum = self._local({k: v[None] for k, v in z_sum.items()})  # replica copy 0
        else:
            grads, z_sum, sums = self._slots(params, state.model_state, batch)
            grads, z_sum = self._local(grads), self._local(z_sum)
        grads, z_sum = self._combine(grads, z_sum)
        model_state = state.model_state
        if self.has_state:
            model_state = jax.tree.map(lambda z: z / self.M, z_sum)
            if self.data_axis:
                model_state = lax.pmean(model_state, self.data_axis)
        return grads, model_state, lax.psum(sums, self.sum_axes)

    def _combine(self, grads, z_sum):
        """Per-device gradient shares summed where the layout needs it (hybrid: over DATA)."""
        if self.data_axis:
            grads = lax.psum(grads, self.data_axis)
        return grads, z_sum

    def _step(self, state, batch):
        grads, model_state, sums = self._grads(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _eval(self, state, batch):
        params = self._vary_params(state.params)
        _, (sums, _) = self._gpipe_loss(params, state.model_state, batch, 1, train=False)
        return lax.psum(sums, self.sum_axes)

    # --- accounting -------------------------------------------------------------------------
    def padding_bytes_per_step(self) -> int:
        """Padding in the sends that carry a real micro-batch: each of the M micro-batches
        crosses boundary s forward (its activation) and back (its gradient) once."""
        return 2 * self.M * sum(self.stages.padding_bytes_per_send())

    def describe(self) -> dict:
        return {**super().describe(), "implementation": self.implementation,
                "stages": self.S, "microbatches": self.M,
                "schedule": self.schedule_name, "stage_starts": list(self.starts),
                "stage_flops_per_example": self.plan.stage_costs(),
                **self.stages.describe(),
                "padding_bytes_per_step": self.padding_bytes_per_step(),
                "slots": len(self.table), "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": self.bubble_theory(),
                "peak_in_flight_per_stage": schedules.peak_in_flight(self.table),
                "remat": self.config.parallel.remat}

    def sends_per_step(self) -> int:
        """Point-to-point sends of the [rows, A] buffer per device per step (operands): GPipe
        one per forward tick and its transpose; the slot loop two per slot (to each side)."""
        return 2 * (self.M + self.S - 1) if self.schedule_name == "gpipe" else 2 * len(self.table)

    def theory(self) -> dict[str, int]:
        """Every send moves the whole padded buffer [rows, A] (f32); the metric sums (3 f32)
        are all-reduced once."""
        ops = {"collective-permute": self.sends_per_step() * self.rows * self.stages.width * F32,
               "all-reduce": 3 * F32}
        return {**ops, "total": sum(ops.values())}

    def accounting(self, programs, state):
        out = super().accounting(programs, state)
        return {**out, "activation_bytes_per_device": programs.memory["temp_bytes"],
                "padding_bytes_per_step": self.padding_bytes_per_step(),
                "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": self.bubble_theory()}

    def bubble_theory(self) -> float:
        return schedules.bubble_theory(self.S, self.M)
