"""What the pipeline family's strategies share: the model's layers cut into stages (`plan`),
a schedule built and validated (`schedules`), and a runtime chosen for the backend that runs
it, to which the strategy's interface delegates.

Two runtimes execute any schedule with the same results (`--pipeline-impl`):

- `spmd`: one SPMD program over the STAGE axis (`spmd.runtime`): every stage a branch of
  `lax.switch`, the slots a `lax.scan`, activations moved with `lax.ppermute`; stages padded
  to one shape.
- `mpmd`: one program per stage on its own device (hybrid: its data x tensor sub-mesh)
  (`host.runtime`): no control flow around the stage's layers, no padding.

`auto` takes mpmd on a CPU backend, where XLA runs convolutions inside a conditional or a
loop body on a slow path (a conv's forward and backward ~20x slower inside `lax.switch`), and
spmd elsewhere (one program: no host round trips between stages). The strategy's class is the
class that runs; which runtime it holds is chosen once, when it is made (`implementation`).
"""

from __future__ import annotations

import jax

from jaxpar import data as datalib
from jaxpar import mesh as meshlib
from jaxpar import step as steplib
from jaxpar.errors import ConfigError
from jaxpar.mesh import DATA, STAGE
from jaxpar.parallel.base import Strategy
from jaxpar.parallel.pipeline import facts, inner_cut, partition
from jaxpar.parallel.pipeline.host.placement import Placement
from jaxpar.parallel.pipeline.host.runtime import HostRuntime
from jaxpar.parallel.pipeline.schedules import (FIXED_VIRTUAL, ScheduleError, bubble_theory, build, timed_bubble,
                                                virtual_stages)
from jaxpar.parallel.pipeline.spmd.layout import PaddedStages
from jaxpar.parallel.pipeline.spmd.runtime import SpmdRuntime
from jaxpar.parallel.pipeline.stage_fns import StageFunctions
from jaxpar.parallel.transport import processes

PIPELINE_IMPLS = ("auto", "spmd", "mpmd")


def resolve_impl(impl: str) -> str:
    """"spmd" or "mpmd" for `--pipeline-impl`, reading the backend for "auto"."""
    if impl not in PIPELINE_IMPLS:
        raise ConfigError(f"unknown --pipeline-impl {impl!r}; choices: {', '.join(PIPELINE_IMPLS)} "
                          "(auto: mpmd on a CPU backend, spmd elsewhere)")
    if impl == "auto":
        return "mpmd" if jax.default_backend() == "cpu" else "spmd"
    return impl


def schedule_problems(config, devices: int, name: str, microbatches: int) -> list[str]:
    """What keeps the schedule from running on `devices` devices (ranks): its stages per
    device against the model's layers and --stage-boundaries, and its own rules
    (micro-batches, `schedules.ScheduleError`)."""
    names = partition.layer_names(config.model)
    try:
        virtual = virtual_stages(name, config.parallel.virtual_stages)
        if virtual > 1 and devices * virtual > len(names):  # (one each: boundary_problems says)
            fix = (f"--mesh {STAGE}={len(names) // virtual}" if name in FIXED_VIRTUAL else
                   f"--virtual-stages {max(1, len(names) // devices)}")
            return [f"--schedule {name} with {virtual} stages per device needs {devices * virtual} layers "
                    f"on --mesh {STAGE}={devices}, but the model has {len(names)}; use {fix}, or a deeper "
                    f"model (--depth, where the model takes it)."]
        build(name, devices, microbatches, virtual)
    except ScheduleError as e:
        return [str(e)]
    return partition.boundary_problems(config.parallel.stage_boundaries, names, devices * virtual)


def runtime_problems(config, devices: int, name: str, microbatches: int, runtime: str) -> list[str]:
    """The SPMD program runs one stage per device (GEMS: a copy of each replica) with whole
    backwards: other schedules run on the host-driven runtime."""
    if runtime != "spmd":
        return []
    try:
        schedule = build(name, devices, microbatches, config.parallel.virtual_stages)
    except ScheduleError:
        return []  # said by schedule_problems
    if not schedule.splits_backward and schedule.stages_per_device == schedule.replicas:
        return []
    return [f"--schedule {name} (its backward split in two, or several stages per device) runs on "
            f"the host-driven runtime: pass --pipeline-impl mpmd (the SPMD program runs one stage per "
            f"device with whole backwards: gpipe, 1f1b)."]


class PipelineStrategy(Strategy):
    """Base of `pipeline`, `gems`, `layer-split` and `hybrid`: stages over STAGE, a schedule,
    a runtime. Subclasses say their schedule, micro-batches and replica copies."""

    family = "model parallel"
    models = None  # any model: a sequence of layers (`model.layers()`)
    default_axes = {STAGE: -1}
    axes = (STAGE,)
    batch_norm_per_shard = True  # per micro-batch statistics
    data_axis: str | None = None  # batch axis (hybrid: DATA)
    multiprocess = True  # stages on one global mesh under jax.distributed
    replicas = 1  # copies of the model on the stage devices (gems: 2)

    def __init__(self, config):
        super().__init__(config)
        self.implementation = self.runtime_kind(config)
        self.runtime: SpmdRuntime | HostRuntime | None = None

    @classmethod
    def runtime_kind(cls, config) -> str:
        """Which runtime runs this strategy for `config` here: "spmd" or "mpmd"."""
        return resolve_impl(config.parallel.pipeline_impl)

    @classmethod
    def check(cls, config, axes):
        devices, shards = axes.get(STAGE, 1), axes.get(DATA, 1) if cls.data_axis else 1
        m, batch = cls.microbatches_of(config), config.data.batch_size
        problems = []
        if devices < 2:
            problems.append(f"--strategy {cls.name} needs --mesh {STAGE}=S with S >= 2 stages.")
        else:
            name, m = cls.schedule_of(config), cls.microbatches_of(config)
            problems += (schedule_problems(config, devices, name, m)
                         + runtime_problems(config, devices, name, m, cls.runtime_kind(config)))
        if batch % (shards * m):
            problems.append(f"--microbatches {m} must divide the --batch-size {batch} rows of each "
                            f"of the {shards} data shard(s); make --batch-size a multiple of {shards * m}.")
        return problems

    # --- what subclasses choose ----------------------------------------------------------------
    @classmethod
    def microbatches_of(cls, config) -> int:
        return config.parallel.microbatches

    @classmethod
    def schedule_of(cls, config) -> str:
        return config.parallel.schedule

    def schedule_name(self) -> str:
        return self.schedule_of(self.config)

    @property
    def remat(self) -> bool:
        return self.config.parallel.remat

    def bubble_theory(self) -> float:
        """GPipe's and 1F1B's (S-1)/(M+S-1); any other schedule's from its own lists, a
        backward twice a forward (`schedules.timed_bubble`)."""
        if self.schedule.name in ("gpipe", "1f1b"):
            return bubble_theory(self.S, self.M)
        return timed_bubble(self.schedule)

    def cuts_inside_layers(self) -> bool:
        """Whether stages may part a layer (`inner_cut`): where each stage has a worker of its
        own (an accelerator, a process, a simulated device on a thread of its own), not on CPU
        devices sharing XLA's threads in one process (measured: `inner_cut`'s docstring); the
        SPMD program holds whole layers."""
        if self.implementation == "spmd":
            return False
        return jax.default_backend() != "cpu" or processes.many() or meshlib.single_threaded()

    # --- set-up -----------------------------------------------------------------------------
    def init(self, model, tx, mesh):
        self.mesh, self.tx = mesh, tx
        problems = self.check(self.config, meshlib.mesh_shape(mesh))
        if problems:
            raise ConfigError(" ".join(problems))
        self.S, self.M = mesh.shape[STAGE], self.microbatches_of(self.config)
        self.schedule = build(self.schedule_name(), self.S, self.M, self.config.parallel.virtual_stages)
        self.plan = inner_cut.plan(self.config, self.schedule.stages, inside=self.cuts_inside_layers())
        _, ref_params, ref_state = steplib.split_model(model)
        ref = steplib.init_state(ref_params, ref_state, tx)
        self.runtime = self._spmd(model) if self.implementation == "spmd" else self._host(model)
        return self.runtime.init_state(ref)

    @property
    def image_shape(self) -> tuple[int, ...]:
        return datalib.spec(self.config.data).image_shape

    def _spmd(self, model) -> SpmdRuntime:
        shards = self.mesh.shape[self.data_axis] if self.data_axis else 1
        stages = self.padded_stages(model, self.config.data.batch_size // (shards * self.M))
        self.names = stages.stage_of_layers()
        return SpmdRuntime(stages, self.schedule, self.mesh, self.tx, self.remat, self.data_axis,
                           self.trace_counts)

    def padded_stages(self, model, rows: int) -> PaddedStages:
        return PaddedStages(model, self.plan.starts, rows, image_shape=self.image_shape,
                            replicas=lambda d: [self.schedule.placement[r][d] for r in range(self.replicas)])

    def _host(self, model) -> HostRuntime:
        cut = self.plan.stages(model, self.image_shape)
        self.names = cut.names
        placement = self.placement(cut)
        fns = self.stage_functions(cut, placement)
        return HostRuntime(self.schedule, fns, placement, self.plan, self.trace_counts, cut.boundaries)

    def stage_functions(self, cut, placement) -> StageFunctions:
        return StageFunctions.of(cut.model, cut.ranges, cut.keys, self.tx, self.M, self.replicas, self.remat)

    def placement(self, cut) -> Placement:
        return Placement(self.mesh, self.schedule)

    @property
    def devices(self) -> list:
        """The device of each stage position (a hybrid stage's: its sub-mesh's first)."""
        return self.runtime.placement.devices if self.implementation == "mpmd" else list(self.mesh.devices.flat)

    # --- the interface, run by the runtime ---------------------------------------------------
    def rows_multiple(self) -> int:
        # Training batches are also cut into M micro-batches per shard (checked up front);
        # evaluation runs one micro-batch, so its batches need only split over the shards.
        return self.mesh.shape[self.data_axis] if self.data_axis else 1

    def place_batch(self, batch):
        return self.runtime.place_batch(self.pad(batch))

    def step(self, state, batch):
        return self.runtime.step(state, batch)

    def gradients(self, state, batch):
        return self.runtime.gradients(state, batch)

    def eval_step(self, state, batch):
        return self.runtime.eval_step(state, batch)

    def host_sums(self, sums):
        return self.runtime.host_sums(sums)

    def compile(self, name, state, batch):
        return self.runtime.compile(name, state, batch)

    def timeline(self, state, batch) -> list[dict]:
        """A measured per-device timeline of one step (the host runtime's stamped walk;
        `bench --timeline` refuses the SPMD runtime before any work)."""
        return self.runtime.timeline(state, batch)

    def stamp_programs(self) -> bool:
        """Whether the step runs as one program per process; if so, its programs stamp each
        action and receive from their first trace on (`program_timeline`)."""
        return self.runtime.stamp_programs()

    def program_timeline(self, stamps) -> dict:
        """The steps those programs stamped (`host.timeline.program_timeline`; a collective)."""
        return self.runtime.program_timeline(stamps)

    def serial_steps(self, state, batch, walks: int = 3):
        """Every action's programs timed alone, `walks` times (`host.serial`)."""
        return self.runtime.serial_steps(state, batch, walks)

    def walked_seconds(self, state, batch, iters: int = 10) -> list[float]:
        """The host walk's time, its programs overlapping (`HostRuntime.walked_seconds`)."""
        return self.runtime.walked_seconds(state, batch, iters)

    def state_to_reference(self, state):
        return self.runtime.state_to_reference(state)

    def state_from_reference(self, ref):
        return self.runtime.state_from_reference(ref)

    # --- what it reports --------------------------------------------------------------------------
    def describe(self) -> dict:
        facts_ = {**facts.plan_facts(self.plan, self.names),
                  **facts.schedule_facts(self.schedule, self.plan, self.bubble_theory())}
        if self.replicas > 1:
            facts_["replicas"] = self.replicas
            facts_["stages_per_device"] = [[self.schedule.placement[r].index(d) for r in range(self.replicas)]
                                           for d in range(self.S)]
        runtime = self.runtime.facts(self.config.data.batch_size)
        return {**super().describe(), **facts_, **runtime, "remat": self.remat}

    def theory(self) -> dict[str, int]:
        return self.runtime.theory(self.config.data.batch_size)

    def accounting(self, programs, state) -> dict:
        return {**super().accounting(programs, state), **self.runtime.accounting(programs),
                "bubble_fraction": self.describe()["bubble_fraction"], "bubble_theory": self.bubble_theory()}
