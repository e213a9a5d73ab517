"""What a strategy is and supports, before it runs: its name, family, the models and mesh axes
it takes, its options and checks, and what its step costs (`cost`). `Strategy` (base.py) adds
how it runs; the CLI, studies and docs read these class attributes without any device.

    STRATEGIES["fsdp"].default_mesh(4)        # {"data": 4}
    STRATEGIES["pipeline"].check(config, {"stage": 2})   # [] or sentences naming the fix
"""

from __future__ import annotations

from typing import Any, Callable

from jaxpar import mesh as meshlib
from jaxpar.config import ModelConfig, TrainConfig
from jaxpar.errors import ConfigError
from jaxpar.models import has_batch_norm

# The families strategies belong to, in the order tables and figures list them.
FAMILIES = ("reference", "data parallel", "model parallel", "hybrid", "multi-process")


class StrategySpec:
    """What a strategy is and supports, read from its class without devices: the CLI, the
    studies, the tables and the error messages read these attributes, and no list of
    strategies or of the models they take exists anywhere else."""

    name: str = ""
    family: str = ""          # one of FAMILIES
    summary: str = ""         # what it does, in one line (docs tables, `--help`)
    # Models it can place, by registry name (jaxpar.models.MODELS); None = every model.
    models: tuple[str, ...] | None = None
    # Mesh axes when --mesh is not given; -1 = the devices left (see `default_mesh`).
    default_axes: dict[str, int] = {meshlib.DATA: -1}
    # The axes it may spread over (size > 1); () = one device.
    axes: tuple[str, ...] = (meshlib.DATA,)
    # Runs across processes on one jax.distributed global mesh (its place_batch takes
    # process-local rows); checked at start-up when launched under mpiexec/srun.
    multiprocess: bool = False
    # Joins ranks with MPI itself (mpi4jax collectives inside jit), not jax.distributed.
    uses_mpi: bool = False
    # Its step runs per batch shard (shard_map, pmap, one MPI rank), so batch norm normalises
    # with each shard's own statistics; False: over the whole global batch, like `single`.
    batch_norm_per_shard: bool = False
    # Trains models with batch norm (False: `mpi-pipeline`, whose ranks keep no statistics of
    # each other's stages; `check_model` refuses such a model).
    carries_batch_norm: bool = True
    # The strategy-specific ParallelConfig options it reads; another strategy's option given a
    # non-default value is refused (`jaxpar.validate`), never silently ignored.
    options: tuple[str, ...] = ()

    @classmethod
    def check(cls, config: TrainConfig, axes: dict[str, int]) -> list[str]:
        """What cannot work in `config` on a mesh of `axes` (resolved sizes), one sentence
        each naming the flag to change; [] when it can run. Checked before any work."""
        return []
    # Later calls run the executables `compile` made (False: keep calling through `jit`).
    runs_executables: bool = True

    @classmethod
    def check_model(cls, model: str | ModelConfig) -> None:
        """ConfigError naming the fix unless this strategy takes `model` (a name, or the
        model's options: the CNN's --batch-norm): one of its `models`, and one without batch
        norm if it does not carry the statistics."""
        cfg = model if isinstance(model, ModelConfig) else ModelConfig(model)
        if cls.models is not None and cfg.model not in cls.models:
            raise ConfigError(f"--strategy {cls.name} cannot place --model {cfg.model}; it takes "
                              f"--model {' or '.join(cls.models)}")
        if not cls.carries_batch_norm and has_batch_norm(cfg):
            raise ConfigError(f"--strategy {cls.name} does not carry batch-norm statistics between "
                              "its stages; use a model without batch norm (not resnet, no "
                              "--batch-norm) or a strategy that does (e.g. --strategy pipeline)")

    @classmethod
    def default_mesh(cls, devices: int) -> dict[str, int]:
        """The axis sizes this strategy uses on `devices` devices when --mesh is not given."""
        if not cls.axes:
            return dict(cls.default_axes)  # one device (the first), however many are present
        return meshlib.resolve_axes(dict(cls.default_axes), devices)

    @classmethod
    def mesh_axes(cls, spec: str, devices: int) -> dict[str, int]:
        """Resolved axis sizes for `--mesh spec` ('' = `default_mesh`) on `devices` devices;
        MeshError naming the fix when the strategy cannot use that mesh. Needs no devices, so
        a study checks a point's mesh before starting the point's process."""
        axes = meshlib.parse_mesh(spec)
        if not axes:
            return cls.default_mesh(devices)
        unused = [a for a, size in axes.items() if a not in cls.axes and size != 1]
        if unused:
            uses = (f"the {' and '.join(cls.axes)} ax{'es' if len(cls.axes) > 1 else 'is'}"
                    if cls.axes else "one device")
            example = ",".join(f"{a}=N" for a in cls.axes)
            raise meshlib.MeshError(f"--strategy {cls.name} uses {uses}; drop "
                                    f"{', '.join(unused)} from --mesh {spec!r} (e.g. --mesh {example})")
        return meshlib.resolve_axes(axes, devices)

    # What its step costs, as a function of a `jaxpar.cost.Problem` returning a
    # `jaxpar.cost.Work` (each device's compute, its collectives, memory); None: not modelled.
    cost_model: Callable | None = None

    @classmethod
    def cost(cls, problem) -> Any:
        """Its predicted work for `problem` (`jaxpar.cost.predict` prices it on a machine).

        Raises:
          NotImplementedError: the strategy states no cost.
        """
        if cls.cost_model is None:
            raise NotImplementedError(f"--strategy {cls.name} states no cost model")
        return cls.cost_model(problem)
