"""Checkpoints that lose nothing: orbax, in the reference layout, for every strategy.

A checkpoint holds the whole training state in the single-device layout
(`Strategy.state_to_reference`: parameters, optimizer state with its step count, model state),
the data-order position (step, epoch, batch within the epoch; the order itself is a pure
function of (seed, epoch)), the loop's running metrics and history, and the config as JSON.
Because it is in the reference layout, a checkpoint written under one strategy or mesh
restores under any other (`state_from_reference`): 8 devices -> 2, dp -> single.

    python -m experiments train --model mlp --checkpoint-dir ckpt/run1 --checkpoint-every 500
    python -m experiments train --model mlp --checkpoint-dir ckpt/run1 --resume

Atomic: orbax writes each step into a temporary folder and renames it when complete, so a
killed writer leaves no step that looks complete; a step that is complete-looking but
unreadable (truncated by a lost disk, say) is skipped for the previous one with a warning.
Multi-process: under jax.distributed every process calls save/restore (orbax's collectives);
orbax's primary process (jax.process_index() == 0) writes the JSON metadata. MPI ranks that
are each a JAX runtime of their own (the mpi4jax strategies) all hold the same reference state
(`state_to_reference` gathers it), so rank 0 alone writes it and every rank reads it.
"""

from __future__ import annotations

import json
import signal
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.results import portable
from jaxpar.config import RESUME_AUTO, TrainConfig, to_dict
from jaxpar.runtime.distributed import mpi_rank
from jaxpar.errors import ConfigError
from jaxpar.runtime.optional import require
from jaxpar.results import write_atomic

FORMAT = "jaxpar-checkpoint-v1"
COMMIT_MARK = "commit_success.txt"  # orbax's, in each finished step and item folder
TMP_MARK = ".orbax-checkpoint-tmp"  # in the name of a folder orbax has not finished writing
# Options that may change between a run and its resume: where and how it is placed
# (the point of reference-layout checkpoints), and bookkeeping that does not touch the
# numbers. Everything else (data, model, optimizer, seed, length) fixes the trajectory.
RESUMABLE = {"parallel", "out", "progress", "events", "eval_every", "checkpoint_dir", "checkpoint_every",
             "resume", "data.data_dir", "data.cache_dir", "data.eval_batch_size"}


def orbax():
    """orbax.checkpoint, imported when a run checkpoints (MissingDependency when absent)."""
    return require("orbax.checkpoint", "checkpoints (--checkpoint-dir, --resume)")


class CheckpointError(ConfigError):
    """A checkpoint directory that cannot be used as asked; the message names the fix."""


class Interrupted(Exception):
    """SIGTERM or Ctrl-C stopped training after a checkpoint was saved."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for "killed by signal"


def _key(path) -> str:
    """'params/blocks/0/kernel' from a pytree path: int keys (nnx.List) become strings and
    optax's namedtuple fields become names, so orbax sees one flat dict of plain strings."""
    parts = []
    for p in path:
        for attr in ("key", "name", "idx"):
            if hasattr(p, attr):
                parts.append(str(getattr(p, attr)))
                break
    return "/".join(parts)


def flatten(tree: Any) -> dict[str, np.ndarray]:
    """{path string: host array} for every leaf of `tree`."""
    return {_key(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(target: Any, flat: dict[str, np.ndarray]) -> Any:
    """`target`'s structure with leaves taken from `flat` (keys as `flatten` writes them)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    return jax.tree_util.tree_unflatten(treedef, [flat[_key(p)] for p, _ in paths])


def _config_diff(saved: dict, current: dict) -> list[str]:
    """Options that differ and may not (`RESUMABLE` lists those that may)."""
    out = []
    for name, value in current.items():
        if isinstance(value, dict):
            out += [f"{name}.{k}" for k in _config_diff(saved.get(name, {}), value)
                    if name not in RESUMABLE and f"{name}.{k}" not in RESUMABLE]
        elif name not in RESUMABLE and saved.get(name) != value:
            out.append(name)
    return out


def _diff_message(saved: dict, current: dict, names: list[str]) -> str:
    def get(d, n):
        for part in n.split("."):
            d = d.get(part, {}) if isinstance(d, dict) else None
        return d
    return ", ".join(f"--{n.split('.')[-1].replace('_', '-')} {get(saved, n)!r} (now {get(current, n)!r})"
                     for n in names)


class Checkpointer:
    """Saves and restores one run's checkpoints in `config.checkpoint_dir`.

    Construct before any work: it checks the directory (and, with --resume, that a
    checkpoint exists) before anything is written, so bad input overwrites nothing.
    """

    def __init__(self, config: TrainConfig, max_to_keep: int = 3):
        self.config = config
        self.directory = Path(config.checkpoint_dir).absolute()
        self.every = config.checkpoint_every
        self.signum: int | None = None
        self.last_saved: int | None = None
        self._handlers: dict[int, Any] = {}
        steps = self._complete_steps()
        # --resume auto: continue when a checkpoint is there, else start (a requeued job).
        self.resuming = bool(steps) if config.resume == RESUME_AUTO else bool(config.resume)
        if config.resume is True and not steps:
            what = "does not exist" if not self.directory.exists() else (
                "holds no jaxpar checkpoint" if any(self.directory.iterdir()) else "is empty")
            raise CheckpointError(f"--checkpoint-dir {str(self.directory)!r} {what}; drop "
                                  f"--resume to start a new run there (--resume {RESUME_AUTO} starts "
                                  "or continues)")
        if not self.resuming and self._used():
            latest = f" (latest step {steps[-1]})" if steps else ""
            raise CheckpointError(f"--checkpoint-dir {str(self.directory)!r} is not empty{latest}; "
                                  "pass --resume to continue it or choose an empty --checkpoint-dir")
        ocp = self._ocp = orbax()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        # Each MPI rank its own JAX runtime: orbax on every rank would write the same folders.
        self.writes = jax.process_count() > 1 or mpi_rank()[0] == 0

    def _used(self) -> bool:
        """Whether the folder holds anything a new run must not write beside. Under --resume
        auto a first save that a kill interrupted (orbax's temporary folder) is not: the
        requeued job starts again."""
        if not self.directory.is_dir():
            return False
        ignored = TMP_MARK if self.config.resume == RESUME_AUTO else None
        return any(ignored is None or ignored not in p.name for p in self.directory.iterdir())

    def _complete_steps(self) -> list[int]:
        """Steps whose folder orbax finished (renamed from its temporary name)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir()
                      if p.is_dir() and p.name.isdigit() and (p / "meta").is_dir())

    # --- save ------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, ref_state: Any, progress: dict) -> Path:
        """Write step `step` (asynchronously; `close` waits). Returns its folder.

        Args:
          ref_state: `strategy.state_to_reference(state)` (host arrays).
          progress: JSON-able loop state: epoch, position, running sums, history.
        """
        if not self.writes:  # rank 0 writes the same state
            self.last_saved = step
            return self.directory / str(step)
        if step in self.manager.all_steps():  # a corrupt step skipped on resume: replace it
            self.manager.delete(step)
        flat = flatten(ref_state)
        # A copy: orbax writes in the background while the loop keeps adding to `progress`.
        progress = json.loads(json.dumps(progress))
        meta = {"format": FORMAT, "step": step, "config": to_dict(self.config),
                "leaves": {k: [list(v.shape), str(v.dtype)] for k, v in flat.items()}, **progress}
        args = self._ocp.args
        self.manager.save(step, args=args.Composite(
            state=args.StandardSave(flat), meta=args.JsonSave(meta)), force=True)
        self.last_saved = step
        return self.directory / str(step)

    def close(self) -> None:
        """Wait for the last asynchronous save to be complete on disk (once; later calls do
        nothing)."""
        if getattr(self, "_closed", False):
            return
        self.manager.wait_until_finished()
        self.manager.close()
        if self.writes:
            portable_marks(self.directory)
        self._closed = True

    # --- restore ---------------------------------------------------------------------------
    def restore(self, target: Any) -> tuple[Any, dict]:
        """The latest readable checkpoint, as `target`'s structure, and its metadata.

        Args:
          target: a reference-layout state of the current run (its structure and shapes).
        Raises:
          CheckpointError: the config or a parameter shape differs (naming which).
        """
        flat_target = flatten(target)
        steps = self._complete_steps()
        args = self._ocp.args
        for step in reversed(steps):
            folder = self.directory / str(step)
            try:
                meta = self.manager.restore(step, args=args.Composite(meta=args.JsonRestore()))["meta"]
                if meta.get("format") != FORMAT:
                    raise CheckpointError(f"{folder} is not a jaxpar checkpoint")
            except CheckpointError:
                raise
            except Exception as e:  # unreadable metadata: a damaged step
                self._skip(folder, e, steps)
                continue
            self._check(meta, flat_target, folder)
            try:
                flat = self.manager.restore(step, args=args.Composite(
                    state=args.StandardRestore(flat_target)))["state"]
            except Exception as e:
                self._skip(folder, e, steps)
                continue
            self.last_saved = step  # on disk already: the end of a finished run is not re-saved
            return unflatten(target, flat), meta
        raise CheckpointError(f"no readable checkpoint in --checkpoint-dir {str(self.directory)!r} "
                              f"(steps {steps} all damaged); drop --resume to start over")

    def _skip(self, folder: Path, error: Exception, steps: list[int]) -> None:
        warnings.warn(f"checkpoint {folder} is damaged ({type(error).__name__}: "
                      f"{str(error).splitlines()[0][:200] if str(error) else ''}); "
                      "falling back to the previous one", stacklevel=3)

    def _check(self, meta: dict, flat_target: dict, folder: Path) -> None:
        current = to_dict(self.config)
        names = _config_diff(meta["config"], current)
        if names:
            raise CheckpointError(
                f"checkpoint {folder} was written with different options: "
                f"{_diff_message(meta['config'], current, names)}; resume with the same options "
                "(only strategy, mesh, devices and bookkeeping may change) or use a new --checkpoint-dir")
        saved = meta["leaves"]
        for key, value in flat_target.items():
            want = [list(value.shape), str(value.dtype)]
            if saved.get(key) != want:
                raise CheckpointError(
                    f"checkpoint {folder} holds {key} as {saved.get(key)}, this model has {want}; "
                    "resume with the model options it was saved with")
        if set(saved) != set(flat_target):
            raise CheckpointError(f"checkpoint {folder} holds other state "
                                  f"({sorted(set(saved) ^ set(flat_target))[:3]}...) than this model")

    # --- signals ---------------------------------------------------------------------------
    def __enter__(self):
        """Catch SIGTERM and Ctrl-C: the loop saves at the end of the current step and stops."""
        def request(signum, frame):
            self.signum = signum
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._handlers[sig] = signal.signal(sig, request)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()

    def interrupted(self, folder: Path) -> Interrupted:
        name = signal.Signals(self.signum).name
        how = ("the same command (--resume auto continues it)" if self.config.resume == RESUME_AUTO
               else f"the same command plus --resume (--checkpoint-dir {self.directory})")
        return Interrupted(f"{name}: saved checkpoint {folder}; resume with {how}", self.signum)


def portable_marks(directory: Path) -> None:
    """Orbax's commit marks (`commit_success.txt`, "Checkpoint commit was successful to
    <folder>") rewritten to name their folder relative to its root (jaxpar.results.portable): a
    checkpoint committed with its result (the demo's) names no folder of the machine. Orbax
    only asks whether the file exists."""
    for mark in sorted(directory.glob(f"*/**/{COMMIT_MARK}")):
        written = mark.read_text()
        shown = portable.text(written)
        if shown != written:
            write_atomic(mark, shown)


def load_checkpoint(directory: str, step: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(flat reference-layout state, metadata) of a checkpoint, for tests and analysis.

    Args:
      directory: a --checkpoint-dir.
      step: which step (default: the latest).
    """
    ocp = orbax()
    manager = ocp.CheckpointManager(Path(directory).absolute(),
                                    options=ocp.CheckpointManagerOptions(create=False))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory!r}")
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                        meta=ocp.args.JsonRestore()))
    manager.close()
    return {k: np.asarray(v) for k, v in out["state"].items()}, out["meta"]
