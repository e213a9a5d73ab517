"""Study points: one `train` or `bench` run of one TrainConfig, each in its own process (a
point's device or rank count is fixed before JAX starts, and a hang or crash must not take the
study down with it), resumable, and checked against what the study asks for.

    outcomes = points.run_points([Point("strong/mlp-single-1", config, BenchOptions(iters=20)), ...],
                                 out="results/scaling", timeout=600)

A point goes to its process as data: `run_points` writes OUT/FOLDER/point.json (the TrainConfig, the
bench options, the rank count and the study's labels) and starts `python -m experiments.points.run
OUT/FOLDER` (under `mpiexec -n R` for R ranks), which writes OUT/FOLDER/result.json with those
settings recorded in its config (`config["point"]`). Before any work, `run_points` checks every
point already in OUT: a complete result of the same settings is reused, a damaged one is run
again, and one of other settings is refused (ConfigError naming the folder): a study is never
a mix of two configurations.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from experiments.options import BenchOptions
from experiments.points.mpi import mpiexec
from jaxpar.results import portable
from jaxpar import results
from jaxpar.config import PATH_FIELDS, TrainConfig, from_dict, to_dict
from jaxpar.errors import ConfigError, ResultsError
from jaxpar.validate import validate

SIGKILL_AFTER_S = 10  # a stopped point's process: after SIGTERM, before SIGKILL
POINT_FILE = "point.json"
ROUND = re.compile(r"r\d+")  # a round's folder inside its point's: r0, r1, ...


class PointError(RuntimeError):
    """A study point's process failed or ran past its time limit."""


@dataclass(frozen=True)
class Point:
    """One run of a study.

    Attributes:
      folder: where its files go, under the study's --out.
      config: what it runs (its `out` is set to the folder when it runs).
      bench: time `bench.iters` steps (`jaxpar.bench`); None: train it (`jaxpar.train`).
      ranks: run it as that many MPI processes (one device each; R > 1 under mpiexec).
      labels: settings of the study that the result must record (e.g. the scaling study's
        strong or weak mode), checked on resume like the config.
    """

    folder: str
    config: TrainConfig
    bench: BenchOptions | None = None
    ranks: int | None = None
    labels: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "train" if self.bench is None else "bench"

    def settings(self) -> dict[str, Any]:
        """What its result records under config["point"], besides the TrainConfig."""
        return {"kind": self.kind, "bench": None if self.bench is None else dataclasses.asdict(self.bench),
                "ranks": self.ranks, "labels": dict(self.labels)}

    def to_json(self) -> str:
        """The point file: its paths relative to named roots (jaxpar.results.portable), as a result's
        are, so the study folder names no folder of the machine; `from_json` resolves them."""
        return json.dumps(portable.value({"folder": self.folder, "config": to_dict(self.config),
                                          **self.settings()}), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Point":
        d = json.loads(text)
        bench = None if d["bench"] is None else BenchOptions(**d["bench"])
        config = d["config"]
        for section, name in PATH_FIELDS:
            holder = config[section] if section else config
            holder[name] = portable.resolve(holder[name])
        return cls(d["folder"], from_dict(config), bench, d["ranks"], d["labels"])

    def describe(self) -> str:
        p = self.config.parallel
        where = f"{self.ranks} rank(s)" if self.ranks else f"{p.devices or 1} device(s)"
        return f"{self.folder}: {self.kind} {self.config.model.model} {p.strategy} on {where}"


def in_rounds(planned: list[Point], rounds: int, rotate: bool = True) -> list[Point]:
    """`planned` measured `rounds` times over, each point's k-th round in FOLDER/r<k>: round
    after round, each round's order rotated (unless `rotate` is False: every round in the
    planned order), so a slow spell of a shared machine falls on different points each round
    (a point's step is then the median of its rounds)."""
    shift = len(planned) // rounds if rotate and rounds else 0
    return [dataclasses.replace(p, folder=f"{p.folder}/r{k}")
            for k in range(rounds) for p in planned[k * shift:] + planned[:k * shift]]


def by_point(rounds: list[Point], outcomes: list) -> dict[str, list]:
    """`outcomes` of `in_rounds`'s points (in its order) grouped by point folder, each point's
    in round order: {FOLDER: [round 0's, round 1's, ...]}."""
    found: dict[str, dict[int, Any]] = {}
    for p, outcome in zip(rounds, outcomes, strict=True):
        folder, k = p.folder.rsplit("/r", 1)
        found.setdefault(folder, {})[int(k)] = outcome
    return {folder: [by_round[k] for k in sorted(by_round)] for folder, by_round in found.items()}


def refuse_other_rounds(rounds: list[Point], out: str | Path) -> None:
    """ConfigError, before any work, when a point folder under OUT holds a round that `rounds`
    (an `in_rounds` list) does not measure (an earlier run with a larger --rounds): the study
    would report fewer rounds than the cost check and the scaling tables read there."""
    planned: dict[str, set[int]] = {}
    for p in rounds:
        folder, _, k = p.folder.rpartition("/r")
        planned.setdefault(folder, set()).add(int(k))
    for folder, measured in planned.items():
        extra = sorted(int(f.parent.name[1:]) for f in round_files(Path(out) / folder)
                       if ROUND.fullmatch(f.parent.name) and int(f.parent.name[1:]) not in measured)
        if extra:
            raise ConfigError(f"{Path(out) / folder} holds round r{extra[-1]}, beyond --rounds "
                              f"{len(measured)}; pass --rounds {extra[-1] + 1} (or more) or a fresh --out")


def run_rounds(planned: list[Point], rounds: int, out: str | Path, timeout: float,
               rotate: bool = True, keep_going: bool = False) -> dict[str, list]:
    """`planned` measured `rounds` times over (`in_rounds`, then `run_points`), once OUT is known to
    hold no other rounds of them (`refuse_other_rounds`): {FOLDER: [round 0's, round 1's, ...]}."""
    measured = in_rounds(planned, rounds, rotate)
    refuse_other_rounds(measured, out)
    return by_point(measured, run_points(measured, out, timeout, keep_going))


def rounds_note(rounds: int, what: str) -> str:
    """How a study's rows were measured, for its summary: one process per `what` and round."""
    if rounds == 1:
        return f"one process per {what}"
    return (f"each {what} the median of {rounds} rounds, one process per {what} and round, the "
            "rounds one after another")


def median_round(measured: list[results.RunResult]) -> results.RunResult:
    """The round whose median step is the median of the rounds' (for an even count, the faster
    of the middle two): the one a study's row reports, every other metric its own."""
    ordered = sorted(measured, key=lambda r: r.metrics["step_time_ms_median"])
    return ordered[(len(ordered) - 1) // 2]


def point_folder(result_file: Path) -> Path:
    """The point a result file belongs to: its folder, or the one above a round's (r<k>)."""
    folder = result_file.parent
    return folder.parent if ROUND.fullmatch(folder.name) else folder


def round_files(folder: Path) -> list[Path]:
    """The result files of a point folder: one per round (r<k>/result.json), or its own."""
    found = [f for f in folder.glob(f"r*/{results.RESULT_FILE}") if ROUND.fullmatch(f.parent.name)]
    return sorted(found, key=lambda f: int(f.parent.name[1:])) or [folder / results.RESULT_FILE]


def point_command(point: Point, folder: Path) -> list[str]:
    """The process of one point: `python -m experiments.points.run FOLDER`, under mpiexec for R > 1."""
    cmd = [sys.executable, "-m", "experiments.points.run", str(folder)]
    return cmd if (point.ranks or 1) == 1 else [str(mpiexec()), "-n", str(point.ranks), *cmd]


def run_points(points: list[Point], out: str | Path, timeout: float, keep_going: bool = False,
               launch: Callable[[Point, Path], list[str]] = point_command) -> list[results.RunResult | PointError]:
    """Every point's result, in order: reused when OUT already holds it, else run.

    Args:
      out: the study's folder (checked writable first).
      timeout: seconds each point's process may run.
      keep_going: a failed point is returned as its PointError and the rest still run
        (False: the first failure raises).
      launch: the command line of a point's process (default `point_command`; the network study
        launches its ranks over emulated hosts).
    Raises:
      ConfigError, before any work, when a point's config cannot run (`jaxpar.validate`) or a
      folder holds a point of other settings.
    """
    if len({p.folder for p in points}) < len(points):
        raise ValueError("two points of a study share a folder")
    for point in points:
        check_point(point)
    out = results.ensure_writable(out)
    done = [stored(out / p.folder, p) for p in points]
    reused = sum(r is not None for r in done)
    if reused:
        print(f"{reused} of {len(points)} points already done in {out}; running the rest", flush=True)
    outcomes: list[results.RunResult | PointError] = []
    for point, result in zip(points, done):
        if result is None:
            print(point.describe(), flush=True)
            try:
                result = _measure(point, out / point.folder, timeout, launch)
            except PointError as e:
                if not keep_going:
                    raise
                print(f"  failed: {e}", flush=True)
                result = e
            else:
                print(f"  {_line(result)}", flush=True)
        outcomes.append(result)
    return outcomes


def check_point(point: Point) -> None:
    """ConfigError naming the point when its config cannot run on its devices or ranks, or
    names a path its point file cannot carry (outside every root jaxpar.results.portable knows)."""
    devices = (point.config.parallel.devices or 1) * (point.ranks or 1)
    try:
        validate(point.config, devices)
    except ConfigError as e:
        raise ConfigError(f"study point {point.folder}: {e}") from None
    config = to_dict(point.config)
    for section, name in PATH_FIELDS:
        given = (config[section] if section else config)[name]
        if given is not None and portable.path(given).startswith(portable.OUTSIDE):
            raise ConfigError(f"study point {point.folder}: --{name.replace('_', '-')} {given} lies "
                              "outside the folders a point file names (the working folder, the "
                              "temporary folder, home, jaxpar's cache); move it under one of them")


def stored(folder: Path, point: Point) -> results.RunResult | None:
    """The complete result in FOLDER if it ran POINT's settings; None when there is none or it
    is damaged (run it again); ConfigError when it ran other settings."""
    path = folder / results.RESULT_FILE
    if not path.exists():
        return None
    try:
        result = results.load(path)
    except ResultsError:
        return None  # half-written by a killed run, or an older schema
    if not isinstance(result.config.get("point"), dict):
        raise ConfigError(f"{folder} holds a result that does not record its study settings (an "
                          f"older jaxpar wrote it); pass a fresh --out or delete that folder")
    # Compared as the result records them: its paths relative to their roots.
    asked = _flat(portable.value({**to_dict(point.config), "point": point.settings()}))
    have = _flat({**result.config, "point": {**result.config["point"], "kind": result.kind}})
    diff = [f"{k} {have.get(k)} (asked {asked.get(k)})" for k in {**asked, **have}
            if k != "out" and have.get(k) != asked.get(k)]
    if diff:
        raise ConfigError(f"{folder} holds a point measured with other settings ({', '.join(diff)}); "
                          f"pass a fresh --out or delete that folder")
    return result


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested dicts flattened to dotted keys: {'data.batch_size': 128, 'seed': 0, ...}."""
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _measure(point: Point, folder: Path, timeout: float,
             launch: Callable[[Point, Path], list[str]]) -> results.RunResult:
    config = dataclasses.replace(point.config, out=str(folder))
    results.write_atomic(folder / POINT_FILE, dataclasses.replace(point, config=config).to_json())
    run_point(launch(point, folder), timeout)
    return results.load(folder / results.RESULT_FILE)


def _line(result: results.RunResult) -> str:
    m = result.metrics
    if result.kind == "bench":
        return f"{m['step_time_ms_median']:.2f} ms/step, {m['images_per_sec']:,.0f} images/s"
    return f"{m['steps']} steps, test accuracy {m['test_accuracy']:.4f}"


def run_point(cmd: list[str], timeout: float) -> None:
    """Run one point's command; past `timeout` stop it and everything it started. Raises with
    its stderr on failure."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: mpiexec (hydra) forwards it to its ranks, which run in sessions of
        # their own and would outlive a SIGKILL of mpiexec alone.
        proc.terminate()
        try:
            proc.communicate(timeout=SIGKILL_AFTER_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise PointError(f"{' '.join(cmd)} ran past {timeout:.0f} s and was stopped") from None
    if proc.returncode != 0:
        raise PointError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
