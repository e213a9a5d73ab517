"""Rank points: this venv's MPI launcher, and whether rank points of given strategies, rank counts
and models can run here. R processes under `mpiexec`, one pinned thread and one simulated device
each (`single_thread`): the scaling study's rank mode, and the rank points of the
time-to-accuracy, network, machine and peers studies.

    check_ranks(("mpi-allreduce",), (1, 2), ("mlp",))   # ConfigError naming the fix, or None
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from jaxpar.errors import ConfigError
from jaxpar.parallel import STRATEGIES
from jaxpar.runtime.distributed import INSTALL_HINT


def mpiexec() -> Path:
    """The launcher installed with this venv's MPICH (mpi4jax was built against it)."""
    return Path(sys.executable).parent / "mpiexec"


def places_model(strategy: str, model: str) -> bool:
    """Whether `strategy` places `model` (a rank point is planned only where it does)."""
    models = STRATEGIES[strategy].models
    return models is None or model in models


def check_ranks(strategies: tuple[str, ...], ranks: tuple[int, ...], models: tuple[str, ...]) -> None:
    """Fail before any work when a rank point cannot run, naming the fix."""
    if any(r < 1 for r in ranks):
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    for name in strategies:
        cls = STRATEGIES[name]
        if not (cls.uses_mpi or cls.multiprocess):
            able = [n for n, c in STRATEGIES.items() if c.uses_mpi or c.multiprocess]
            raise ConfigError(f"--rank-strategies {name}: rank points need a strategy that runs "
                              f"across processes ({', '.join(able)})")
        if not any(places_model(name, m) for m in models):
            raise ConfigError(f"--rank-strategies {name} places --models {' or '.join(cls.models)}, "
                              f"none of --models {','.join(models)}; add one of them to --models")
    if max(ranks) > 1 and not mpiexec().exists():
        raise ConfigError(f"--ranks {max(ranks)} needs {mpiexec()}: {INSTALL_HINT}")
    if max(ranks) > 1 and importlib.util.find_spec("mpi4jax") is None:
        raise ConfigError(f"--ranks needs mpi4jax in this venv: {INSTALL_HINT}")
