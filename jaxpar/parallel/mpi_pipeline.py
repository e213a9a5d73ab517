"""`mpi-pipeline`: one pipeline stage per MPI rank; activations and gradients sent with mpi4jax.

Rank s of S holds blocks [s L/S, (s+1) L/S) with their optimizer state and nothing else: the
stem (`embed`) on rank 0, the head (`readout`) and the loss on rank S-1. The global batch is
cut into M micro-batches and each rank runs its column of a `schedules` table (GPipe or
1F1B, the tables the single-process `pipeline` executes): a forward slot runs the stage on a
micro-batch and keeps its `jax.vjp` (with `--remat` only its input, the forward recomputed in
the backward slot); a backward slot applies it to the gradient that arrived. Activations go to
the next rank and gradients to the previous one with `mpi4jax` send/recv inside the rank's one
jitted step, written out slot by slot (the table is known when tracing).

Deadlock-free by construction. Every rank walks the same table and, after each slot, the same
two message phases: forward (activations s -> s+1), then backward (gradients s -> s-1). Both
ends of a message read it off the shared table, so every send meets its receive in the same
phase, and a rank that sends and receives in one phase does both in one `mpi4jax.sendrecv`.
All messages of a phase go the same way along the chain of ranks, so no rank waits on one that
waits back on it (the waits form no cycle: the end of the chain always completes, then the rank
before it), and the k-th message from one rank to another matches the k-th receive posted for
it (MPI keeps the messages between two ranks in order). mpi4jax's calls are ordered effects:
the compiled program keeps this order.

Point-to-point bytes per step: rank s sends one activation per micro-batch forward (s < S-1)
and one gradient of it backward (s > 0), and receives as many: M A per direction, 2 (S-1) M A
over the pipeline (A: one micro-batch's activation). The 3 metric sums are broadcast from the
last rank (12 bytes), so every rank sees the loss.

    mpiexec -n 2 python -m mpi4py -m experiments train --strategy mpi-pipeline \\
        --model stack-mlp --microbatches 4 --schedule 1f1b --dataset synthetic --steps 50
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import distributed, measure
from jaxpar import step as steplib
from jaxpar.data import IMAGE_SHAPE
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE
from jaxpar.parallel import layout, mpi_common, schedules
from jaxpar.parallel.base import model_option
from jaxpar.parallel.layer_split import EMBED, pick

SUMS_BYTES = 4 * len(steplib.SUMS)  # the f32 metric sums broadcast from the last rank


class MpiPipeline(mpi_common.OnePerRank):
    name = "mpi-pipeline"
    summary = ("one stage per MPI rank: activations forward and gradients backward with "
               "`mpi4jax` send/recv inside `jit`, GPipe or 1F1B table; `--microbatches M`")
    models = ("stack-mlp", "vit")  # identical blocks, consecutive ones per rank
    default_axes = {STAGE: 1}  # one device per rank; the ranks are the stages
    options = ("microbatches", "schedule", "remat")

    @classmethod
    def check(cls, config, axes):
        m, batch = config.parallel.microbatches, config.data.batch_size
        problems = [] if batch % m == 0 else [
            f"--microbatches {m} must divide --batch-size {batch}; make --batch-size a multiple of {m}."]
        # The ranks are the stages: known once launched. (A study checks its points before it
        # launches them; every rank checks again when it starts.)
        if distributed.launcher() is not None:
            problems += cls._stage_problems(model_option(config, "depth"), distributed.mpi_rank()[1])
        return problems

    @classmethod
    def _stage_problems(cls, depth: int, stages: int) -> list[str]:
        if stages < 2:
            return [f"--strategy {cls.name} runs one stage per MPI rank; launch S >= 2 ranks "
                    "(mpiexec -n S)."]
        if depth % stages:
            return [f"--depth {depth} blocks do not divide into the {stages} ranks' stages; make "
                    f"--depth a multiple of {stages} or launch a divisor of it."]
        return []

    # --- set-up -----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.device = mesh.devices.flat[0]
        problems = self._stage_problems(len(model.blocks), self.size)
        if problems:
            raise ConfigError(problems[0])
        self.M, per = self.config.parallel.microbatches, len(model.blocks) // self.size
        self.blocks = range(self.rank * per, (self.rank + 1) * per)
        self.table = schedules.schedule(self.config.parallel.schedule, self.size, self.M)
        self.graphdef, params, self.model_state = steplib.split_model(model)
        self.shapes = layout.abstract(params)
        # mpi4jax's own communicator: host-side collectives on COMM_WORLD (state_to_reference)
        # never interleave with a step's messages.
        self.jcomm = self.comm.Clone()
        self._register("step", self._step, donate_argnums=0)
        self._register("gradients", lambda st, b: self._grads(st.params, b)[0])
        self._register("eval_step", self._eval)
        return self.state_from_reference(steplib.init_state(params, self.model_state, tx))

    def _stage_params(self, params, s: int):
        """Stage s's sub-dict of `params`: its blocks, plus the stem (first) or the rest (last)."""
        per = len(self.blocks)
        out = {"blocks": {i: params["blocks"][i] for i in range(s * per, (s + 1) * per)}}
        for key, value in params.items():
            if key != "blocks" and ((key in EMBED and s == 0) or
                                    (key not in EMBED and s == self.size - 1)):
                out[key] = value
        return out

    def state_from_reference(self, ref):
        ref = jax.device_get(ref)
        params = self._stage_params(ref.params, self.rank)
        opt = pick(jax.eval_shape(self.tx.init, params), [ref.opt_state])
        return jax.device_put(steplib.TrainState(step=ref.step, params=params, opt_state=opt,
                                                 model_state=ref.model_state), self.device)

    def state_to_reference(self, state):
        mine = jax.device_get(state)
        every = self.comm.allgather((mine.params, mine.opt_state))  # stage by stage
        params = pick(self.shapes, [p for p, _ in every])
        opt = pick(jax.eval_shape(self.tx.init, self.shapes), [o for _, o in every])
        return steplib.TrainState(step=mine.step, params=params, opt_state=opt,
                                  model_state=mine.model_state)

    def place_batch(self, batch):
        # Each rank places what its stage reads: images on the first, labels on the last;
        # every rank the weights (the loss denominator, and the rows of a micro-batch).
        keep = {"weight"} | ({"image"} if self.rank == 0 else set()) | (
            {"label"} if self.rank == self.size - 1 else set())
        return jax.device_put({k: v for k, v in self.pad(batch).items() if k in keep}, self.device)

    def gradients(self, state, batch):
        every = self.comm.allgather(jax.device_get(self._call("gradients", state, batch)))
        return pick(self.shapes, every)

    # --- the stage ------------------------------------------------------------------------------
    def _model(self, params):
        # Other stages' parameters are zeros made inside the program; unused, so XLA drops them.
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)
        return nnx.merge(self.graphdef, pick(self.shapes, [params, zeros]), self.model_state)

    def _forward(self, params, x):
        """This rank's stage: the stem first on rank 0, then its blocks."""
        model = self._model(params)
        h = model.embed(steplib.normalize(x)) if self.rank == 0 else x
        for i in self.blocks:
            h = model.blocks[i](h)
        return h

    def _activation(self, rows: int) -> jax.ShapeDtypeStruct:
        """One stage boundary's activation for `rows` examples (every boundary's is the same:
        identical blocks keep the residual stream's shape)."""
        embed = lambda p, x: nnx.merge(self.graphdef, p, self.model_state).embed(x)  # noqa: E731
        return jax.eval_shape(embed, self.shapes, jax.ShapeDtypeStruct((rows, *IMAGE_SHAPE), jnp.float32))

    def _stage_fn(self, mb, m: int, denom):
        """f(params, h) -> (output, metric sums) of micro-batch m: the loss on the last rank."""
        zeros = {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}
        if self.rank < self.size - 1:
            return lambda p, h: (self._forward(p, h), zeros)
        labels = {k: mb[k][m] for k in ("label", "weight")}
        return lambda p, h: steplib.loss_from_logits(
            self._model(p).readout(self._forward(p, h)), labels, denom)

    def _vjp(self, f, params, x):
        """(output, vjp, sums) of f at (params, x); rank 0's input is images (no gradient)."""
        if self.rank == 0:
            out, vjp, sums = jax.vjp(lambda p: f(p, x), params, has_aux=True)
            return out, lambda ct: (vjp(ct)[0], None), sums
        return jax.vjp(f, params, x, has_aux=True)

    # --- one step: the table, slot by slot -------------------------------------------------------
    def _grads(self, params, batch):
        """This rank's gradients and the metric sums (last rank) of the micro-batches."""
        s, S, M = self.rank, self.size, self.M
        rows = batch["weight"].shape[0]
        if rows % M:
            raise ConfigError(f"--microbatches {M} must divide the batch's {rows} rows")
        mb = jax.tree.map(lambda x: x.reshape(M, rows // M, *x.shape[1:]), batch)
        denom, act = batch["weight"].sum(), self._activation(rows // M)
        inbox, kept = {"F": {}, "B": {}}, {}  # by micro-batch: what arrived, what F keeps for B
        grads = jax.tree.map(jnp.zeros_like, params)
        sums = {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}
        for row in self.table:
            out = {"F": None, "B": None}
            if row[s] is not None and row[s][0] == "F":
                m = row[s][1]
                x = mb["image"][m] if s == 0 else inbox["F"].pop(m)
                out["F"], sums_m = self._forward_slot(params, self._stage_fn(mb, m, denom), x, kept, m)
                sums = jax.tree.map(jnp.add, sums, sums_m)
            elif row[s] is not None:
                m = row[s][1]
                ct = jnp.ones((), jnp.float32) if s == S - 1 else inbox["B"].pop(m)
                d_params, out["B"] = self._backward_slot(params, kept.pop(m), ct)
                grads = jax.tree.map(jnp.add, grads, d_params)
            for kind, step in (("F", 1), ("B", -1)):  # the two message phases of this slot
                sender = s - step  # the neighbour whose messages of this kind come here
                expect = 0 <= sender < S and row[sender] is not None and row[sender][0] == kind
                got = self._exchange(out[kind], s + step, expect, sender, act)
                if expect:
                    inbox[kind][row[sender][1]] = got
        return grads, sums

    def _forward_slot(self, params, f, x, kept, m):
        """F(m): run the stage; keep its vjp (with --remat, its input) in kept[m]. Returns
        what goes to the next rank (None from the last) and the metric sums."""
        if self.config.parallel.remat:
            h, sums = f(params, x)
            kept[m] = (f, x)
        else:
            h, kept[m], sums = self._vjp(f, params, x)
        return (h if self.rank < self.size - 1 else None), sums

    def _backward_slot(self, params, kept, ct):
        """B(m): the stage's vjp (with --remat recomputed from its input) applied to `ct`.
        Returns (parameter gradients, input gradient; None on rank 0)."""
        if self.config.parallel.remat:
            f, x = kept
            kept = self._vjp(f, params, x)[1]
        return kept(ct)

    def _exchange(self, send, dest: int, expect: bool, source: int, act):
        """Send `send` (None: nothing) to `dest` and, if `expect`, receive one `act` from
        `source`, in one call when both."""
        template = jnp.zeros(act.shape, act.dtype)
        if send is not None and expect:
            return self.mpi4jax.sendrecv(send, template, source, dest, comm=self.jcomm)
        if send is not None:
            self.mpi4jax.send(send, dest, comm=self.jcomm)
        return self.mpi4jax.recv(template, source, comm=self.jcomm) if expect else None

    def _share(self, sums):
        """The last rank's metric sums, on every rank (one broadcast of 3 floats)."""
        flat = jnp.stack([sums[k] for k in steplib.SUMS])
        flat = self.mpi4jax.bcast(flat, self.size - 1, comm=self.jcomm)
        return {k: flat[i] for i, k in enumerate(steplib.SUMS)}

    def _step(self, state, batch):
        grads, sums = self._grads(state.params, batch)
        return steplib.apply_update(state, grads, self.tx), self._share(sums)

    def _eval(self, state, batch):
        """The whole batch through the stages in turn (one micro-batch), sums on every rank."""
        s, last = self.rank, self.rank == self.size - 1
        act = self._activation(batch["weight"].shape[0])
        x = batch["image"] if s == 0 else self.mpi4jax.recv(
            jnp.zeros(act.shape, act.dtype), s - 1, comm=self.jcomm)
        h = self._forward(state.params, x)
        if not last:
            self.mpi4jax.send(h, s + 1, comm=self.jcomm)
            return self._share({k: jnp.zeros((), jnp.float32) for k in steplib.SUMS})
        return self._share(steplib.loss_from_logits(self._model(state.params).readout(h), batch)[1])

    # --- accounting -----------------------------------------------------------------------------
    def _activation_bytes(self) -> int:
        act = self._activation(self.config.data.batch_size // self.M)
        return int(np.prod(act.shape)) * act.dtype.itemsize

    def theory(self) -> dict[str, int]:
        """Bytes this rank sends and receives point-to-point per step (M activations forward
        unless last, M gradients backward unless first), the 12-byte broadcast of the sums;
        'total' is what this rank puts on the wire."""
        S, s, M, A = self.size, self.rank, self.M, self._activation_bytes()
        sent = M * A * ((s < S - 1) + (s > 0))
        return {"point_to_point_sent": sent, "point_to_point_received": sent, "mpi_bcast": SUMS_BYTES,
                "total": sent + SUMS_BYTES, "pipeline_point_to_point": 2 * (S - 1) * M * A,
                "busiest_rank_sent": M * A * min(2, S - 1),
                "busiest_rank_received": M * A * min(2, S - 1)}

    def accounting(self, programs, state) -> dict:
        out = super().accounting(programs, state)
        ops = out["collective_bytes_by_op"]
        sent = ops.get("mpi_send", 0) + ops.get("mpi_sendrecv", 0)
        # A sendrecv receives what it sends: every stage boundary carries one activation shape.
        received = ops.get("mpi_recv", 0) + ops.get("mpi_sendrecv", 0)
        return {**out, "collective_bytes_per_step": sent + ops.get("mpi_bcast", 0),
                "point_to_point_bytes_per_step": {"sent": sent, "received": received},
                "param_bytes_per_device": measure.tree_bytes(state.params),
                "activation_bytes_per_device": programs.memory["temp_bytes"],
                "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": schedules.bubble_theory(self.size, self.M)}

    def stage_param_bytes(self) -> list[int]:
        return [measure.tree_bytes(self._stage_params(self.shapes, s)) for s in range(self.size)]

    def describe(self) -> dict:
        return {**super().describe(), "processes": self.size, "devices": self.size,
                "stages": self.size, "microbatches": self.M, "schedule": self.config.parallel.schedule,
                "blocks_per_stage": len(self.blocks), "slots": len(self.table),
                "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": schedules.bubble_theory(self.size, self.M),
                "peak_in_flight_per_stage": schedules.peak_in_flight(self.table),
                "remat": self.config.parallel.remat, "stage_param_bytes": self.stage_param_bytes(),
                "messages": "mpi4jax send / recv / sendrecv between neighbouring ranks"}
