"""What `pipeline` and `gems` are, whichever way their stages run (`--pipeline-impl`).

Two formulations execute the same schedule tables (`schedules`) with the same results:

- `spmd`: one SPMD program over the STAGE axis (`pipeline.py`): every stage a branch of
  `lax.switch`, the ticks or slots a `lax.scan`, activations moved with `lax.ppermute`;
  stages padded to one shape (`stages.py`).
- `mpmd`: one program per stage on its own device (hybrid: its data x tensor sub-mesh), the
  table walked from the host (`host_pipeline.py`): no control flow around the stage's layers,
  no padding.

`auto` takes mpmd on a CPU backend, where XLA runs convolutions inside a conditional or a
loop body on a slow path (a conv's forward and backward ~20x slower inside `lax.switch`), and
spmd elsewhere (one program: no host round trips between stages). The mixins below hold the
strategies' public face (name, options, checks), shared by both formulations, so a strategy
is one name in the registry and its class picks the formulation (`formulation`).
"""

from __future__ import annotations

import jax

from jaxpar.parallel.pipeline import cost
from jaxpar.errors import ConfigError
from jaxpar import mesh as meshlib
from jaxpar.mesh import DATA, STAGE, TENSOR
from jaxpar.parallel.tensor import megatron
from jaxpar.parallel.pipeline import partition

PIPELINE_IMPLS = ("auto", "spmd", "mpmd")


def resolve_impl(impl: str) -> str:
    """"spmd" or "mpmd" for `--pipeline-impl`, reading the backend for "auto"."""
    if impl not in PIPELINE_IMPLS:
        raise ConfigError(f"unknown --pipeline-impl {impl!r}; choices: {', '.join(PIPELINE_IMPLS)} "
                          "(auto: mpmd on a CPU backend, spmd elsewhere)")
    if impl == "auto":
        return "mpmd" if jax.default_backend() == "cpu" else "spmd"
    return impl


class PipelineFace:
    """`pipeline`: the model's layers cut into S stages, M micro-batches, GPipe or 1F1B."""

    name = "pipeline"
    family = "model parallel"
    summary = ("any model's layers cut into stages balanced by FLOPs, one per device over "
               "`stage`; `--microbatches M`, `--schedule gpipe|1f1b`, `--remat`, "
               "`--stage-boundaries`; stages as one SPMD program or one program each "
               "(`--pipeline-impl`)")
    models = None  # any model: a sequence of layers (`model.layers()`)
    default_axes = {STAGE: -1}
    axes = (STAGE,)
    options = ("microbatches", "schedule", "remat", "stage_boundaries", "pipeline_impl")
    batch_norm_per_shard = True  # per micro-batch statistics
    data_axis: str | None = None  # batch axis (hybrid: DATA)
    multiprocess = True  # stages on one global mesh under jax.distributed
    cost_model = staticmethod(cost.pipeline)  # at its bound, either formulation

    @classmethod
    def check(cls, config, axes):
        stages, shards = axes.get(STAGE, 1), axes.get(DATA, 1) if cls.data_axis else 1
        m, batch = config.parallel.microbatches, config.data.batch_size
        problems = []
        if stages < 2:
            problems.append(f"--strategy {cls.name} needs --mesh {STAGE}=S with S >= 2 stages.")
        else:
            problems += partition.boundary_problems(config.parallel.stage_boundaries,
                                                    partition.layer_names(config.model), stages)
        if batch % (shards * m):
            problems.append(f"--microbatches {m} must divide the --batch-size {batch} rows of each "
                            f"of the {shards} data shard(s); make --batch-size a multiple of {shards * m}.")
        return problems


class GemsFace(PipelineFace):
    """`gems`: two replicas on the same S devices in opposite directions."""

    name = "gems"
    summary = ("two model replicas on the same `stage` devices in opposite directions, each "
               "filling the other's bubble (GEMS / Chimera); `--microbatches M` split between them")
    options = ("microbatches", "stage_boundaries", "pipeline_impl")
    multiprocess = False  # not yet tested on a mesh over processes (pipeline is)
    cost_model = staticmethod(cost.gems)

    @classmethod
    def check(cls, config, axes):
        problems = super().check(config, axes)
        stages, m = axes.get(STAGE, 1), config.parallel.microbatches
        if stages % 2:
            problems.append(f"--strategy gems pairs device d with device S-1-d; --mesh {STAGE}={stages} "
                            f"is odd (the middle device would hold one stage twice and no bubble is "
                            f"saved): use an even number of stages.")
        if m % 2:
            problems.append(f"--microbatches {m} must be even for --strategy gems: half of them go down "
                            f"each replica.")
        return problems


class HybridFace(PipelineFace):
    """`hybrid`: `pipeline` with each stage's blocks split over TENSOR and the batch over DATA."""

    name = "hybrid"
    family = "hybrid"
    summary = ("data x tensor x stage on one mesh: pipeline stages, Megatron-split blocks, "
               "data-sharded batch")
    models = ("stack-mlp", "vit")  # blocks that split column -> row, no batch norm
    data_axis = DATA
    axes = (DATA, TENSOR, STAGE)

    @classmethod
    def check(cls, config, axes):
        return super().check(config, axes) + megatron.split_problems(config, axes.get(TENSOR, 1), cls.name)

    @classmethod
    def default_mesh(cls, devices):
        """2 stages; tensor=2 when 4 devices divide; data = the rest (4: tensor=2 x stage=2,
        8: data=2 x tensor=2 x stage=2)."""
        tensor = 2 if devices % 4 == 0 else 1
        return meshlib.resolve_axes({DATA: -1, TENSOR: tensor, STAGE: 2}, devices)

    @classmethod
    def mesh_axes(cls, spec, devices):
        axes = super().mesh_axes(spec, devices)
        # All three present (specs name them), in the order given (outermost first).
        return {**{a: 1 for a in meshlib.AXES if a not in axes}, **axes}

    def mesh_facts(self) -> dict:
        shape = meshlib.mesh_shape(self.mesh)
        return {"data": shape[DATA], "tensor": shape[TENSOR]}
