"""Strategies: how one training step is placed on devices. One module each, one interface
(`base.Strategy`), one plain registry; the CLI's `--strategy` choices come from it."""

from jaxpar.parallel.base import Strategy
from jaxpar.parallel.single import Single
from jaxpar.parallel.tensor import Tensor
from jaxpar.parallel.tensor_auto import TensorAuto
from jaxpar.parallel.layer_split import LayerSplit

STRATEGIES: dict[str, type[Strategy]] = {
    "single": Single,
    "tensor": Tensor,
    "tensor-auto": TensorAuto,
    "layer-split": LayerSplit,
}

__all__ = ["STRATEGIES", "Strategy"]
