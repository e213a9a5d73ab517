"""What a jaxpar point of the `peers` study trains, in both of its sections (experiments/peers/study.py,
experiments/peers/model_parallel.py): PyTorch's optimizer exactly (Adam, constant lr), the model's
defaults (the fast CPU layers included), synthetic data.
"""

from __future__ import annotations

from jaxpar.config import TrainConfig, with_options

OPTIMIZER = "adam"  # what the PyTorch side runs (torch.optim.Adam); jaxpar's is pinned to it


def peer_train_config(config, model: str, strategy: str, devices: int = 1, ranks: bool = False,
                 steps_per_dispatch: int = 1) -> TrainConfig:
    """`model` under `strategy` on `devices` simulated devices per process (`ranks`: one
    pinned thread per process, for rank points), at the study's (a PeersConfig) batch and lr."""
    return with_options(TrainConfig(), dataset="synthetic", model=model, strategy=strategy,
                        devices=devices, batch_size=config.batch_size, optimizer=OPTIMIZER,
                        lr=config.lr, lr_schedule="constant", single_thread=ranks,
                        steps_per_dispatch=steps_per_dispatch)
