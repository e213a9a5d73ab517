"""Stages as separate programs on their own devices, a schedule table driven from the host (MPMD).

The model's layers (`model.layers()`) are cut into S consecutive stages balanced by FLOPs
(`jaxpar.parallel.pipeline.partition`, or `--stage-boundaries`); every stage has its own jitted
programs, compiled for its own shapes (no padding) and placed by their arguments on the
stage's device:

- `train_fwd{s}`: the stage on one micro-batch, returning its output and its `jax.vjp` (a
  pytree of residuals that stays on the device), or with `--remat` only the output (the
  backward recomputes the stage from its input);
- `bwd{s}`: that vjp applied to the gradient arriving from stage s + 1, added into the
  stage's gradient accumulator (donated), and the gradient of the stage input to send back;
- `last`: the last stage's forward, loss (the global batch's denominator) and backward in
  one program, so the last stage keeps no residuals;
- `update{s}`: the shared optimizer update (`step.apply_update`) of the stage's parameters.

`step` walks a `schedules` table slot by slot (GPipe, 1F1B, GEMS) and dispatches each
device's work in the order its column lists it; activations and gradients move with
`device_put` (across processes `processes.move`). Dispatch is asynchronous: the host runs
ahead, each device runs its queue in order, and a program starts when its inputs have
arrived, so the stages overlap as the schedule says. No stage program holds control flow:
XLA:CPU runs convolutions inside a conditional or a loop body on a slow path (a conv's forward
and backward ~20x slower inside `lax.switch`; jax-ml/jax#12868), which the single SPMD program
(`lax.switch` over stages inside a `lax.scan` of ticks) cannot avoid. The last stage runs
each micro-batch's forward and backward together, at its forward's slot. Where every stage
has a device of its own (within a process, or one stage per process), `step` is one program
per stage instead (`rank_step`: the same stage functions, the messages sent inside the
programs; GEMS too, a program per device holding its two copies); the walk remains for
several devices per stage (`hybrid`), `gradients` and timelines.

With replicas (GEMS), stage s of replica r lives on device `schedules.device_of(s, r, S)`;
after the schedule each stage's two gradient copies are exchanged and summed, so both copies
take the same update and stay one model.

Batch norm inside a stage normalises each micro-batch by its own statistics (as the SPMD
program does); the running statistics after a step are the mean over the micro-batches of
each one's update. `layer-split` is this machinery with one micro-batch.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxpar.profiling import measure
from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar import data as datalib
from jaxpar.errors import ConfigError
from jaxpar.mesh import STAGE
from jaxpar.parallel.pipeline import inner_cut as finer, aot as host_compile, timeline as host_timeline, walk as host_walk, schedules
from jaxpar.parallel import layout
from jaxpar.parallel.transport import processes
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.pipeline.rank_program import RankStep
from jaxpar.parallel.pipeline.padded import leaves, nest


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


class HostPipeline(Strategy):
    """Base of `layer-split` and the host-driven `pipeline` and `gems`: per-stage programs,
    their placement and the table walk. Subclasses say how many micro-batches, which table
    and how many replicas."""

    family = "model parallel"
    models = None  # any model: a sequence of layers, stages of any shapes
    default_axes = {STAGE: -1}
    axes = (STAGE,)
    replicas = 1
    implementation = "mpmd"  # how the stages run (`describe`, results)
    cuts_inside_layers = False  # whether stages may part a layer (`finer`: overlapping stages)

    # --- what subclasses choose --------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return 1

    @property
    def schedule_name(self) -> str:
        return "gpipe"

    @property
    def remat(self) -> bool:
        return False

    # --- layout ----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        self.devices = self._stage_devices(mesh)
        self.S = S = len(self.devices)
        problems = self.check(self.config, meshlib.mesh_shape(mesh))
        if problems:
            raise ConfigError(" ".join(problems))
        self.M = self.microbatches
        self.plan = finer.plan(self.config, S, inside=self.cuts_inside_layers)
        self.starts = self.plan.starts
        _, ref_params, ref_state = steplib.split_model(model)
        model, self.ranges, self.keys, self.names, shapes = self.plan.stages(
            model, datalib.spec(self.config.data).image_shape)
        self.boundary_shapes = shapes  # what stage b hands on, per example
        self.boundaries = [math.prod(b) for b in shapes]  # elements per example handed on
        self.graphdef, params, model_state = steplib.split_model(model)
        self.shapes, self.state_shapes = layout.abstract(params), layout.abstract(model_state)
        self.table = schedules.schedule(self.schedule_name, S, self.M)
        self.stamps, self._stamped_jits = host_timeline.Stamps(), {}  # `timeline` only
        self._shapes_elsewhere: dict = {}  # (program, device id) -> its outputs' shapes
        self._build_programs()
        # A device per stage: the step as one program per device (`rank_step`)
        self.not_one_program = RankStep.reason_not(self)
        self.rank_step = RankStep(self) if self.not_one_program is None else None
        return self.state_from_reference(steplib.init_state(ref_params, ref_state, tx))

    def _stage_devices(self, mesh) -> list:
        """One device per stage position (here every device of the mesh holds one stage)."""
        return list(mesh.devices.flat)

    def device(self, s: int, r: int = 0):
        """The device of stage s of replica r."""
        return self.devices[schedules.device_of(s, r, self.S)]

    # --- where a stage's arrays live (`hybrid_mpmd` places a stage on several devices) -------
    def _place(self, tree, s: int, r: int, kind: str):
        """Host arrays of stage s of replica r on its device; `kind` ('params', 'opt',
        'stats', 'rows') says what they are, for stages that lay each out differently."""
        return processes.place(tree, SingleDeviceSharding(self.device(s, r)))

    def move(self, tree, s: int, r: int = 0):
        """Activations or their gradients sent to stage s of replica r."""
        return processes.move(tree, self.device(s, r))

    def abstract_on(self, tree, s: int, r: int = 0):
        """`tree`'s shapes as abstract arguments of a program of stage s of replica r."""
        sharding = SingleDeviceSharding(self.device(s, r))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    @property
    def copies(self) -> list[tuple[int, int]]:
        """(replica, stage) of every copy of a stage, in the order the state's tuples hold them."""
        return [(r, s) for r in range(self.replicas) for s in range(self.S)]

    def _stage_params(self, tree, s):
        """Stage s's sub-dict of `tree` (parameters, or batch-norm statistics): its layers'."""
        owned = lambda path: any(path[:len(k)] == tuple(k) for k in self.keys[s])  # noqa: E731
        return nest([(path, x) for path, x in leaves(tree) if owned(path)])

    def state_from_reference(self, ref):
        ref = self.plan.to_view(jax.device_get(ref))
        params, opts, stats = [], [], []
        for r, s in self.copies:
            p = self._stage_params(ref.params, s)
            params.append(self._place(p, s, r, "params"))
            opts.append(self._place(pick(jax.eval_shape(self.tx.init, p), [ref.opt_state]), s, r, "opt"))
            stats.append(self._place(self._stage_params(ref.model_state, s), s, r, "stats"))
        return steplib.TrainState(step=processes.place(ref.step, SingleDeviceSharding(self.devices[0])),
                                  params=tuple(params), opt_state=tuple(opts), model_state=tuple(stats))

    def state_to_reference(self, state):
        mine = slice(0, self.S)  # replica 0's copies: every replica holds the same values
        state = processes.fetch_held(state.replace(params=state.params[mine], opt_state=state.opt_state[mine],
                                              model_state=state.model_state[mine]))
        params = pick(self.shapes, list(state.params))
        opt = pick(jax.eval_shape(self.tx.init, self.shapes), list(state.opt_state))
        return self.plan.from_view(steplib.TrainState(
            step=state.step, params=params, opt_state=opt,
            model_state=pick(self.state_shapes, list(state.model_state))))

    def _copy(self, tree, r, s):
        return tree[r * self.S + s]

    def place_batch(self, batch):
        # Each replica's images go to its first stage, labels and weights to its last (where
        # the loss is); every replica gets the whole batch and takes its own micro-batches.
        batch = self.pad(batch)
        out = {k: [] for k in ("image", "label", "weight")}
        for r in range(self.replicas):
            out["image"].append(self._place(batch["image"], 0, r, "rows"))
            out["label"].append(self._place(batch["label"], self.S - 1, r, "rows"))
            out["weight"].append(self._place(batch["weight"], self.S - 1, r, "rows"))
        return {k: tuple(v) for k, v in out.items()}

    def host_sums(self, sums):
        return {k: float(v) for k, v in processes.fetch_held(sums).items()}  # from the last stage

    # --- per-stage functions ---------------------------------------------------------------
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

    def _train_forward(self, s, params, stats, x, z_sum):
        """(output, its vjp or nothing with --remat, z_sum + the stage's statistics)."""
        add = lambda new: jax.tree.map(jnp.add, z_sum, new)  # noqa: E731
        if self.remat:
            out, new = self._forward(s, params, stats, x, True)
            return out, None, add(new)
        out, vjp, new = self._vjp(s, params, stats, x)
        return out, vjp, add(new)

    def _vjp(self, s, params, stats, x):
        if s == 0:  # the input is the image batch: no gradient to send back
            return jax.vjp(lambda p: self._forward(0, p, stats, x, True), params, has_aux=True)
        return jax.vjp(lambda p, h: self._forward(s, p, stats, h, True), params, x, has_aux=True)

    def _backward(self, s, vjp, g, acc):
        """The stage's vjp on the incoming gradient: (acc + parameter gradients, input gradient)."""
        grads = vjp(g)
        return jax.tree.map(jnp.add, acc, grads[0]), (grads[1] if s > 0 else None)

    def _backward_remat(self, s, params, stats, x, g, acc):
        return self._backward(s, self._vjp(s, params, stats, x)[1], g, acc)

    def _last(self, params, stats, x, label, weight, denom, acc, z_sum, sums):
        """The last stage on one micro-batch: forward, loss over the global denominator,
        backward; accumulates its gradients, statistics and metric sums."""
        S = self.S

        def loss(p, h):
            logits, new = self._forward(S - 1, p, stats, h, True)
            value, s_m = steplib.loss_from_logits(logits, {"label": label, "weight": weight}, denom)
            return value, (s_m, new)

        argnums = (0,) if S == 1 else (0, 1)
        grads, (s_m, new) = jax.grad(loss, argnums, has_aux=True)(params, x)
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return add(acc, grads[0]), (grads[1] if S > 1 else None), add(z_sum, new), add(sums, s_m)

    def _zeros(self, s, params, stats):
        """Zero accumulators of stage s: gradients, statistics (and metric sums on the last)."""
        sums = {k: jnp.zeros((), jnp.float32) for k in steplib.SUMS} if s == self.S - 1 else None
        zero = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
        return zero(params), zero(stats), sums

    def _split_images(self, r, x):
        return tuple(jnp.split(self._rows(r, x), self.M // self.replicas))

    def _split_labels(self, r, label, weight):
        """Replica r's micro-batches of labels and weights, and the global batch's weight total."""
        cut = lambda a: tuple(jnp.split(self._rows(r, a), self.M // self.replicas))  # noqa: E731
        return cut(label), cut(weight), weight.sum()

    def _rows(self, r, a):
        n = a.shape[0] // self.replicas
        return a[r * n:(r + 1) * n]

    def _update(self, params, opt_state, grads, z_sum):
        st = steplib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=opt_state, model_state={})
        st = steplib.apply_update(st, grads, self.tx)
        return st.params, st.opt_state, jax.tree.map(lambda z: z / self.M, z_sum)

    def _build_programs(self):
        S = self.S
        donate = lambda *nums: {"donate_argnums": nums}  # noqa: E731  (accumulators: in place)
        for s in range(S - 1):
            self._register(f"fwd{s}", lambda p, z, x, s=s: self._forward(s, p, z, x, False)[0])
            self._register(f"train_fwd{s}", lambda *a, s=s: self._train_forward(s, *a), **donate(3))
            if self.remat:
                self._register(f"bwd{s}", lambda *a, s=s: self._backward_remat(s, *a), **donate(4))
            else:
                self._register(f"bwd{s}", lambda *a, s=s: self._backward(s, *a), **donate(2))
        self._register("last", self._last, **donate(6, 7, 8))
        self._register("last_eval", lambda p, z, x, b: steplib.loss_from_logits(
            self._forward(S - 1, p, z, x, False)[0], b)[1])
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        for s in range(S):
            self._register(f"zeros{s}", lambda p, z, s=s: self._zeros(s, p, z))
            self._register(f"update{s}", self._update, **donate(0, 1))
            if self.replicas > 1:  # per stage: a device holds two stages' copies
                self._register(f"add{s}", add)
        for r in range(self.replicas):
            self._register(f"split_images{r}", lambda x, r=r: self._split_images(r, x))
            self._register(f"split_labels{r}", lambda a, w, r=r: self._split_labels(r, a, w))
        if self.replicas > 1:
            self._register("add_sums", add)

    def _register(self, name, fn, transform=jax.jit, **kwargs):
        self._fns = {**getattr(self, "_fns", {}), name: fn}  # for the stamped variants (timeline)
        super()._register(name, fn, transform, **kwargs)

    def _prog(self, name, kind, device):
        """Program `name` as AOT-compiled for `kind` ('step', 'eval_step') on `device`, else
        jitted; on another process's device, what it returns there (`_elsewhere`)."""
        if not processes.owns(device):
            return functools.partial(self._elsewhere, name, device)
        return self.compiled.get((kind, name, device.id)) or getattr(self, f"_jit_{name}")

    def _elsewhere(self, name, device, *args):
        """Handles of what program `name` returns on another process's `device`: that process
        runs it, this one only passes the results on (to `processes.move`)."""
        key = (name, device.id)
        if key not in self._shapes_elsewhere:
            self._shapes_elsewhere[key] = jax.eval_shape(self._fns[name], *args)
        return jax.tree.map(lambda a: processes.handle(a.shape, a.dtype, device), self._shapes_elsewhere[key])

    def _stamped(self, name):
        """Program `name` stamping its start and end into `self.stamps` (`host_timeline`)."""
        if name not in self._stamped_jits:
            self._stamped_jits[name] = jax.jit(host_timeline.stamped(self._fns[name], self.stamps))
        return self._stamped_jits[name]

    def timeline(self, state, batch) -> list[dict]:
        """A measured per-device timeline of one step (`host_timeline.timeline`)."""
        return host_timeline.timeline(self, state, batch)

    # --- the table walk ----------------------------------------------------------------------
    def _grads(self, state, batch, kind="gradients"):
        """Run the schedule: per copy (replica, stage) the summed gradients and batch-norm
        statistics, and the metric sums (on replica 0's last stage). kind "timeline": the
        stamped programs (`host_timeline`)."""
        walk = host_walk.Walk(self, state, batch, kind)
        for row in self.table:
            for d, slot in enumerate(row):
                if slot is not None:
                    walk.run(*schedules.op(slot), d)
            walk.end_row()
        return walk.finish()

    def step(self, state, batch):
        if self.rank_step is not None:
            return self.rank_step.step(state, batch)
        acc, z_sum, sums = self._grads(state, batch, "step")
        out = [self._prog(f"update{s}", "step", self.device(s, r))(
            self._copy(state.params, r, s), self._copy(state.opt_state, r, s),
            self._copy(acc, r, s), self._copy(z_sum, r, s)) for r, s in self.copies]
        params, opts, stats = zip(*out)
        return state.replace(step=state.step + 1, params=params, opt_state=opts,
                             model_state=stats), sums

    def gradients(self, state, batch):
        acc, _, _ = self._grads(state, batch)
        return self.plan.from_view(pick(self.shapes, processes.fetch_held(list(acc[:self.S]))))

    def eval_step(self, state, batch):
        x = batch["image"][0]
        for s in range(self.S - 1):
            x = self.move(self._prog(f"fwd{s}", "eval_step", self.device(s))(
                state.params[s], state.model_state[s], x), s + 1)
        labels = {"label": batch["label"][0], "weight": batch["weight"][0]}
        return self._prog("last_eval", "eval_step", self.device(self.S - 1))(
            state.params[self.S - 1], state.model_state[self.S - 1], x, labels)

    def compile(self, name, state, batch):
        """AOT-compile every program `name` ('step' or 'eval_step') runs, each on the device of
        each stage copy; returns them all (`measure.Programs`) with how often a call runs each."""
        start = time.perf_counter()
        if name == "step" and self.rank_step is not None:
            parts = self.rank_step.compile(state, batch)
        else:
            parts = host_compile.compile_programs(self, name, state, batch)
        return measure.Programs(name, time.perf_counter() - start, tuple(parts))

    # --- accounting ------------------------------------------------------------------------
    def stage_param_bytes(self) -> list[int]:
        return [int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            self._stage_params(self.shapes, st)))) for st in range(self.S)]

    def transfer_bytes_per_step(self) -> int:
        """Bytes moved between devices per step: each example's activation crosses each
        boundary forward once and its gradient back once (f32, no padding)."""
        return 2 * self.config.data.batch_size * sum(self.boundaries) * 4

    def theory(self) -> dict[str, int]:
        """Within a process activations move with device_put (no collectives); a boundary
        between two processes' devices moves its bytes each way (inside each process's one
        program with one stage per process, `rank_step`; else `processes.move`: on CPU a
        point-to-point transfer, elsewhere a two-device collective-permute), outside XLA's
        collectives; counted, as the cost model prices it, as a collective-permute."""
        crossing = sum(2 * self.config.data.batch_size * n * 4 for b, n in enumerate(self.boundaries)
                       if self.device(b).process_index != self.device(b + 1).process_index)
        return {"collective-permute": crossing, "total": crossing} if crossing else {"total": 0}

    def accounting(self, programs, state) -> dict:
        # Memory per device (the base's) is the most any stage program needs; per stage, the
        # most of the programs on its device.
        memory = {p.name: p.stats["memory"] for p in programs.parts}
        stage_of = {p.name: p.stage for p in programs.parts}
        held_here = sorted(set(stage_of.values()))  # with a program per stage, this process's
        per_stage = [measure.max_memory([m for prog, m in memory.items() if stage_of[prog] == s])
                     for s in held_here]
        return {**super().accounting(programs, state),
                "param_bytes_per_device": max(self.stage_param_bytes()) * self.replicas,
                "memory_per_stage": per_stage,
                "activation_bytes_per_device": self._activation_bytes(memory)}

    def _activation_bytes(self, memory) -> int:
        """The most activation memory a device holds: with one program per stage, its
        temporaries (the residuals of every micro-batch in flight among them); walked from
        the host, the residuals are outputs a stage's forward returns and its backward
        consumes later, one set per micro-batch in flight."""
        if self.rank_step is not None:
            return max(m["temp_bytes"] for m in memory.values())
        peaks = schedules.peak_in_flight(self.table)
        held = [memory[f"train_fwd{s}@0"]["output_bytes"] * max(1, peaks[s]) + memory[f"bwd{s}@0"]["temp_bytes"]
                for s in range(self.S - 1)]
        return max([*held, memory["last@0"]["temp_bytes"]])

    def describe(self):
        return {**super().describe(), "stages": self.S, "stage_starts": list(self.starts),
                "stage_layers": self.names, "implementation": self.implementation,
                "stage_flops_per_example": self.plan.stage_costs(), **self.plan.describe(),
                "stage_param_bytes": self.stage_param_bytes(),
                "step_programs": "one per device, its messages inside (p2p)" if self.rank_step
                else f"per stage and slot, walked from the host ({self.not_one_program})",
                "boundary_elements_per_example": self.boundaries,
                "stage_transfer_bytes_per_step": self.transfer_bytes_per_step()}
