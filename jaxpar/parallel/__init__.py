"""Strategies: how one training step is placed on devices. One module each, one interface
(`base.Strategy`), one plain registry; the CLI's `--strategy` choices come from it."""

from jaxpar.parallel.base import Strategy
from jaxpar.parallel.mpi_allreduce import MpiAllreduce
from jaxpar.parallel.mpi_param_server import MpiParamServer
from jaxpar.parallel.single import Single

STRATEGIES: dict[str, type[Strategy]] = {
    "single": Single,
    "mpi-allreduce": MpiAllreduce,
    "mpi-param-server": MpiParamServer,
}

__all__ = ["STRATEGIES", "Strategy"]
