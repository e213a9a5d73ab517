"""PyTorch's model parallelism on CPU over gloo, for the `peers` study's model-parallel rows:
one rank of a `torch.distributed.pipelining` pipeline (any of its schedules: a stage, or
several, per rank) or of DTensor tensor parallelism (`torch.distributed.tensor.parallel`). Each
function runs inside a rank that experiments.peers.torch_bench's machinery started (1 thread, pinned, gloo
initialised, seeded) and returns what it measured.

    python -m experiments.peers.torch_parallel OUT/FOLDER/point.json    # a TorchPoint: a pipeline schedule | tp

The step is torch_bench's: uint8 images normalised in the first stage, mean cross-entropy,
backward, Adam (fused: one parameter group per tensor kind, see `tensor_rank`). Pipeline
stages are the twin cut at the point's `stage_starts` (jaxpar.parallel.pipeline.partition.cut's cut,
so both frameworks run the same stages); each rank keeps only its stage and that stage's
optimizer state. The schedule splits the global batch into `microbatches` and averages the
micro-batch gradients (its scale_grads), so a step is one global-batch step.
"""

from __future__ import annotations

import sys

import torch
from torch.nn import functional as F

from experiments.peers import torch_bench
from experiments.peers import torch_models
from experiments.peers.torch_bench import batch_for, make_optimizer, make_step, time_steps
from experiments.peers.torch_point import PIPELINE_CLASSES, PIPELINE_MODES, TorchPoint

# The Megatron pair PyTorch's tensor parallelism splits in each twin (column-parallel, then
# row-parallel: one all-reduce forward, one backward); everything else is replicated. DTensor
# shards a convolution only along the batch (its sharding rules replicate the kernel), so a
# conv layer cannot be split by channels as jaxpar's `tensor` splits the CNN's conv2.
TP_PLANS = {"mlp": {"hidden.0": "colwise", "hidden.1": "rowwise"},
            "cnn": {"fc1": "colwise", "fc2": "rowwise"}}


def pipeline_rank(rank: int, point: TorchPoint) -> dict:
    """Rank `rank`: its stages of the twin (stage `rank`, or those `stage_ranks` puts here),
    driven by the point's schedule (PIPELINE_CLASSES: the same orders as jaxpar's)."""
    # torch.distributed's pipelining and DTensor: each imported only by the ranks that run it
    from torch.distributed import pipelining

    twin = torch_models.make_twin(point.model).train()  # same seed on every rank: same weights
    n = len(point.stage_starts)
    homes = point.stage_ranks or tuple(range(n))
    mine = [k for k in range(n) if homes[k] == rank]
    modules = [torch_models.stage(twin, point.stage_starts, k, point.cut_channels) for k in mine]
    stages = [pipelining.PipelineStage(m, k, n, torch.device("cpu")) for m, k in zip(modules, mine)]
    kind = getattr(pipelining, PIPELINE_CLASSES[point.mode])
    single = point.mode in ("gpipe", "1f1b")  # PipelineScheduleSingle: one stage per rank
    schedule = kind(stages[0] if single else stages, n_microbatches=point.microbatches,
                    loss_fn=F.cross_entropy)
    opt = make_optimizer([p for m in modules for p in m.parameters()], point)
    first, last = 0 in mine, n - 1 in mine

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        # The first stage feeds the images, the last computes the loss against the labels.
        schedule.step(*([images] if first else []), **({"target": labels} if last else {}))
        opt.step()

    times, first_s = time_steps(step, batch_for(point.batch_size), point.iters, point.warmup)
    return {"times_s": times, "first_step_s": first_s, "param_count": torch_models.param_count(twin)}


def tensor_rank(rank: int, point: TorchPoint) -> dict:
    """Rank `rank` of DTensor tensor parallelism over all ranks: TP_PLANS' pair split, the rest
    replicated, every rank the whole global batch."""
    # DTensor: imported only by the tensor-parallel ranks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (point.ranks,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    model = parallelize_module(torch_models.make_twin(point.model).train(), mesh,
                               {name: styles[s]() for name, s in TP_PLANS[point.model].items()})
    params = list(model.parameters())
    # Adam's fused (and foreach) kernel refuses a group mixing DTensors (the split layers) with
    # plain tensors (the replicated rest): "got mixed torch.Tensor and DTensor".
    groups = [{"params": [p for p in params if isinstance(p, DTensor) == split]} for split in (False, True)]
    step = make_step(model, make_optimizer(groups, point), compiled=False)
    times, first = time_steps(step, batch_for(point.batch_size), point.iters, point.warmup)
    return {"times_s": times, "first_step_s": first,
            "param_count": sum(p.numel() for p in params)}  # a DTensor counts its global shape


BODIES = {**{mode: pipeline_rank for mode in PIPELINE_MODES}, "tp": tensor_rank}

if __name__ == "__main__":
    sys.exit(torch_bench.main(sys.argv[1:], BODIES))
