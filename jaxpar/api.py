"""jaxpar as a library: train or benchmark any Flax NNX classifier on your arrays, under any
strategy and mesh, with the loop, checkpoints, events and results of the command line (whose
`train` and `bench` call `run` and `run_bench` below: one loop, two front ends).

    import jaxpar
    data = jaxpar.Dataset.from_arrays(train_x, train_y, test_x=test_x, test_y=test_y)
    trained = jaxpar.fit(MyNet, data, strategy="fsdp", mesh="data=4", epochs=3, val_size=500)
    trained.result.metrics["test_accuracy"], trained.predict(test_x[:8])
    jaxpar.benchmark(MyNet, data, strategy="fsdp", mesh="data=4").metrics["images_per_sec"]

A model is a registered name ("cnn", or one given to `register_model`), a factory (a model
class, called with the keyword arguments among rngs, num_classes and in_features that it
names) or an nnx.Module instance (trained from its own parameters). Options are the command
line's flags with underscores (`batch_size=64` for `--batch-size 64`). docs/library.md.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar import data as datalib
from jaxpar.runtime import distributed, watchdog
from jaxpar import models, results
from jaxpar import bench as benchlib
from jaxpar.config import TrainConfig, with_options
from jaxpar.data import Dataset
from jaxpar.runtime.distributed import launcher
from jaxpar.errors import ConfigError, Diverged
from jaxpar.mesh import WITHIN_FIRST, describe_layout, simulate_cpu_devices
from jaxpar.parallel import STRATEGIES
from jaxpar.step import normalize, split_model
from jaxpar.train import Outcome
from jaxpar.train import fit as train_loop
from jaxpar.validate import validate, validate_options

ModelLike = str | Callable[..., nnx.Module] | nnx.Module
DataLike = str | Dataset


@dataclasses.dataclass
class Trained:
    """What `fit` returns: the run's result and the trained model."""

    result: results.RunResult      # what OUT/result.json holds (written when `out` is given)
    model: nnx.Module              # the final parameters and statistics, on one device

    def predict(self, images: np.ndarray) -> np.ndarray:
        """Class indices for uint8 images [N, H, W, C], normalised as training saw them."""
        logits = self.model(normalize(jnp.asarray(images)), train=False)
        return np.asarray(jnp.argmax(logits, -1))


def register_model(name: str, factory: Callable[..., nnx.Module]) -> str:
    """Make `factory` the model `name` for `fit`, `benchmark` and `--model name` in this process."""
    return models.register_model(name, factory)


def model_name(model: ModelLike, name: str | None = None) -> str:
    """The registry name of `model`, registering a factory or an instance (under `name`, by
    default its class's or function's name)."""
    if isinstance(model, str):
        if name is not None and name != model:
            raise ConfigError(f"model {model!r} is already a name; drop name={name!r}")
        return model
    if isinstance(model, nnx.Module):
        # A host copy: later changes to the caller's instance change no run, and a run (whose
        # strategies donate their state's buffers) never deletes the caller's arrays.
        graphdef, state = nnx.split(model)
        host = jax.device_get(state)

        def factory():  # the instance's own parameters: no seed
            return nnx.merge(graphdef, jax.tree.map(jnp.asarray, host))

        return models.register_model(name or type(model).__name__, factory)
    if callable(model):
        return models.register_model(name or getattr(model, "__name__", "model"), model)
    raise ConfigError(f"model must be a registered name, a model class or factory, or an "
                      f"nnx.Module; got {type(model).__name__}")


def configure(model: ModelLike, data: DataLike, *, name: str | None = None, **options: Any) -> TrainConfig:
    """The TrainConfig that trains `model` on `data` with `options` (the command line's flags
    with underscores: strategy, mesh, devices, epochs, batch_size, lr, optimizer, out,
    checkpoint_dir, resume, events, ...), registering the model and the dataset.

    Raises:
      ConfigError naming an unknown option.
    """
    dataset = datalib.register_dataset(data) if isinstance(data, Dataset) else data
    try:
        return with_options(TrainConfig(), model=model_name(model, name), dataset=dataset,
                            **options)
    except ValueError as e:  # an unknown option name
        raise ConfigError(str(e)) from None


def fit(model: ModelLike, data: DataLike, *, verbose: bool = False, name: str | None = None,
        **options: Any) -> Trained:
    """Train `model` on `data` (a `Dataset`, or a dataset's name: "fashion_mnist", "mnist",
    "synthetic") and return its result and the trained model.

    Args:
      verbose: print the progress bar and one line per validation.
      name: what results and checkpoints call a passed model (default: its class's name).
      options: as `configure`; `out` writes OUT/result.json, `checkpoint_dir` checkpoints.
    Raises:
      ConfigError, DataError (nothing run or written); Diverged (a non-finite loss: its
      `result` says where; written to `out`).
    """
    config = configure(model, data, name=name, **options)
    outcome = run(config, console=_console(verbose))
    return Trained(outcome.result, trained_model(config, outcome))


def benchmark(model: ModelLike, data: DataLike = "synthetic", *, iters: int = 20, warmup: int = 3,
          matmul_peak: bool = True, verbose: bool = False, name: str | None = None,
          **options: Any) -> results.RunResult:
    """Time `iters` training steps of `model` (batches of `data`'s image shape and classes)
    under the strategy and mesh in `options`; the result `python -m experiments bench` writes."""
    config = configure(model, data, name=name, **options)
    return run_bench(config, iters=iters, warmup=warmup, matmul_peak=matmul_peak,
                     console=_console(verbose))


def _console(verbose: bool):
    if not verbose:
        return None
    from rich.console import Console  # only a verbose run prints

    return Console()


def trained_model(config: TrainConfig, outcome: Outcome) -> nnx.Module:
    """The model `config` builds, holding `outcome`'s final state (reference layout)."""
    graphdef, _, _ = split_model(models.abstract_model(config.model, datalib.spec(config.data)))
    ref = outcome.strategy.state_to_reference(outcome.state)
    return nnx.merge(graphdef, ref.params, ref.model_state)


def run(config: TrainConfig, *, out: str | None = None, console=None,
        record: dict | None = None) -> Outcome:
    """Train `config` in this process: devices, processes, every check before any work, the
    loop, and OUT/result.json on the main process (`out`, default `config.out`; None: none).

    Args:
      console: a rich Console for progress (None: quietly).
      record: a study point's settings, recorded in the result as config["point"].
    """
    out = config.out if out is None else out
    with _started(config, out, console) as console:
        try:
            outcome = train_loop(config, console=console)
        except Diverged as stop:  # its result says where and why; the caller reports it
            _save(stop.result, out, console, record, quiet=True)
            raise
        _save(outcome.result, out, console, record)
    return outcome


def run_bench(config: TrainConfig, *, iters: int = 20, warmup: int = 3, matmul_peak: bool = True,
              timeline: bool = False, wire: str | None = None, out: str | None = None,
              console=None, record: dict | None = None) -> results.RunResult:
    """Time `config`'s step in this process (as `run` sets it up); prints its report to
    `console` and writes OUT/result.json when `out` (default `config.out`) is set."""
    out = config.out if out is None else out
    with _started(config, out, console) as console:
        result = benchlib.benchmark(config, iters=iters, warmup=warmup, matmul_peak=matmul_peak,
                                    timeline=timeline, wire=wire)
        if console is not None:
            console.print(benchlib.report(result))
        _save(result, out, console, record)
    return result


def distributed_mode(config: TrainConfig) -> str:
    """mpi4jax strategies join ranks with MPI itself; the rest join them with jax.distributed."""
    cls = STRATEGIES[config.parallel.strategy]
    if cls.uses_mpi:
        return "none"
    mode = config.parallel.distributed
    many = mode in ("mpi", "slurm") or (mode == "auto" and launcher() is not None)
    if many and not cls.multiprocess:
        able = [n for n, c in STRATEGIES.items() if c.multiprocess or c.uses_mpi]
        raise ConfigError(f"--strategy {cls.name} cannot run across processes (not built or tested "
                          f"for one global mesh over ranks); launch one process, or pick one that "
                          f"can: {', '.join(able)}")
    return mode


@contextmanager
def _started(config: TrainConfig, out: str | None, console) -> Iterator[Any]:
    """Devices and processes set up and every option checked, then `out` made writable; a run
    that fails leaves no folder it created. Yields the console of the main process (others
    print nothing)."""
    simulate_cpu_devices(config.parallel.devices)  # before JAX's backend starts
    validate_options(config)  # before processes join: every rank fails alike, none mid-start
    distributed.set_collective_timeout(config.parallel.collective_timeout)  # heartbeat, sockets
    distributed.setup(distributed_mode(config), config.parallel.single_thread,
                      config.parallel.devices or 1)
    validate(config)  # every option and combination, before any work or write
    created = out is not None and not Path(out).exists()
    if out is not None:
        results.ensure_writable(out)  # fail before the work, not after it
    console = console if distributed.is_main() else None
    announce_layout(config, console)
    _watch(config, out)
    try:
        yield console
    except BaseException as e:
        if created and not isinstance(e, Diverged):
            _remove_if_empty(Path(out))  # a failed run leaves no folder behind
        raise
    finally:
        watchdog.stop()


def _watch(config: TrainConfig, out: str | None) -> Path | None:
    """In a multi-process run, start this process's watchdog (docs/faults.md): every wait for
    another process bounded by --collective-timeout. Under jax.distributed, XLA's and the
    other C/C++ messages of this process go to a log file (returned) whose aborts it explains,
    OUT/logs/rank-R.log (or a temporary folder's without --out), until the run ends."""
    found = distributed.world()
    if found is None or not config.parallel.watchdog:
        return None
    rank, size, exchange = found
    log = None
    if jax.distributed.is_initialized():
        folder = Path(out) / "logs" if out is not None else Path(tempfile.gettempdir()) / "jaxpar-logs"
        log = folder / (f"rank-{rank}.log" if out is not None else f"{os.getpid()}-rank-{rank}.log")
    watchdog.start(rank, size, exchange, config.parallel.collective_timeout, log,
                   what=config.parallel.strategy)
    return log


def _save(result: results.RunResult, out: str | None, console, record: dict | None,
          quiet: bool = False) -> None:
    """Write OUT/result.json on the main process (nothing when `out` is None)."""
    if record is not None:
        result.config["point"] = record
    if out is None or not distributed.is_main():
        return
    path = results.save(result, out)
    if console is not None and not quiet:
        console.print(f"wrote {path}")


def announce_layout(config: TrainConfig, console) -> None:
    """On a global mesh over processes, say which axes sit within a process, which across."""
    if console is None or jax.process_count() == 1:
        return
    axes = STRATEGIES[config.parallel.strategy](config).mesh_layout(jax.devices())
    how = ("as --mesh orders them" if config.parallel.mesh else
           f"by default {' then '.join(WITHIN_FIRST[:-1])} within a process")
    console.print(f"{describe_layout(axes, jax.process_count(), jax.local_device_count())} "
                  f"({how}; --mesh lists axes outermost first, the last within a process)")


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (a checkpoint, a partial result of the run): leave it


def default_out(config: TrainConfig) -> str:
    """The command line's folder for a run without --out: results/<model>-<strategy>-<time>."""
    return f"results/{config.model.model}-{config.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"


__all__ = ["Dataset", "Trained", "benchmark", "configure", "fit", "model_name", "register_model",
           "run", "run_bench", "trained_model"]
