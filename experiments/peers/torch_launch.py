"""A PyTorch point run in its own process, reused and refused the way `experiments.points`
treats jaxpar points; and the check every study with both kinds of point runs before any work.

    done = run_torch_point(TorchPoint("torch/mlp", "mlp", "eager", ...), Path(out), timeout=600)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.peers.torch_point import RESULT_FILE, TorchPoint, module, stored_torch_point
from experiments.points import points
from experiments.points.points import POINT_FILE, Point, run_point
from jaxpar import results


def run_torch_point(point: TorchPoint, out: Path, timeout: float) -> dict:
    """POINT's result: reused from OUT/FOLDER when complete, else measured in its own process.

    Raises:
      experiments.points.points.PointError: the process failed or ran past `timeout` seconds.
    """
    folder = out / point.folder
    done = stored_torch_point(folder, point)
    if done is None:
        path = results.write_atomic(folder / POINT_FILE, point.to_json())
        run_point([sys.executable, "-m", module(point.mode), str(path)], timeout)
        done = json.loads((folder / RESULT_FILE).read_text())
    return done


def check_folders(planned: list[Point | TorchPoint], out: Path) -> None:
    """Before any work: every jaxpar point can run (`jaxpar.validate`), and no folder under OUT
    holds a point, of either kind, measured with other settings (ConfigError naming it)."""
    for p in planned:
        if isinstance(p, TorchPoint):
            stored_torch_point(out / p.folder, p)
        else:
            points.check_point(p)
            points.stored(out / p.folder, p)
