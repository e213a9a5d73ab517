"""`mpi-pipeline`: one pipeline stage per MPI rank; activations and gradients sent with mpi4jax.

Rank s of S holds stage s of the model's layers (`model.layers()`, cut into S stages balanced
by training FLOPs, or at `--stage-boundaries`) with their optimizer state and nothing else:
the first layer on rank 0, the head and the loss on rank S-1. Stages may differ in shape (a
CNN's conv stage hands on [14, 14, 32] per example, its head stage takes [7, 7, 64]); each
message's shape is read off the boundary it crosses. Models with batch norm are refused:
their statistics would have to travel with the micro-batches (the in-process `pipeline`
keeps them). The global batch is
cut into M micro-batches and each rank runs its column of a `schedules` table (GPipe or
1F1B, the tables the single-process `pipeline` executes): a forward slot runs the stage on a
micro-batch and keeps its `jax.vjp` (with `--remat` only its input, the forward recomputed in
the backward slot); a backward slot applies it to the gradient that arrived. Activations go to
the next rank and gradients to the previous one with `mpi4jax` send/recv inside the rank's one
jitted step, written out slot by slot (the table is known when tracing).

Messages go in `column`'s deadlock-free order (after each slot a forward phase, then a
backward one; every slot's input waits for what came before). Each message is a `sendrecv`
answered with 4 bytes (mpi4jax's calls are ordered effects: the compiled program keeps their
order), which the walk ties into the order of the slots after it.

Point-to-point bytes per step: rank s sends its output per micro-batch forward (s < S-1, A_s
bytes) and the gradient of its input backward (s > 0, A_{s-1}), and receives the same two
shapes: 2 M sum_b A_b over the pipeline (A_b: one micro-batch's activation at boundary b),
and 4 bytes back for each. The 3 metric sums are broadcast from the last rank (12 bytes), so
every rank sees the loss.

    mpiexec -n 2 python -m mpi4py -m experiments train --strategy mpi-pipeline \\
        --model stack-mlp --microbatches 4 --schedule 1f1b --dataset synthetic --steps 50
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.parallel.pipeline import cost
from jaxpar.runtime import distributed
from jaxpar.profiling import measure
from jaxpar import step as steplib
from jaxpar import data as datalib
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline import columns as column, inner_cut as finer, partition, schedules
from jaxpar.parallel import layout
from jaxpar.parallel.mpi import common as mpi_common
from jaxpar.parallel.pipeline.host import pick
from jaxpar.parallel.pipeline.padded import leaves, nest

SUMS_BYTES = 4 * len(steplib.SUMS)  # the f32 metric sums broadcast from the last rank
ANSWER_BYTES = 4  # each message's answer (`_receive`): one f32


def _answer():
    return jnp.zeros((), jnp.float32)


class MpiPipeline(mpi_common.OnePerRank):
    name = "mpi-pipeline"
    cost_model = staticmethod(cost.mpi_pipeline)
    summary = ("one stage per MPI rank: activations forward and gradients backward with "
               "`mpi4jax` send/recv inside `jit`, GPipe or 1F1B table; `--microbatches M`, "
               "`--stage-boundaries`; models without batch norm")
    models = None  # any model without batch norm: a sequence of layers, one stage per rank
    default_axes = {STAGE: 1}  # one device per rank; the ranks are the stages
    carries_batch_norm = False  # its ranks hold no statistics of each other's stages
    options = ("microbatches", "schedule", "remat", "stage_boundaries")

    @classmethod
    def check(cls, config, axes):
        m, batch = config.parallel.microbatches, config.data.batch_size
        problems = [] if batch % m == 0 else [
            f"--microbatches {m} must divide --batch-size {batch}; make --batch-size a multiple of {m}."]
        # The ranks are the stages: known once launched. (A study checks its points before it
        # launches them; every rank checks again when it starts.)
        if distributed.launcher() is not None:
            problems += cls._stage_problems(config, distributed.mpi_rank()[1])
        return problems

    @classmethod
    def _stage_problems(cls, config, stages: int) -> list[str]:
        if stages < 2:
            return [f"--strategy {cls.name} runs one stage per MPI rank; launch S >= 2 ranks "
                    "(mpiexec -n S)."]
        return partition.boundary_problems(config.parallel.stage_boundaries,
                                           partition.layer_names(config.model), stages)

    # --- set-up -----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.device = mesh.devices.flat[0]
        problems = self._stage_problems(self.config, self.size)
        if problems:
            raise ConfigError(problems[0])
        self.M = self.config.parallel.microbatches
        self.plan = finer.plan(self.config, self.size, inside=True)
        self.starts = self.plan.starts
        _, ref_params, ref_state = steplib.split_model(model)
        # the stages' layers and what crosses each boundary (stage b's output, per example)
        model, self.ranges, self.keys, self.names, self.boundaries = self.plan.stages(
            model, datalib.spec(self.config.data).image_shape)
        self.layers = self.ranges[self.rank]  # this rank's
        self.table = schedules.schedule(self.config.parallel.schedule, self.size, self.M)
        self.graphdef, params, self.model_state = steplib.split_model(model)
        self.shapes = layout.abstract(params)
        # mpi4jax's own communicator: host-side collectives on COMM_WORLD (state_to_reference)
        # never interleave with a step's messages.
        self.jcomm = self.comm.Clone()
        self._register("step", self._step, donate_argnums=0)
        self._register("gradients", lambda st, b: self._grads(st.params, b)[0])
        self._register("eval_step", self._eval)
        return self.state_from_reference(steplib.init_state(ref_params, ref_state, tx))

    def _stage_params(self, params, s: int):
        """Stage s's sub-dict of `params`: its layers' parameters."""
        owned = lambda path: any(path[:len(k)] == tuple(k) for k in self.keys[s])  # noqa: E731
        return nest([(path, x) for path, x in leaves(params) if owned(path)])

    def state_from_reference(self, ref):
        ref = self.plan.to_view(jax.device_get(ref))
        params = self._stage_params(ref.params, self.rank)
        opt = pick(jax.eval_shape(self.tx.init, params), [ref.opt_state])
        return jax.device_put(steplib.TrainState(step=ref.step, params=params, opt_state=opt,
                                                 model_state=ref.model_state), self.device)

    def state_to_reference(self, state):
        mine = jax.device_get(state)
        every = self.comm.allgather((mine.params, mine.opt_state))  # stage by stage
        params = pick(self.shapes, [p for p, _ in every])
        opt = pick(jax.eval_shape(self.tx.init, self.shapes), [o for _, o in every])
        return self.plan.from_view(steplib.TrainState(step=mine.step, params=params, opt_state=opt,
                                                      model_state=mine.model_state))

    def place_batch(self, batch):
        # Each rank places what its stage reads: images on the first, labels on the last;
        # every rank the weights (the loss denominator, and the rows of a micro-batch).
        keep = {"weight"} | ({"image"} if self.rank == 0 else set()) | (
            {"label"} if self.rank == self.size - 1 else set())
        return jax.device_put({k: v for k, v in self.pad(batch).items() if k in keep}, self.device)

    def gradients(self, state, batch):
        every = self.comm.allgather(jax.device_get(self._call("gradients", state, batch)))
        return self.plan.from_view(pick(self.shapes, every))

    # --- the stage ------------------------------------------------------------------------------
    def _model(self, params):
        # Other stages' parameters are zeros made inside the program; unused, so XLA drops them.
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)
        return nnx.merge(self.graphdef, pick(self.shapes, [params, zeros]), self.model_state)

    def _forward(self, params, x, train: bool = True):
        """This rank's stage: its layers in turn (rank 0 normalises the images first; the last
        rank's output is the logits)."""
        layers = self._model(params).layers()
        h = steplib.normalize(x) if self.rank == 0 else x
        for i in self.layers:
            h = layers[i](h, train)
        return h

    def _activation(self, boundary: int, rows: int) -> jax.ShapeDtypeStruct:
        """What crosses `boundary` (stage `boundary`'s output) for `rows` examples."""
        return jax.ShapeDtypeStruct((rows, *self.boundaries[boundary]), jnp.float32)

    def _stage_fn(self, mb, m: int, denom):
        """f(params, h) -> (output, metric sums) of micro-batch m: the loss on the last rank."""
        zeros = {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}
        if self.rank < self.size - 1:
            return lambda p, h: (self._forward(p, h), zeros)
        labels = {k: mb[k][m] for k in ("label", "weight")}
        return lambda p, h: steplib.loss_from_logits(self._forward(p, h), labels, denom)

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
        denom = batch["weight"].sum()
        # what arrives: activations from s-1 (its output), gradients from s+1 (of this output)
        arrives = {"F": self._activation(s - 1, rows // M) if s > 0 else None,
                   "B": self._activation(s, rows // M) if s < S - 1 else None}
        kept = {}  # by micro-batch: what F keeps for B
        total = {"grads": jax.tree.map(jnp.zeros_like, params),
                 "sums": {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}}

        def run_slot(kind, m, arrived, order):
            if kind == "F":
                x = column.after(mb["image"][m] if s == 0 else arrived, order)
                out, sums_m = self._forward_slot(params, self._stage_fn(mb, m, denom), x, kept, m)
                total["sums"] = jax.tree.map(jnp.add, total["sums"], sums_m)
                return {"F": out}, column.tie(order, (out, sums_m))
            ct = column.after(jnp.ones((), jnp.float32) if s == S - 1 else arrived, order)
            d_params, dx = self._backward_slot(params, kept.pop(m), ct)
            total["grads"] = jax.tree.map(jnp.add, total["grads"], d_params)
            return {"B": dx}, column.tie(order, d_params)  # the slot's receives wait for its work

        column.walk(self.table, s, S, run_slot,
                    lambda kind, sender, order: self._receive(arrives[kind], sender, order),
                    lambda kind, x, dest, order: self._send(x, dest))  # ordered effects
        return total["grads"], total["sums"]

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

    # Messages (the module's docstring: why each has an answer, and the order of a phase's).
    def _receive(self, act, source: int, order):
        """One `act` from `source`, answered with 4 bytes."""
        template = column.after(jnp.zeros(act.shape, act.dtype), order)
        return self.mpi4jax.sendrecv(column.after(_answer(), order), template, source, source,
                                     comm=self.jcomm)

    def _send(self, x, dest: int):
        """`x` to `dest`; returns its 4-byte answer (what the next slot waits for)."""
        return self.mpi4jax.sendrecv(x, _answer(), dest, dest, comm=self.jcomm)

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
        if s > 0:
            act = self._activation(s - 1, batch["weight"].shape[0])
        x = batch["image"] if s == 0 else self.mpi4jax.recv(
            jnp.zeros(act.shape, act.dtype), s - 1, comm=self.jcomm)
        h = self._forward(state.params, x, train=False)
        if not last:
            self.mpi4jax.send(h, s + 1, comm=self.jcomm)
            return self._share({k: jnp.zeros((), jnp.float32) for k in steplib.SUMS})
        return self._share(steplib.loss_from_logits(h, batch)[1])

    # --- accounting -----------------------------------------------------------------------------
    def _activation_bytes(self) -> list[int]:
        """One micro-batch's activation at each boundary, in bytes."""
        rows = self.config.data.batch_size // self.M
        return [int(np.prod(self._activation(b, rows).shape)) * 4 for b in range(self.size - 1)]

    def _rank_bytes(self, s: int) -> int:
        """What rank s sends (and receives) per step: M outputs forward unless last, M input
        gradients backward unless first, and a 4-byte answer to each message it receives."""
        A, last = self._activation_bytes(), self.size - 1
        return self.M * ((A[s] + ANSWER_BYTES if s < last else 0) + (A[s - 1] + ANSWER_BYTES if s > 0 else 0))

    def theory(self) -> dict[str, int]:
        """Bytes this rank sends and receives point-to-point per step, the 12-byte broadcast of
        the sums; 'total' is what this rank puts on the wire."""
        sent = self._rank_bytes(self.rank)
        busiest = max(self._rank_bytes(r) for r in range(self.size))
        return {"point_to_point_sent": sent, "point_to_point_received": sent, "mpi_bcast": SUMS_BYTES,
                "total": sent + SUMS_BYTES,
                "pipeline_point_to_point": sum(self._rank_bytes(r) for r in range(self.size)),
                "busiest_rank_sent": busiest, "busiest_rank_received": busiest}

    def accounting(self, programs, state) -> dict:
        out = super().accounting(programs, state)
        ops = out["collective_bytes_by_op"]
        # counted: a send's and a sendrecv's operand (what they send); a receive's result.
        # A sendrecv's receive is not in its operands (stages differ in shape), so what a
        # rank receives is what its neighbours were counted sending: the schedule's theory.
        sent = ops.get("mpi_send", 0) + ops.get("mpi_sendrecv", 0)
        stage_state = self.stage_state_bytes()
        return {**out, "collective_bytes_per_step": sent + ops.get("mpi_bcast", 0),
                "point_to_point_bytes_per_step": {"sent": sent},
                "param_bytes_per_device": measure.tree_bytes(state.params),
                # The fullest rank's, like every strategy's (the result is rank 0's, whose
                # stage may be the smallest): each stage's parameters and optimizer state.
                "state_bytes_per_device": max(stage_state),
                "stage_state_bytes": stage_state,
                "activation_bytes_per_device": programs.memory["temp_bytes"],
                "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": schedules.bubble_theory(self.size, self.M)}

    def _stage_shapes(self) -> list:
        """Each stage's parameter shapes (ShapeDtypeStructs), stage by stage."""
        return [self._stage_params(self.shapes, s) for s in range(self.size)]

    def stage_param_bytes(self) -> list[int]:
        return [measure.tree_bytes(p) for p in self._stage_shapes()]

    def stage_state_bytes(self) -> list[int]:
        """Parameters + optimizer state of each stage (its rank's state), from their shapes."""
        return [measure.tree_bytes((p, jax.eval_shape(self.tx.init, p)))
                for p in self._stage_shapes()]

    def describe(self) -> dict:
        return {**super().describe(), "processes": self.size, "devices": self.size,
                "stages": self.size, "microbatches": self.M, "schedule": self.config.parallel.schedule,
                "stage_starts": list(self.starts), "stage_layers": self.names,
                "stage_flops_per_example": self.plan.stage_costs(), **self.plan.describe(),
                "boundary_shapes_per_example": [list(b) for b in self.boundaries],
                "slots": len(self.table),
                "bubble_fraction": schedules.bubble_fraction(self.table),
                "bubble_theory": schedules.bubble_theory(self.size, self.M),
                "peak_in_flight_per_stage": schedules.peak_in_flight(self.table),
                "speedup_bound": self.plan.speedup_bound(schedules.bubble_fraction(self.table)),
                "remat": self.config.parallel.remat, "stage_param_bytes": self.stage_param_bytes(),
                "messages": "mpi4jax sendrecv between neighbouring ranks, each answered with 4 bytes"}
