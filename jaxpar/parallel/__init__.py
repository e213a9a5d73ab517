"""The registry of strategies, the ways one training step is placed on devices.

One module each, one interface (`base.Strategy`, whose class attributes say what each
supports), one plain registry; the CLI's `--strategy` choices, the studies and the docs
tables come from it.

A new strategy is one new module with a `Strategy` subclass plus one line below."""

from jaxpar.parallel.base import Strategy
from jaxpar.parallel.spec import FAMILIES
from jaxpar.parallel.data_parallel.dp_auto import DPAuto
from jaxpar.parallel.data_parallel.dp_pmap import DPPmap
from jaxpar.parallel.data_parallel.dp_shard_map import DPShardMap
from jaxpar.parallel.data_parallel.fsdp import FSDP
from jaxpar.parallel.pipeline.gems import Gems
from jaxpar.parallel.pipeline.hybrid import Hybrid
from jaxpar.parallel.pipeline.layer_split import LayerSplit
from jaxpar.parallel.data_parallel.local_sgd import LocalSGD
from jaxpar.parallel.mpi.mpi_allreduce import MpiAllreduce
from jaxpar.parallel.mpi.mpi_param_server import MpiParamServer
from jaxpar.parallel.pipeline.mpi_pipeline import MpiPipeline
from jaxpar.parallel.pipeline.pipeline import Pipeline
from jaxpar.parallel.single import Single
from jaxpar.parallel.tensor.tensor import Tensor
from jaxpar.parallel.tensor.tensor_auto import TensorAuto

# In the order tables list them: by family, as FAMILIES orders the families.
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (
    Single,
    DPPmap, DPShardMap, DPAuto, FSDP, LocalSGD,
    Tensor, TensorAuto, LayerSplit, Pipeline, Gems,
    Hybrid,
    MpiAllreduce, MpiParamServer, MpiPipeline,
)}

__all__ = ["FAMILIES", "STRATEGIES", "Strategy"]
