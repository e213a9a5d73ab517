"""`pipeline`: pipeline parallelism over the STAGE axis, GPipe or 1F1B.

The model's identical blocks are stacked [L, ...] and sharded over STAGE, so stage s holds
blocks [s L/S, (s+1) L/S); the stem (`embed`) runs on stage 0 and the head (`readout`) plus
the loss on the last stage. The global batch is cut into M micro-batches; activations move
stage to stage with `lax.ppermute` inside `jax.shard_map`.

- gpipe: a `lax.scan` over M + S - 1 forward ticks; `jax.grad` of that loop runs the
  backward ticks in reverse — fill-drain, every micro-batch's activations kept.
- 1f1b: a hand-written loop over the slots of `schedules.one_f_one_b`; each slot a stage
  runs one forward or one backward (a per-stage `jax.vjp`, recomputing the stage from its
  stashed input), so a stage keeps at most S - s stage inputs instead of M micro-batches.

    python -m experiments train --strategy pipeline --mesh stage=2 --devices 2 \\
        --model stack-mlp --microbatches 4 --schedule 1f1b --dataset synthetic --steps 50
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA, STAGE
from jaxpar.parallel import layout, processes, schedules
from jaxpar.parallel.base import Strategy, model_option
from jaxpar.parallel.layout import map_param_trees

class Pipeline(Strategy):
    name = "pipeline"
    family = "model parallel"
    summary = ("blocks stacked and sharded over `stage`; `--microbatches M`, "
               "`--schedule gpipe|1f1b`, `--remat`")
    models = ("stack-mlp", "vit")  # identical blocks, stacked [L, ...] and cut into stages
    default_axes = {STAGE: -1}
    axes = (STAGE,)
    options = ("microbatches", "schedule", "remat")
    multiprocess = True  # stages on one global mesh under jax.distributed

    @classmethod
    def check(cls, config, axes):
        stages, shards = axes.get(STAGE, 1), axes.get(DATA, 1) if cls.data_axis else 1
        depth, m, batch = model_option(config, "depth"), config.parallel.microbatches, config.data.batch_size
        problems = []
        if stages < 2:
            problems.append(f"--strategy {cls.name} needs --mesh {STAGE}=S with S >= 2 stages.")
        elif depth % stages:
            problems.append(f"--depth {depth} blocks do not divide into {stages} stages; make "
                            f"--depth a multiple of {STAGE}={stages}.")
        if batch % (shards * m):
            problems.append(f"--microbatches {m} must divide the --batch-size {batch} rows of each "
                            f"of the {shards} data shard(s); make --batch-size a multiple of {shards * m}.")
        return problems

    # --- set-up -----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        cfg = self.config
        self.mesh, self.tx = mesh, tx
        self.S, self.M, self.L = mesh.shape[STAGE], cfg.parallel.microbatches, len(model.blocks)
        if self.S < 2:
            raise ConfigError(f"--mesh {STAGE}=S needs S >= 2 stages for a pipeline")
        if self.L % self.S:
            raise ConfigError(f"--depth {self.L} blocks do not divide into {self.S} stages; make "
                              f"--depth a multiple of {STAGE}={self.S}")
        shards = mesh.shape[self.data_axis] if self.data_axis else 1
        if self.M < 1 or cfg.data.batch_size % (shards * self.M):
            raise ConfigError(f"--microbatches {self.M} must divide the --batch-size "
                              f"{cfg.data.batch_size} rows of each of the {shards} data shard(s)")
        self.schedule = cfg.parallel.schedule
        if self.schedule not in schedules.SCHEDULES:
            raise ConfigError(f"--schedule must be one of {', '.join(schedules.SCHEDULES)}")
        self.graphdef, params, self.model_state = steplib.split_model(model)
        self.block_graphdef, _, self.block_rest = steplib.split_model(model.blocks[0])
        self.ref_template = layout.abstract(params)
        self.pipe_template = jax.eval_shape(self._to_pipe, params)
        ref_state = steplib.init_state(params, self.model_state, tx)
        pipe_state = jax.eval_shape(lambda s: map_param_trees(s, self.ref_template, self._to_pipe), ref_state)
        spec = lambda t: {"outer": jax.tree.map(lambda _: P(), t["outer"]),  # noqa: E731
                          "blocks": jax.tree_util.tree_map_with_path(self._block_spec, t["blocks"])}
        self.state_specs = map_param_trees(pipe_state, self.pipe_template, spec, other=lambda _: P())
        self.batch_spec = P(self.data_axis) if self.data_axis else P()
        self.batch_sharding = NamedSharding(mesh, self.batch_spec)
        shard = functools.partial(jax.shard_map, mesh=mesh, in_specs=(self.state_specs, self.batch_spec))
        self._register("step", shard(self._step, out_specs=(self.state_specs, P())), donate_argnums=0)
        self._register("gradients", shard(lambda s, b: self._grads(s, b)[0],
                                          out_specs=spec(self.pipe_template)))
        self._register("eval_step", shard(self._eval, out_specs=P()))
        self.table = schedules.schedule(self.schedule, self.S, self.M)
        return self.state_from_reference(ref_state)

    # --- layouts ----------------------------------------------------------------------------
    def _to_pipe(self, params):
        xp = jnp if isinstance(jax.tree.leaves(params)[0], jax.Array) else np
        blocks = [params["blocks"][i] for i in range(self.L)]
        return {"outer": {k: v for k, v in params.items() if k != "blocks"},
                "blocks": jax.tree.map(lambda *xs: xp.stack(xs), *blocks)}

    def _to_ref(self, pipe):
        blocks = {i: jax.tree.map(lambda x: x[i], pipe["blocks"]) for i in range(self.L)}
        return {**pipe["outer"], "blocks": blocks}

    def state_to_reference(self, state):
        return map_param_trees(layout.fetch(state), self.pipe_template, self._to_ref)

    def state_from_reference(self, ref):
        pipe = map_param_trees(ref, self.ref_template, self._to_pipe)
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.state_specs)
        return processes.place(pipe, shardings)

    def rows_multiple(self) -> int:
        # Training batches also cut into M micro-batches per shard (checked up front);
        # evaluation runs one micro-batch, so its batches need only split over the shards.
        return self.mesh.shape[self.data_axis] if self.data_axis else 1

    def place_batch(self, batch):
        # Every stage sees the batch (its data shard): stage 0 reads images, the last stage
        # labels and weights.
        return processes.place(self.pad(batch), self.batch_sharding)

    def gradients(self, state, batch):
        return self._to_ref(layout.fetch(self._call("gradients", state, batch)))

    # --- the model in pieces ------------------------------------------------------------------
    def _model(self, outer):
        # The blocks are not used by embed/readout; zeros keep nnx.merge happy and are
        # removed by the compiler.
        dummy = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), self.ref_template["blocks"])
        return nnx.merge(self.graphdef, {**outer, "blocks": dummy}, self.model_state)

    def _embed(self, outer, images):
        return self._model(outer).embed(steplib.normalize(images))

    def _readout(self, outer, h):
        return self._model(outer).readout(h)

    def _stage(self, blocks, h):
        def one_block(h, block_params):
            return self._block(block_params, h), None

        run = lambda b, h: lax.scan(one_block, h, b)[0]  # noqa: E731
        return (jax.checkpoint(run) if self.config.parallel.remat else run)(blocks, h)

    # --- axes: the hooks `hybrid` changes ------------------------------------------------------
    data_axis: str | None = None  # batch axis (hybrid: DATA)

    @property
    def sum_axes(self) -> tuple[str, ...]:
        """Axes over which per-device gradients of replicated weights and metrics are summed."""
        return (STAGE,) + ((self.data_axis,) if self.data_axis else ())

    def _varying(self, x):
        return lax.pcast(x, self.sum_axes, to="varying")

    def _vary_params(self, params):
        # Stem and head are replicated (invariant over STAGE, and DATA): cast them varying so
        # their gradients stay per device (no implicit sum inside a stage's branch), then add
        # them up explicitly; blocks are already per stage.
        blocks = params["blocks"]
        if self.data_axis:
            blocks = lax.pcast(blocks, self.data_axis, to="varying")
        return {"outer": self._varying(params["outer"]), "blocks": blocks}

    def _denom(self, batch):
        total = batch["weight"].sum()
        return lax.psum(total, self.data_axis) if self.data_axis else total

    def _block_spec(self, path, leaf) -> P:
        return P(STAGE)

    def _block(self, block_params, h):
        return nnx.merge(self.block_graphdef, block_params, self.block_rest)(h)

    def _micro(self, batch, m_count):
        return jax.tree.map(lambda x: x.reshape(m_count, -1, *x.shape[1:]), batch)

    # --- GPipe: grad of a forward tick loop ------------------------------------------------------
    def _gpipe_loss(self, params, batch, m_count):
        """This stage's share of the loss (non-zero on the last stage) and metric sums."""
        S, s = self.S, lax.axis_index(STAGE)
        mb = self._micro(batch, m_count)
        denom = self._denom(batch)
        act = jax.eval_shape(self._embed, params["outer"], mb["image"][0])
        zero_sums = {k: self._varying(jnp.zeros((), jnp.float32)) for k in steplib.SUMS}

        def tick(carry, t):
            recv, loss, sums = carry
            first = jax.tree.map(lambda x: x[jnp.clip(t, 0, m_count - 1)], mb)
            inp = jnp.where(s == 0, self._embed(params["outer"], first["image"]), recv)
            out = self._stage(params["blocks"], inp)
            m_out = t - (S - 1)
            last = jax.tree.map(lambda x: x[jnp.clip(m_out, 0, m_count - 1)], mb)
            loss_m, sums_m = steplib.loss_from_logits(self._readout(params["outer"], out), last, denom)
            keep = (s == S - 1) & (m_out >= 0)
            loss = loss + jnp.where(keep, loss_m, 0.0)
            sums = jax.tree.map(lambda a, b: a + jnp.where(keep, b, 0.0), sums, sums_m)
            send = lax.ppermute(out, STAGE, [(i, i + 1) for i in range(S - 1)])
            return (send, loss, sums), None

        init = (self._varying(jnp.zeros(act.shape, act.dtype)), self._varying(jnp.zeros((), jnp.float32)), zero_sums)
        (_, loss, sums), _ = lax.scan(tick, init, jnp.arange(m_count + S - 1))
        return loss, sums

    # --- 1F1B: per-stage vjp in a slot loop ----------------------------------------------------
    def _one_f_one_b(self, params, batch):
        S, M, s = self.S, self.M, lax.axis_index(STAGE)
        kinds = jnp.asarray([[{None: 0, "F": 1, "B": 2}[x[0] if x else None] for x in row] for row in self.table])
        mbs = jnp.asarray([[x[1] if x else 0 for x in row] for row in self.table])
        mb = self._micro(batch, M)
        denom = self._denom(batch)
        act = jax.eval_shape(self._embed, params["outer"], mb["image"][0])
        buf = lambda: self._varying(jnp.zeros((S, *act.shape), act.dtype))  # noqa: E731
        nothing = lambda: self._varying(jnp.zeros(act.shape, act.dtype))  # noqa: E731
        zero_sums = {k: self._varying(jnp.zeros((), jnp.float32)) for k in steplib.SUMS}

        def stage_out(p, h):
            return self._stage(p["blocks"], h)

        def last_loss(p, h, y):
            return steplib.loss_from_logits(self._readout(p["outer"], self._stage(p["blocks"], h)), y, denom)

        def slot(carry, t):
            stash, in_act, in_grad, grads, sums = carry
            m = mbs[t, s]
            x = jax.tree.map(lambda a: a[m], mb)

            def idle():
                return stash, nothing(), nothing(), grads, sums

            def forward():
                inp = jnp.where(s == 0, self._embed(params["outer"], x["image"]), in_act[m % S])
                return stash.at[m % S].set(inp), stage_out(params, inp), nothing(), grads, sums

            def backward():
                inp = stash[m % S]

                def through_last():
                    _, vjp, sums_m = jax.vjp(lambda p, h: last_loss(p, h, x), params, inp, has_aux=True)
                    dp, dh = vjp(self._varying(jnp.ones((), jnp.float32)))
                    return dp, dh, sums_m

                def through_middle():
                    _, vjp = jax.vjp(stage_out, params, inp)
                    dp, dh = vjp(in_grad[m % S])
                    return dp, dh, zero_sums

                dp, dh, sums_m = lax.cond(s == S - 1, through_last, through_middle)
                # stage 0 carries the gradient on into the stem
                _, vjp_embed = jax.vjp(lambda p: self._embed(p["outer"], x["image"]), params)
                dp_embed = vjp_embed(jnp.where(s == 0, dh, 0.0))[0]
                new_grads = jax.tree.map(lambda g, a, b: g + a + b, grads, dp, dp_embed)
                return stash, nothing(), dh, new_grads, jax.tree.map(jnp.add, sums, sums_m)

            stash, send_act, send_grad, grads, sums = lax.switch(kinds[t, s], [idle, forward, backward])
            got_act = lax.ppermute(send_act, STAGE, [(i, i + 1) for i in range(S - 1)])
            got_grad = lax.ppermute(send_grad, STAGE, [(i + 1, i) for i in range(S - 1)])
            prev, nxt = jnp.maximum(s - 1, 0), jnp.minimum(s + 1, S - 1)
            in_act = jnp.where((s > 0) & (kinds[t, prev] == 1),
                               in_act.at[mbs[t, prev] % S].set(got_act), in_act)
            in_grad = jnp.where((s < S - 1) & (kinds[t, nxt] == 2),
                                in_grad.at[mbs[t, nxt] % S].set(got_grad), in_grad)
            return (stash, in_act, in_grad, grads, sums), None

        init = (buf(), buf(), buf(), jax.tree.map(jnp.zeros_like, params), zero_sums)
        (_, _, _, grads, sums), _ = lax.scan(slot, init, jnp.arange(len(self.table)))
        return grads, sums

    # --- programs ---------------------------------------------------------------------------
    def _grads(self, state, batch):
        params = self._vary_params(state.params)
        if self.schedule == "gpipe":
            grads, sums = jax.grad(lambda p: self._gpipe_loss(p, batch, self.M), has_aux=True)(params)
        else:
            grads, sums = self._one_f_one_b(params, batch)
        grads = {"outer": lax.psum(grads["outer"], self.sum_axes),
                 "blocks": lax.psum(grads["blocks"], self.data_axis) if self.data_axis else grads["blocks"]}
        return grads, lax.psum(sums, self.sum_axes)

    def _step(self, state, batch):
        grads, sums = self._grads(state, batch)
        return steplib.apply_update(state, grads, self.tx), sums

    def _eval(self, state, batch):
        _, sums = self._gpipe_loss(self._vary_params(state.params), batch, 1)
        return lax.psum(sums, self.sum_axes)

    # --- accounting -------------------------------------------------------------------------
    def describe(self) -> dict:
        return {**super().describe(), "stages": self.S, "microbatches": self.M,
                "schedule": self.schedule, "blocks_per_stage": self.L // self.S,
                "slots": len(self.table), "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": schedules.bubble_theory(self.S, self.M),
                "peak_in_flight_per_stage": schedules.peak_in_flight(self.table),
                "remat": self.config.parallel.remat}

    def theory(self) -> dict[str, int]:
        """Each slot a stage sends one micro-batch activation on (GPipe: forward ticks, and
        their transposes backward; 1F1B: every slot sends an activation forward and a
        gradient backward); stem and head gradients are all-reduced once, with 3 scalars."""
        mb_rows = self.config.data.batch_size // self.M
        act = jax.eval_shape(self._model(jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype),
                                                      self.pipe_template["outer"])).embed,
                             jax.ShapeDtypeStruct((mb_rows, 28, 28, 1), jnp.float32))
        act_bytes = int(np.prod(act.shape)) * act.dtype.itemsize
        sends = 2 * (self.M + self.S - 1) if self.schedule == "gpipe" else 2 * len(self.table)
        outer = sum(int(np.prod(t.shape)) * t.dtype.itemsize
                    for t in jax.tree.leaves(self.pipe_template["outer"]))
        ops = {"collective-permute": sends * act_bytes, "all-reduce": outer + 12}
        return {**ops, "total": sum(ops.values())}

    def accounting(self, programs, state):
        out = super().accounting(programs, state)
        return {**out, "activation_bytes_per_device": programs.memory["temp_bytes"],
                "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": schedules.bubble_theory(self.S, self.M)}
