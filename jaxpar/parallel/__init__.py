"""Strategies: how one training step is placed on devices. One module each, one interface
(`base.Strategy`), one plain registry; the CLI's `--strategy` choices come from it."""

from jaxpar.parallel.base import Strategy
from jaxpar.parallel.mpi_allreduce import MpiAllreduce
from jaxpar.parallel.mpi_param_server import MpiParamServer
from jaxpar.parallel.dp_auto import DPAuto
from jaxpar.parallel.dp_pmap import DPPmap
from jaxpar.parallel.dp_shard_map import DPShardMap
from jaxpar.parallel.fsdp import FSDP
from jaxpar.parallel.local_sgd import LocalSGD
from jaxpar.parallel.pipeline import Pipeline
from jaxpar.parallel.single import Single
from jaxpar.parallel.tensor import Tensor
from jaxpar.parallel.tensor_auto import TensorAuto
from jaxpar.parallel.layer_split import LayerSplit

STRATEGIES: dict[str, type[Strategy]] = {
    "single": Single,
    "mpi-allreduce": MpiAllreduce,
    "mpi-param-server": MpiParamServer,
    "dp-pmap": DPPmap,
    "dp-shard-map": DPShardMap,
    "dp-auto": DPAuto,
    "fsdp": FSDP,
    "local-sgd": LocalSGD,
    "pipeline": Pipeline,
    "tensor": Tensor,
    "tensor-auto": TensorAuto,
    "layer-split": LayerSplit,
}

__all__ = ["STRATEGIES", "Strategy"]
