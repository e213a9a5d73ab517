"""Time PyTorch's training step for a jaxpar model's twin: one `peers` study point, in its own
process (eager, `torch.compile`), or over gloo ranks started with multiprocessing spawn (DDP
here; pipelining and tensor parallelism in experiments/peers/torch_parallel.py).

    python -m experiments.peers.torch_bench OUT/FOLDER/point.json    # written by experiments.peers.torch_point

The step is what jaxpar's bench times: uint8 images normalised inside the step, forward,
mean cross-entropy, backward, Adam at a constant learning rate (optax.adam's betas and eps),
one synthetic global batch placed once. Each step is timed alone (eager CPU work is done when
the call returns; DDP's all-reduce finishes inside backward). Writes OUT/FOLDER/torch.json
atomically, recording the point's settings (what the study resumes by).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from experiments.peers import torch_models
from experiments.peers.torch_point import ADAM_KERNELS, RANK_MODES, RESULT_FILE, TorchPoint
from jaxpar import data as datalib
from jaxpar.results import write_atomic

BETAS, EPS = (0.9, 0.999), 1e-8  # optax.adam's defaults: jaxpar's Adam
PEAK_N, PEAK_REPEATS = 2048, 10  # as jaxpar.profiling.measure.matmul_peak


def cores() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def make_optimizer(params, point: TorchPoint) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=point.lr, betas=BETAS, eps=EPS, **ADAM_KERNELS[point.adam])


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, compiled: bool):
    """step(images uint8 NCHW, labels int64) -> loss; `compiled`: the model and the optimizer's
    step under torch.compile (PyTorch's documented pattern; backward is compiled with the model
    by AOTAutograd)."""
    forward = torch.compile(model) if compiled else model
    update = torch.compile(opt.step) if compiled else opt.step

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(images.float() / 255.0), labels)
        loss.backward()
        update()
        return loss.detach()

    return step


def time_steps(step, batch, iters: int, warmup: int, wait=lambda: None) -> tuple[list[float], float]:
    """(seconds of each of `iters` timed steps, seconds of the first step) after `warmup`;
    `wait` returns when the device is done (a GPU runs asynchronously, as jaxpar's steps are
    waited for)."""
    start = time.perf_counter()
    step(*batch)
    wait()
    first = time.perf_counter() - start
    for _ in range(max(warmup - 1, 0)):
        step(*batch)
    wait()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step(*batch)
        wait()
        times.append(time.perf_counter() - start)
    return times, first


def matmul_peak() -> float:
    """Achieved f32 GFLOP/s of a 2048^3 matmul at this process's thread count (median of 10)."""
    a = torch.ones(PEAK_N, PEAK_N)
    torch.mm(a, a)
    times = []
    for _ in range(PEAK_REPEATS):
        start = time.perf_counter()
        torch.mm(a, a)
        times.append(time.perf_counter() - start)
    return 2.0 * PEAK_N ** 3 / statistics.median(times) / 1e9


def batch_for(size: int, rows: slice = slice(None)):
    """jaxpar's synthetic batch (same seed as its bench) as (uint8 NCHW, int64 labels)."""
    images, labels = datalib.synthetic(size, seed=0)
    return (torch_models.images(images[rows]), torch.from_numpy(labels[rows].astype(np.int64)))


def single(point: TorchPoint) -> dict:
    """A single-process point (eager or compile) on `point.device`, one intra-op thread per
    core it may use (as XLA sizes its pool)."""
    threads = len(cores())
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    device = torch.device(point.device)
    model = torch_models.make_twin(point.model).train().to(device)
    opt = make_optimizer(model.parameters(), point)
    step = make_step(model, opt, compiled=point.mode == "compile")
    batch = tuple(t.to(device) for t in batch_for(point.batch_size))
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, first = time_steps(step, batch, point.iters, point.warmup, wait)
    return {"times_s": times, "first_step_s": first, "threads": threads, "processes": 1,
            "interop_threads": torch.get_num_interop_threads(),
            "param_count": torch_models.param_count(model),
            "matmul_peak_gflops": matmul_peak() if point.matmul_peak else None}


RANK_TIMEOUT_S = 300  # every gloo wait of a rank (rendezvous, collectives, send/recv) is bounded


def _rank(rank: int, body, point: TorchPoint, port: int, out: str) -> None:
    """One of `point.ranks` gloo processes: 1 thread pinned to core rank % cores; `body(rank,
    point)` measures ({'times_s', 'first_step_s', 'param_count'}), rank 0 writes it to `out`."""
    mine = cores()
    os.sched_setaffinity(0, {mine[rank % len(mine)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=point.ranks, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        torch.manual_seed(0)  # same init on every rank (DDP also broadcasts rank 0's)
        measured = body(rank, point)
        if rank == 0:
            write_atomic(out, json.dumps({
                **measured, "threads": 1, "processes": point.ranks,
                "interop_threads": torch.get_num_interop_threads(), "matmul_peak_gflops": None}))
        dist.barrier()  # every rank done before any leaves
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown: a rank whose gloo threads outlive it aborted there
    # (SIGABRT on about one DDP point in ten, after rank 0 had written its timings).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ddp_rank(rank: int, point: TorchPoint) -> dict:
    """One DDP rank's measurement: its rows of every global batch."""
    from torch.nn.parallel import DistributedDataParallel  # only a DDP rank needs torch.nn.parallel

    model = DistributedDataParallel(torch_models.make_twin(point.model).train())
    opt = make_optimizer(model.parameters(), point)
    per_rank = point.batch_size // point.ranks
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    step = make_step(model, opt, compiled=False)
    times, first = time_steps(step, batch_for(point.batch_size, rows), point.iters, point.warmup)
    return {"times_s": times, "first_step_s": first,
            "param_count": torch_models.param_count(model.module)}


def ranks(body, point: TorchPoint, out: Path) -> dict:
    """`point.ranks` processes over gloo (multiprocessing spawn), each running `body`; rank 0's
    timings."""
    if point.batch_size % point.ranks:  # the study checks it first; a hand-made point too
        raise ValueError(f"batch size {point.batch_size} must be a multiple of ranks {point.ranks}")
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    part = str(out.with_name(out.name + ".rank0"))
    mp.spawn(_rank, args=(body, point, port, part), nprocs=point.ranks, join=True)
    with open(part) as f:
        result = json.load(f)
    os.unlink(part)
    return result


def main(argv: list[str], bodies: dict | None = None) -> int:
    """Run the point described by argv[0] (a point.json); write torch.json beside it.
    `bodies`: what each rank runs, by mode (DDP here; experiments/peers/torch_parallel.py adds the
    model-parallel modes and calls this)."""
    bodies = {"ddp": ddp_rank, **(bodies or {})}
    path = Path(argv[0])
    point = TorchPoint.from_json(path.read_text())
    out = path.with_name(RESULT_FILE)
    try:
        result = ranks(bodies[point.mode], point, out) if point.mode in RANK_MODES else single(point)
    except Exception as e:  # noqa: BLE001 (torch.compile's failures come in many types)
        traceback.print_exc()
        print(f"torch_bench: {point.mode} failed: {type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
    result |= {"point": point.settings(), "torch": torch.__version__,
               "median_ms": 1000 * statistics.median(result["times_s"])}
    write_atomic(out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
