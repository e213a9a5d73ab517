"""The committed results every published table and figure is drawn from, and the command that
writes each: one list, read by `figures` (experiments/publish/figures.py) and `report`
(experiments/publish/report.py), so a missing file is named with the command that makes it.

    study = load_source(Path("figures/data"), "pipeline")   # the RunResult as a dict, or ResultsError
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.studies.scaling import speedup
from jaxpar import results
from jaxpar.errors import ResultsError


@dataclass(frozen=True)
class Source:
    path: str      # under the data folder: a results file (a * in it: one per machine), or a folder of bench points
    kind: str      # the RunResult kind the file holds ('' for a folder of points)
    command: str   # what writes it (OUT is the data folder's sub-folder)


SOURCES: dict[str, Source] = {
    "train-cnn": Source("train/cnn.json", "train", "`make run`, its result.json copied here,"),
    "train-mlp": Source("train/mlp.json", "train",
                        "`make run ARGS=\"--model mlp\"`, its result.json copied here,"),
    "batch-size": Source("batch_size/result.json", "batch-size", "`python -m experiments batch-size --out OUT`"),
    "scaling": Source("scaling", "", "`python -m experiments scaling --out OUT` (and `--ranks 1,2`)"),
    "strategies": Source("strategies/strategies.json", "strategies",
                         "`python -m experiments strategies --out OUT`"),
    # The seeds' comparison: the CNN under the data- and the model-parallel strategies.
    "cnn-strategies": Source("strategies_cnn/strategies.json", "strategies",
                             "`python -m experiments strategies --model cnn --out OUT`"),
    "pipeline": Source("pipeline/pipeline.json", "pipeline", "`python -m experiments pipeline --out OUT`"),
    "bounds": Source("bounds/bounds.json", "bounds", "`python -m experiments bounds --out OUT`"),
    "hparam": Source("hparam/hparam.json", "hparam", "`python -m experiments hparam --devices 2 --out OUT`"),
    "time-to-accuracy": Source("time_to_accuracy/time_to_accuracy.json", "time-to-accuracy",
                               "`python -m experiments time-to-accuracy --out OUT`"),
    # This machine's profile for the cost model (jaxpar.cost); its checks read every study's points.
    "cost": Source("cost/profile.json", "profile", "`python -m experiments profile --out OUT`"),
    # An H100 node's profile (experiments/infra/measure_node.sh's node): the assumed H100 checked against it.
    "cost-h100": Source("cost-h100/profile.json", "profile",
                        "`python -m experiments profile --out OUT` on the GPU node"),
    "peers": Source("peers/peers.json", "peers", "`python -m experiments peers --out OUT` (needs the `peer` extra)"),
    "network": Source("network/network.json", "network",
                      "`python -m experiments network --out OUT` (as root: emulated hosts)"),
    "faults": Source("faults/faults.json", "faults",
                     "`python -m experiments faults --out OUT` (as root: emulated hosts)"),
    # One folder per machine measured, named after it.
    "machines": Source("machines/*/machine.json", "machine", "`python -m experiments machine --out OUT`"),
}


def path_of(data_dir: Path, name: str) -> Path:
    return Path(data_dir) / SOURCES[name].path


def source_command(data_dir: Path, name: str) -> str:
    """The command that writes source `name` under `data_dir`."""
    path = path_of(data_dir, name)
    out = str(path.parent if SOURCES[name].kind else path).replace("*", "NAME")
    return SOURCES[name].command.replace("OUT", out)


def files(data_dir: Path, name: str) -> list[Path]:
    """The results files of a source whose path has a * (one per machine), sorted."""
    return sorted(Path(data_dir).glob(SOURCES[name].path))


def missing_line(data_dir: Path, name: str) -> str:
    """One line naming the absent file and the command that writes it."""
    return f"no {path_of(data_dir, name)}; {source_command(data_dir, name)} writes it"


def present(data_dir: Path, name: str) -> bool:
    path = path_of(data_dir, name)
    if "*" in SOURCES[name].path:
        return bool(files(data_dir, name))
    return path.is_dir() if not SOURCES[name].kind else path.is_file()


def load_source(data_dir: Path, name: str) -> dict[str, Any]:
    """Source `name` under `data_dir` as {'config', 'env', 'metrics', 'strategy', 'history'};
    a folder of points (scaling) as {'points': speedup.load_points(...)}; a file per machine
    (a * in its path) as {'machines': [one such dict per file]}.

    Raises:
      ResultsError: the file is missing (naming the command that writes it), unreadable, or
        holds another kind of result.
    """
    if not present(data_dir, name):
        raise ResultsError(missing_line(data_dir, name))
    path, kind = path_of(data_dir, name), SOURCES[name].kind
    if not kind:
        points = speedup.load_points(path)
        if not points:
            raise ResultsError(f"no {results.RESULT_FILE} under {path}; {source_command(data_dir, name)} writes them")
        return {"points": points, "files": sorted(path.rglob(results.RESULT_FILE))}
    if "*" in SOURCES[name].path:  # one file per machine
        found = files(data_dir, name)
        return {"machines": [_load_file(p, kind, data_dir, name) for p in found], "files": found}
    return _load_file(path, kind, data_dir, name)


def _load_file(path: Path, kind: str, data_dir: Path, name: str) -> dict[str, Any]:
    try:
        result = results.load(path)
    except ResultsError as e:
        raise ResultsError(f"{e}; {source_command(data_dir, name)} writes it anew") from None
    if result.kind != kind:
        raise ResultsError(f"{path} holds a {result.kind!r} result, not {kind!r}")
    return {"config": result.config, "env": result.env, "metrics": result.metrics,
            "strategy": result.strategy, "history": result.history, "files": [path]}
