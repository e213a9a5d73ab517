"""The SPMD pipeline runtime: one program over the mesh, stages padded to one shape
(`layout.PaddedStages`), the schedule run by `loops` (fill-drain) or `slots` (any table).

Parameters (and every parameter-shaped tree: optimizer moments, batch-norm statistics) are
stage rows sharded over STAGE (the tensor-split leaves also over TENSOR); the batch is every
stage's (its DATA shard with a data axis): stage 0 reads images, the last stage labels and
weights. With two replica copies (GEMS) each device's copy of a stage adds the other copy's
gradient after the schedule (one `ppermute` with the mirror device), so both take the same
update.

    runtime = SpmdRuntime(stages, schedule, mesh, tx, remat, data_axis, trace_counts)
    state = runtime.init_state(reference_state)
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import step as steplib
from jaxpar.cost import F32
from jaxpar.mesh import STAGE, TENSOR
from jaxpar.parallel import layout
from jaxpar.parallel.layout import map_param_trees
from jaxpar.parallel.pipeline.spmd.layout import REP, SPLIT, PaddedStages
from jaxpar.parallel.pipeline.spmd.loops import Loops
from jaxpar.parallel.pipeline.spmd.slots import run_slots
from jaxpar.parallel.transport import processes
from jaxpar.profiling import measure



class SpmdRuntime:
    implementation = "spmd"

    def __init__(self, stages: PaddedStages, schedule, mesh, tx, remat: bool, data_axis, trace_counts):
        self.stages, self.schedule, self.mesh, self.tx = stages, schedule, mesh, tx
        self.loops = Loops(stages, schedule, remat, data_axis)
        self.data_axis, self.trace_counts = data_axis, trace_counts
        self.S, self.M = schedule.devices, schedule.microbatches
        self.jitted: dict = {}
        self.compiled: dict = {}

    def init_state(self, ref):
        """The placed state from the reference-layout `ref` (which fixes the specs)."""
        self.ref_params = layout.abstract(ref.params)
        packed = self._pack(jax.device_get(ref))
        self.packed = layout.abstract(packed.params)
        self.param_specs = {k: self._spec(k) for k in self.packed}
        # every parameter-shaped tree (parameters, optimizer moments, batch-norm statistics)
        # is stage rows; scalars (step counts) are replicated
        self.state_specs = map_param_trees(packed, self.packed, lambda t: {k: self._spec(k) for k in t},
                                           other=lambda _: P())
        self.batch_spec = P(self.data_axis) if self.data_axis else P()
        shard = functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(self.state_specs, self.batch_spec))
        self._register("step", shard(self._step, out_specs=(self.state_specs, P())), donate_argnums=0)
        self._register("gradients", shard(lambda s, b: self._grads(s, b)[0], out_specs=self.param_specs))
        self._register("eval_step", shard(self._eval, out_specs=P()))
        return self._place(packed)

    def _register(self, name, fn, **kwargs):
        @functools.wraps(fn)
        def counted(*args):
            self.trace_counts[name] += 1
            return fn(*args)
        self.jitted[name] = jax.jit(counted, **kwargs)

    def call(self, name, *args):
        return (self.compiled.get(name) or self.jitted[name])(*args)

    def step(self, state, batch):
        return self.call("step", state, batch)

    def eval_step(self, state, batch):
        return self.call("eval_step", state, batch)

    def host_sums(self, sums):
        return {k: float(v) for k, v in layout.host_copy(sums).items()}

    def _spec(self, kind: str) -> P:
        return P(STAGE, TENSOR) if kind == SPLIT else P(STAGE)

    # --- layouts ----------------------------------------------------------------------------
    @property
    def has_state(self) -> bool:
        return self.stages.state.width[REP] > 0  # batch-norm statistics

    def _pack(self, ref):
        pack = self.stages.params.pack
        # no batch norm: no statistics vectors (a zero-size array loses its sharding in a step)
        stats = self.stages.state.pack(ref.model_state) if self.has_state else {}
        return ref.replace(params=pack(ref.params), opt_state=map_param_trees(ref.opt_state, self.ref_params, pack),
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

    def place_batch(self, batch):
        return processes.place(batch, NamedSharding(self.mesh, self.batch_spec))

    def gradients(self, state, batch):
        return self.stages.params.unpack(layout.host_copy(self.call("gradients", state, batch)))

    # --- the step's body --------------------------------------------------------------------
    def _vary_params(self, params):
        """Parameters are per stage already; with a DATA axis cast them varying over it too,
        so each shard's gradient is its own share, summed explicitly (`_combine`)."""
        if not self.data_axis:
            return params
        return {k: lax.pcast(v, self.data_axis, to="varying") for k, v in params.items()}

    def _grads(self, state, batch):
        """(gradients, batch-norm statistics after the step, metric sums), local layouts."""
        params, loops = self._vary_params(state.params), self.loops
        if self.schedule.is_fill_drain():
            grads, (sums, z_sum) = jax.grad(lambda p: loops.fill_drain_loss(p, state.model_state, batch, self.M),
                                            has_aux=True)(params)
            z_sum = loops.local({k: v[None] for k, v in z_sum.items()})  # replica copy 0
        else:
            grads, z_sum, sums = run_slots(loops, params, state.model_state, batch)
            grads, z_sum = loops.local(grads), loops.local(z_sum)
        grads, z_sum = self._combine(grads, z_sum)
        model_state = state.model_state
        if self.has_state:
            model_state = jax.tree.map(lambda z: z / self.M, z_sum)
            if self.data_axis:
                model_state = lax.pmean(model_state, self.data_axis)
        return grads, model_state, lax.psum(sums, loops.sum_axes)

    def _combine(self, grads, z_sum):
        """Per-device gradient shares summed where the layout needs it: over DATA (hybrid);
        with two replica copies, each stage's copies (on devices d and S-1-d) add each other's
        (one exchange with the mirror device, which holds the same two stages in the other
        order of copies)."""
        if self.data_axis:
            grads = lax.psum(grads, self.data_axis)
        if self.schedule.replicas == 1:
            return grads, z_sum
        mirror = self.schedule.placement[1]
        theirs = lax.ppermute((grads, z_sum), STAGE, [(d, mirror[d]) for d in range(self.S)])
        add = lambda mine, other: mine + jnp.flip(other, axis=-2)  # noqa: E731
        return jax.tree.map(add, grads, theirs[0]), jax.tree.map(add, z_sum, theirs[1])

    def _step(self, state, batch):
        grads, model_state, sums = self._grads(state, batch)
        return steplib.apply_update(state, grads, self.tx, model_state), sums

    def _eval(self, state, batch):
        params = self._vary_params(state.params)
        _, (sums, _) = self.loops.fill_drain_loss(params, state.model_state, batch, 1, train=False)
        return lax.psum(sums, self.loops.sum_axes)

    def compile(self, name, state, batch) -> measure.Programs:
        start = time.perf_counter()
        executable = self.jitted[name].lower(state, batch).compile()
        self.compiled[name] = executable
        return measure.Programs(name, time.perf_counter() - start,
                                (measure.Program(name, executable, devices=self.mesh.devices.size),))

    # --- accounting ---------------------------------------------------------------------------
    def padding_bytes_per_step(self) -> int:
        """Padding in the sends that carry a real micro-batch: each of the M micro-batches
        crosses boundary s forward (its activation) and back (its gradient) once."""
        return 2 * self.M * sum(self.stages.padding_bytes_per_send())

    def sends_per_step(self) -> int:
        """Point-to-point sends of the [rows, A] buffer per device per step (operands): the
        fill-drain tick loop one per forward tick and its transpose; the slot loop two per
        slot (to each side)."""
        return 2 * (self.M + self.S - 1) if self.schedule.is_fill_drain() else 2 * len(self.loops.program[0])

    def theory(self, batch_size: int = 0) -> dict[str, int]:
        """Every send moves the whole padded buffer [rows, A] (f32); the metric sums (3 f32)
        are all-reduced once; with replica copies each device also swaps its gradient and
        batch-norm statistics vectors (both copies) with its mirror."""
        ops = {"collective-permute": self.sends_per_step() * self.stages.rows * self.stages.width * F32,
               "all-reduce": 3 * F32}
        if self.schedule.replicas > 1:
            vectors = sum(lay.width[k] for lay in (self.stages.params, self.stages.state) for k in lay.kinds)
            ops["collective-permute"] += self.schedule.replicas * vectors * F32
        return {**ops, "total": sum(ops.values())}

    def accounting(self, programs: measure.Programs) -> dict:
        return {"activation_bytes_per_device": programs.memory["temp_bytes"],
                "padding_bytes_per_step": self.padding_bytes_per_step()}

    def facts(self, batch_size: int = 0) -> dict:
        return {"implementation": self.implementation, **self.stages.describe(),
                "padding_bytes_per_step": self.padding_bytes_per_step()}
