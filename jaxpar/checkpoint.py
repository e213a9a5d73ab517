"""Checkpoints with orbax: the training state in the single-device (reference) layout, so a
run saved under one strategy or mesh resumes under another.

A checkpoint (one orbax step folder, written to a temporary folder and renamed when
complete) holds:
  state  every array of `strategy.state_to_reference(state)` — parameters, optimizer state,
         step counter, batch-norm statistics — as leaves named leaf_00000, leaf_00001, ...
  meta   JSON: the leaves' tree paths, shapes and dtypes (checked against the run that
         restores), the config, the data position (epoch, batch within the epoch; the order
         itself is a pure function of seed and epoch) and the validation history so far.

    manager = Checkpoints(directory)
    manager.save(step, ref_state, meta)
    ref_state, meta = manager.restore_latest(template)
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.config import ConfigError

# Options that may change on resume: where and how the step runs, not what it computes.
RESUMABLE_CHANGES = {("parallel", "strategy"), ("parallel", "devices"), ("parallel", "mesh"),
                     ("parallel", "accumulate"), ("parallel", "microbatches"),
                     ("parallel", "schedule"), ("parallel", "remat"), (None, "steps"),
                     (None, "epochs"), (None, "out"), (None, "progress"), (None, "checkpoint_every"),
                     (None, "resume"), (None, "checkpoint_dir"), ("data", "data_dir"),
                     ("data", "cache_dir"), ("data", "eval_batch_size"), (None, "eval_every")}


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def describe_leaves(tree) -> list[dict]:
    """Path, shape and dtype of every leaf (what `meta` records and `restore` checks)."""
    return [{"path": p, "shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)}
            for p, x in zip(_paths(tree), jax.tree.leaves(tree))]


class Checkpoints:
    """An orbax CheckpointManager over `directory`, keeping the last `keep` checkpoints."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, read_only: bool = False):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                               read_only=read_only,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, ref_state, meta: dict[str, Any]) -> None:
        """Save asynchronously (orbax writes a temporary folder and renames it when done)."""
        leaves = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(ref_state))}
        meta = {**meta, "leaves": describe_leaves(ref_state)}
        args = self._ocp.args.Composite(state=self._ocp.args.StandardSave(leaves),
                                        meta=self._ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def read_leaves(self, step: int) -> list[np.ndarray]:
        """The saved arrays in order, without a template (for comparing runs)."""
        restored = self.manager.restore(step, args=self._ocp.args.Composite(
            state=self._ocp.args.StandardRestore()))["state"]
        return [np.asarray(restored[k]) for k in sorted(restored)]

    def read_meta(self, step: int) -> dict:
        restored = self.manager.restore(step, args=self._ocp.args.Composite(
            meta=self._ocp.args.JsonRestore()))
        return restored["meta"]

    def restore(self, step: int, template) -> tuple[Any, dict]:
        """The reference state saved at `step`, shaped like `template` (checked first)."""
        meta = self.read_meta(step)
        check_compatible(meta["leaves"], describe_leaves(template), self.directory / str(step))
        restored = self.manager.restore(step, args=self._ocp.args.Composite(
            state=self._ocp.args.StandardRestore()))["state"]
        leaves = [np.asarray(restored[f"leaf_{i:05d}"]) for i in range(len(meta["leaves"]))]
        for leaf, want in zip(leaves, meta["leaves"]):
            if list(leaf.shape) != want["shape"]:
                raise ValueError(f"leaf {want['path']} has shape {leaf.shape}, meta says {want['shape']}")
        return jax.tree.unflatten(jax.tree.structure(template), leaves), meta

    def restore_latest(self, template) -> tuple[Any, dict]:
        """The newest checkpoint that reads back whole; damaged ones are skipped with a warning.

        Raises:
          ConfigError: no checkpoint at all, or none compatible with `template`.
        """
        steps = self.steps()
        if not steps:
            raise ConfigError(
                f"--resume: {self.directory} holds no jaxpar checkpoint; check --checkpoint-dir, "
                "or drop --resume to start a new run")
        for step in reversed(steps):
            try:
                return self.restore(step, template)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means a damaged checkpoint
                warnings.warn(f"checkpoint {self.directory / str(step)} is damaged ({type(e).__name__}: "
                              f"{str(e)[:200]}); falling back to the previous one", stacklevel=2)
        raise ConfigError(f"--resume: every checkpoint in {self.directory} is damaged "
                          f"(steps {steps}); start a new run with another --checkpoint-dir")


def check_compatible(saved: list[dict], wanted: list[dict], where: Path) -> None:
    """Same leaves, same shapes and dtypes, or a ConfigError naming the first difference."""
    if [s["path"] for s in saved] != [w["path"] for w in wanted]:
        missing = {w["path"] for w in wanted} - {s["path"] for s in saved}
        extra = {s["path"] for s in saved} - {w["path"] for w in wanted}
        raise ConfigError(
            f"checkpoint {where} holds a different model or optimizer: "
            f"{len(missing)} arrays missing (e.g. {sorted(missing)[:2]}), {len(extra)} unexpected "
            f"(e.g. {sorted(extra)[:2]}); resume with the --model/--depth/--width/--optimizer "
            "it was saved with")
    for s, w in zip(saved, wanted):
        if s["shape"] != w["shape"] or s["dtype"] != w["dtype"]:
            raise ConfigError(
                f"checkpoint {where}: {s['path']} is {s['dtype']}{s['shape']} but this run needs "
                f"{w['dtype']}{w['shape']}; resume with the model options it was saved with")


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(allowed, refused) option changes between a saved config and the current one."""
    allowed, refused = [], []
    for key, value in current.items():
        pairs = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in pairs:
            section, name = (key, sub) if sub is not None else (None, key)
            old = saved.get(key, {}).get(sub) if sub is not None else saved.get(key)
            if old != v:
                flag = "--" + name.replace("_", "-")
                ((allowed if (section, name) in RESUMABLE_CHANGES else refused)
                 .append(f"{flag} {old!r} -> {v!r}"))
    return allowed, refused


def check_fresh(directory: str | os.PathLike) -> None:
    """Refuse to start a new run over existing checkpoints (nothing is overwritten)."""
    path = Path(directory)
    if path.exists() and any(p.name.isdigit() for p in path.iterdir()):
        raise ConfigError(f"--checkpoint-dir {path} already holds checkpoints; pass --resume to "
                          "continue that run, or choose another --checkpoint-dir")


def to_json_safe(x):
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


class Interrupted(Exception):
    """SIGTERM or Ctrl-C arrived; a checkpoint was saved (the message says how to resume)."""

    def __init__(self, signum: int, step: int, directory: Path):
        import signal

        self.exit_code = 128 + signum
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint saved in "
                         f"{directory}; run the same command with --resume to continue")


class RunCheckpointer:
    """What the training loop needs: resume, periodic saves, and a save on SIGTERM / Ctrl-C."""

    def __init__(self, config, strategy):
        self.config, self.strategy = config, strategy
        self.every = config.checkpoint_every
        self.manager: Checkpoints | None = None
        self.signal = None
        if config.resume and not config.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir (the folder the run saved into)")
        if config.checkpoint_dir:
            if not config.resume:
                check_fresh(config.checkpoint_dir)  # before anything is written
            self.manager = Checkpoints(config.checkpoint_dir, read_only=False)

    def resume(self, state) -> tuple[Any, int, list]:
        """(state, step to start from, history so far); unchanged when not resuming."""
        if not self.config.resume:
            return state, 0, []
        from jaxpar.config import to_dict

        ref, meta = self.manager.restore_latest(self.strategy.state_to_reference(state))
        allowed, refused = config_changes(meta["config"], to_dict(self.config))
        if refused:
            raise ConfigError(f"--resume: the checkpoint in {self.manager.directory} was saved with "
                              f"other options: {'; '.join(refused)}. Resume with the original values.")
        if allowed:
            warnings.warn(f"resuming with changed options: {'; '.join(allowed)}", stacklevel=2)
        return self.strategy.state_from_reference(ref), int(np.asarray(ref.step)), meta["history"]

    def __enter__(self):
        import signal

        if self.manager is not None:
            def note(signum, frame):  # act between steps, never inside one
                self.signal = signum

            self._old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        import signal

        if self.manager is not None:
            for s, handler in self._old.items():
                signal.signal(s, handler)
            self.manager.wait()
        return False

    def after_step(self, step: int, state, history: list, final: bool = False) -> None:
        """Save when due (every N steps, at the end, or on a signal); raise on a signal."""
        if self.manager is None:
            return
        due = final or self.signal is not None or (self.every and step % self.every == 0)
        if due and step not in self.manager.steps():
            from jaxpar.config import to_dict

            meta = {"config": to_dict(self.config), "step": step, "history": to_json_safe(history)}
            self.manager.save(step, self.strategy.state_to_reference(state), meta)
        if self.signal is not None:
            self.manager.wait()
            raise Interrupted(self.signal, step, self.manager.directory)
