"""`mpi-pipeline`: one pipeline stage per MPI rank; activations and gradients sent with mpi4jax.

Rank s of S holds stage s of the model's layers (`model.layers()`, cut into S stages balanced
by training FLOPs, or at `--stage-boundaries`; the CNN's conv2 parted between stages where
that balances them: `inner_cut`) with their optimizer state and nothing else: the first layer
on rank 0, the head and the loss on rank S-1. Stages may differ in shape; each message's
shape is read off the boundary it crosses. Models with batch norm are refused: their
statistics would have to be gathered from every rank for evaluation and checkpoints (the
in-process `pipeline` keeps them).

The rank's step is the pipeline family's own pieces inside one jitted program: the schedule
(`schedules`: GPipe or 1F1B) lowered to this rank's actions, sends and receives
(`schedules.lower`), run in order by `device_program.execute` with the stage's functions
(`StageFunctions`: the same forward, vjp and fused last stage as every pipeline runtime) and
mpi4jax as the transport. Each message is a `sendrecv` answered with 4 bytes (mpi4jax's
calls are ordered effects: the compiled program keeps their order), which the order of the
actions after it waits for.

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

from jaxpar import data as datalib
from jaxpar.cost import SUMS_BYTES  # the f32 metric sums broadcast from the last stage's rank
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE
from jaxpar.parallel import layout
from jaxpar.parallel.layout import pick
from jaxpar.parallel.mpi import common as mpi_common
from jaxpar.parallel.pipeline import cost, facts, inner_cut
from jaxpar.parallel.pipeline.device_program import StageCopy, after, execute, message_like
from jaxpar.parallel.pipeline.schedules import Recv, Send, bubble_theory, build, lower, timed_bubble
from jaxpar.parallel.pipeline.strategy import schedule_problems
from jaxpar.parallel.pipeline.stage_fns import StageFunctions
from jaxpar.profiling import measure
from jaxpar.runtime import distributed

ANSWER_BYTES = 4  # each message's answer (`MpiTransport.receive`): one f32


class MpiTransport:
    """`device_program.Transport` over mpi4jax: each message a `sendrecv` answered with 4
    bytes, on mpi4jax's own communicator (host-side collectives on COMM_WORLD never
    interleave with a step's messages)."""

    def __init__(self, mpi4jax, comm):
        self.mpi4jax, self.comm = mpi4jax, comm

    def send(self, x, dest: int, after_: jax.Array) -> jax.Array:
        """`x` to `dest` (ordered by mpi4jax's effects); returns its 4-byte answer."""
        return self.mpi4jax.sendrecv(x, jnp.zeros((), jnp.float32), dest, dest, comm=self.comm)

    def receive(self, like, source: int, order: jax.Array) -> jax.Array:
        """One `like` from `source`, answered with 4 bytes."""
        template = after(jnp.zeros(like.shape, like.dtype), order)
        return self.mpi4jax.sendrecv(after(jnp.zeros((), jnp.float32), order), template, source, source,
                                     comm=self.comm)


class MpiPipeline(mpi_common.OnePerRank):
    name = "mpi-pipeline"
    cost_model = staticmethod(cost.mpi_pipeline)
    summary = ("one stage per MPI rank: activations forward and gradients backward with "
               "`mpi4jax` send/recv inside `jit`, GPipe or 1F1B table; `--microbatches M`, "
               "`--stage-boundaries`; models without batch norm")
    models = None  # any model without batch norm: a sequence of layers, one stage per rank
    default_axes = {STAGE: 1}  # one device per rank; the ranks are the stages
    carries_batch_norm = False  # its ranks hold no statistics of each other's stages
    options = ("microbatches", "schedule", "virtual_stages", "remat", "stage_boundaries")
    implementation = "mpmd"  # a program per rank (results' env.ran.pipeline)

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
    def _stage_problems(cls, config, ranks: int) -> list[str]:
        if ranks < 2:
            return [f"--strategy {cls.name} runs one stage per MPI rank; launch S >= 2 ranks "
                    "(mpiexec -n S)."]
        return schedule_problems(config, ranks, config.parallel.schedule, config.parallel.microbatches)

    # --- set-up -----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.device = mesh.devices.flat[0]
        problems = self._stage_problems(self.config, self.size)
        if problems:
            raise ConfigError(problems[0])
        self.M = self.config.parallel.microbatches
        self.schedule = build(self.config.parallel.schedule, self.size, self.M, self.config.parallel.virtual_stages)
        self.plan = inner_cut.plan(self.config, self.schedule.stages, inside=True)
        self.lowered = lower(self.schedule)  # answered messages: every send waits for its receive
        self.mine = [s for s in range(self.schedule.stages) if self.schedule.device_of(s) == self.rank]
        _, ref_params, ref_state = steplib.split_model(model)
        self.cut = self.plan.stages(model, datalib.spec(self.config.data).image_shape)
        self.fns = StageFunctions.of(self.cut.model, self.cut.ranges, self.cut.keys, tx, self.M,
                                     remat=self.config.parallel.remat)
        self.transport = MpiTransport(self.mpi4jax, self.comm.Clone())
        self._register("step", self._step, donate_argnums=0)
        self._register("gradients", lambda st, b: self._grads(st.params, b)[0])
        self._register("eval_step", self._eval)
        return self.state_from_reference(steplib.init_state(ref_params, ref_state, tx))

    def state_from_reference(self, ref):
        ref = self.plan.to_view(jax.device_get(ref))
        params = self._own(ref.params)
        opt = pick(jax.eval_shape(self.tx.init, params), [ref.opt_state])
        return jax.device_put(steplib.TrainState(step=ref.step, params=params, opt_state=opt,
                                                 model_state=ref.model_state), self.device)

    def _own(self, tree) -> dict:
        """This rank's stages' sub-dict of `tree` (their layers' entries)."""
        return layout.owned(tree, [k for s in self.mine for k in self.cut.keys[s]])

    def state_to_reference(self, state):
        mine = jax.device_get(state)
        every = self.comm.allgather((mine.params, mine.opt_state))  # stage by stage
        opt = pick(jax.eval_shape(self.tx.init, self.fns.shapes), [o for _, o in every])
        return self.plan.from_view(steplib.TrainState(step=mine.step, params=self.fns.join([p for p, _ in every]),
                                                      opt_state=opt, model_state=mine.model_state))

    def place_batch(self, batch):
        # Each rank places what its stages read: images where the first is, labels where the
        # last is; every rank the weights (the loss denominator, and the rows of a micro-batch).
        last = self.schedule.stages - 1
        keep = {"weight"} | ({"image"} if 0 in self.mine else set()) | ({"label"} if last in self.mine else set())
        return jax.device_put({k: v for k, v in self.pad(batch).items() if k in keep}, self.device)

    def gradients(self, state, batch):
        every = self.comm.allgather(jax.device_get(self._call("gradients", state, batch)))
        return self.plan.from_view(self.fns.join(every))

    # --- one step: this rank's lowered schedule --------------------------------------------------
    def _grads(self, params, batch):
        """This rank's gradients and the metric sums (last rank) of the micro-batches."""
        rows = batch["weight"].shape[0]
        if rows % self.M:
            raise ConfigError(f"--microbatches {self.M} must divide the batch's {rows} rows")
        copies = {s: StageCopy(self.fns, 0, s, self.fns.own(params, s), {}, batch.get("image"), batch.get("label"),
                               batch["weight"], split=self.schedule.splits_backward) for s in self.mine}
        execute(self.lowered[self.rank], self.schedule, lambda a, x, order: copies[a.stage].run(a, x, order),
                self.transport, message_like(self.schedule, self.cut.boundaries, rows))
        last = copies.get(self.schedule.stages - 1)
        sums = last.sums if last is not None else {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}
        return layout.nest([leaf for c in copies.values() for leaf in layout.leaves(c.acc)]), sums

    def _share(self, sums):
        """The metric sums of the last stage's rank, on every rank (one broadcast of 3 floats)."""
        flat = jnp.stack([sums[k] for k in steplib.SUMS])
        flat = self.mpi4jax.bcast(flat, self.schedule.device_of(self.schedule.stages - 1), comm=self.transport.comm)
        return {k: flat[i] for i, k in enumerate(steplib.SUMS)}

    def _step(self, state, batch):
        grads, sums = self._grads(state.params, batch)
        return steplib.apply_update(state, grads, self.tx), self._share(sums)

    def _eval(self, state, batch):
        """The whole batch through the stages in turn (one micro-batch), sums on every rank."""
        comm, where, last = self.transport.comm, self.schedule.device_of, self.schedule.stages - 1
        h, sums = None, {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS}
        for s in self.mine:
            if s == 0:
                h = batch["image"]
            elif where(s - 1) != self.rank:
                shape = (batch["weight"].shape[0], *self.cut.boundaries[s - 1])
                h = self.mpi4jax.recv(jnp.zeros(shape, jnp.float32), where(s - 1), comm=comm)
            h = self.fns.forward(s, self.fns.own(state.params, s), {}, h, False)[0]
            if s == last:
                sums = steplib.loss_from_logits(h, batch)[1]
            elif where(s + 1) != self.rank:
                self.mpi4jax.send(h, where(s + 1), comm=comm)
        return self._share(sums)

    # --- accounting -----------------------------------------------------------------------------
    def _rank_bytes(self, rank: int) -> int:
        """What `rank` sends (and receives) per step, read off its lowered schedule: each
        message it sends (an activation or gradient of one micro-batch) and a 4-byte answer to
        each it receives."""
        like = message_like(self.schedule, self.cut.boundaries, self.config.data.batch_size)
        return sum(int(np.prod(like(op.message).shape)) * 4 if isinstance(op, Send) else ANSWER_BYTES
                   for op in self.lowered[rank] if isinstance(op, (Send, Recv)))

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
        described = self.describe()
        return {**out, "collective_bytes_per_step": sent + ops.get("mpi_bcast", 0),
                "point_to_point_bytes_per_step": {"sent": sent},
                "param_bytes_per_device": measure.tree_bytes(state.params),
                # The fullest rank's, like every strategy's (the result is rank 0's, whose
                # stage may be the smallest): each stage's parameters and optimizer state.
                "state_bytes_per_device": max(stage_state), "stage_state_bytes": stage_state,
                "activation_bytes_per_device": programs.memory["temp_bytes"],
                "bubble_fraction": described["bubble_fraction"], "bubble_theory": described["bubble_theory"]}

    def stage_param_bytes(self) -> list[int]:
        return [measure.tree_bytes(self.fns.own(self.fns.shapes, s)) for s in range(self.schedule.stages)]

    def stage_state_bytes(self) -> list[int]:
        """Parameters + optimizer state of each rank (its stages'), from their shapes."""
        held = [[s for s in range(self.schedule.stages) if self.schedule.device_of(s) == r] for r in range(self.size)]
        return [measure.tree_bytes((p, jax.eval_shape(self.tx.init, p))) for p in (
            layout.owned(self.fns.shapes, [k for s in stages for k in self.cut.keys[s]]) for stages in held)]

    def _bubble_theory(self) -> float:
        if self.schedule.name in ("gpipe", "1f1b"):
            return bubble_theory(self.size, self.M)
        return timed_bubble(self.schedule)

    def describe(self) -> dict:
        return {**super().describe(), "processes": self.size, "devices": self.size,
                **facts.plan_facts(self.plan, self.cut.names),
                **facts.schedule_facts(self.schedule, self.plan, self._bubble_theory()),
                "boundary_shapes_per_example": [list(b) for b in self.cut.boundaries],
                "remat": self.config.parallel.remat, "stage_param_bytes": self.stage_param_bytes(),
                "messages": "mpi4jax sendrecv between neighbouring ranks, each answered with 4 bytes"}
