"""Measure this machine once, for the cost model (`jaxpar.cost`): how long a model's step and
each of its layers take on one device, the matmul peak, and what each collective costs.

    python -m experiments profile --out figures/data/cost [--quick]

What one profile holds (`RunResult.metrics`, kind "profile"):
  models[key]      per model: `single`'s step time at several batch sizes, on every core and
                   on one thread (MPI ranks run one pinned thread each); the optimizer update
                   alone; each layer's forward + backward time, FLOPs, parameter and output bytes
  kinds            achieved GFLOP/s per layer kind (dense, conv), summed over the models' layers
  matmul_peak_gflops   one device's f32 matmul (`measure.matmul_peak`)
  dispatch_us      the host's time to dispatch one jitted program (`dispatch_us`)
  collectives      simulated devices: all-reduce, all-gather, reduce-scatter, ppermute on 2, 4
                   and 8 devices, each fitted as latency + bytes / bandwidth over message sizes
  mpi              the same for mpi4jax's allreduce, gather, bcast, sendrecv on 2 and 4 ranks
                   (under `mpiexec`, when mpi4jax is installed)
  distributed      the simulated devices' collectives across 2 and 4 jax.distributed processes
                   (one device each, under `mpiexec`): XLA:CPU's gloo over TCP
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
from flax import nnx

from jaxpar import bench
from jaxpar.profiling import measure
from jaxpar import mesh as meshlib
from jaxpar.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from jaxpar.cost import F32
from jaxpar.data import IMAGE_SHAPE
from jaxpar.models import abstract_model, from_config, option_value
from jaxpar.optim import make_optimizer
from jaxpar.parallel.pipeline.partition import model_layers, train_work
from jaxpar.step import init_state, split_model

# The models the committed studies measure: the seeds' CNN and MLP, the ResNet, and the
# strategies study's stack-mlp (depth 8, width 256).
PROFILED = (ModelConfig("cnn"), ModelConfig("mlp"), ModelConfig("resnet"),
            ModelConfig("stack-mlp", depth=8, width=256))
# Per-device batches the studies reach (strong scaling 128/8 = 16 ... weak 128 per device;
# micro-batches of 512/32 = 16): the step time is interpolated between them.
BATCHES = (8, 16, 32, 64, 128, 256)
QUICK_BATCHES = (16, 64)
LAYER_BATCHES = (16, 128)   # per-layer times at two batch sizes: a + c * batch per layer
COLLECTIVE_DEVICES = (2, 4, 8)
COLLECTIVE_BYTES = (4 << 10, 256 << 10, 2 << 20, 16 << 20)
QUICK_COLLECTIVE_BYTES = (4 << 10, 1 << 20)
MPI_RANKS = (2, 4)
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
MPI_OPS = ("mpi_allreduce", "mpi_gather", "mpi_bcast", "mpi_sendrecv")


def model_key(model: ModelConfig | dict) -> str:
    """'cnn', 'stack-mlp-d8-w256': the model and the depth/width it takes, resolved (defaults
    written out), so a result's config and a profile entry name one model the same way."""
    cfg = model if isinstance(model, dict) else {"model": model.model, "depth": model.depth,
                                                 "width": model.width}
    name, parts = cfg["model"], [cfg["model"]]
    for option, letter in (("depth", "d"), ("width", "w")):
        try:
            parts.append(f"{letter}{option_value(name, option, cfg.get(option))}")
        except KeyError:  # the model takes no such option
            pass
    return "-".join(parts)


CONV_MODELS = ("cnn", "resnet")
DENSE_LAYERS = ("fc1", "fc2", "head")  # the convolutional models' dense layers


def layer_kind(model: str, layer: str) -> str:
    """A layer's kind: a convolution (with its batch norm, ReLU and pooling: a CNN or ResNet
    layer other than the dense ones) or dense (the MLPs' layers; a stack-mlp block is two)."""
    return "conv" if model in CONV_MODELS and layer not in DENSE_LAYERS else "dense"


def fastest_ms(times: list[float]) -> float:
    """The fastest of several timed calls, in ms: other work on a shared machine only ever
    slows a call, so the fastest is the best estimate of the machine's own speed (the studies'
    medians were taken with nothing else running, where median and fastest differ by a few %)."""
    return 1000.0 * min(times)


def step_times(model: ModelConfig, batches, iters: int) -> dict:
    """`single`'s fastest and median step (ms), FLOPs and temporary bytes at each batch size."""
    out = {"batch": [], "step_ms": [], "step_ms_median": [], "flops": [], "temp_bytes": []}
    for b in batches:
        config = TrainConfig(data=DataConfig(dataset="synthetic", batch_size=b), model=model,
                             parallel=ParallelConfig(strategy="single"))
        m = bench.benchmark(config, iters=iters, warmup=2, matmul_peak=False).metrics
        out["batch"].append(b)
        out["step_ms"].append(m["step_time_ms_min"])
        out["step_ms_median"].append(m["step_time_ms_median"])
        out["flops"].append(m["flops_per_step"])
        out["temp_bytes"].append(m["memory_per_device"]["temp_bytes"])
        out["state_bytes"] = m["state_bytes_per_device"]
    return out


def update_ms(model: ModelConfig, iters: int) -> float:
    """The optimizer update alone (Adam over every parameter): the part of a step that does
    not shrink with the batch, and that fsdp and tensor divide over devices."""
    params = split_model(from_config(model, seed=0))[1]
    tx = make_optimizer(TrainConfig().optim, total_steps=1000)
    state = init_state(params, {}, tx)
    update = jax.jit(lambda s, g: tx.update(g, s.opt_state, s.params))
    return fastest_ms(measure.time_calls(lambda: update(state, params), iters))


def dispatch_us(iters: int, calls: int = 100) -> float:
    """The host's time to dispatch one jitted program to a device, in us: `calls` programs of
    negligible work queued back to back, each taking the last one's output, waited for once.
    The host-driven pipelines pay it for every stage program of every micro-batch."""
    bump = jax.jit(lambda x: x + 1)
    x = jnp.zeros((8,), jnp.float32)

    def chain():
        y = x
        for _ in range(calls):
            y = bump(y)
        return y

    return 1000.0 * fastest_ms(measure.time_calls(chain, iters)) / calls


def abstract_layers(model: ModelConfig) -> list[dict]:
    """Each layer's name, kind, training FLOPs per example (XLA's cost analysis), parameter
    bytes and output bytes per example, from shapes alone (nothing is allocated): enough for
    the cost model to price a model no profile measured."""
    flops = dict(model_layers(model))
    net = abstract_model(model)
    graphdef, params, rest = split_model(net)
    found = [{"name": layer.name, "kind": layer_kind(model.model, layer.name),
              "flops_per_example": flops[layer.name], "param_bytes": 0, "out_bytes_per_example": 0}
             for layer in net.layers()]
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = tuple(k.key for k in path)
        for entry, layer in zip(found, net.layers()):
            if any(key[:len(p)] == tuple(p) for p in layer.keys):
                entry["param_bytes"] += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    h = jax.ShapeDtypeStruct((1, *IMAGE_SHAPE), jnp.float32)
    for i, entry in enumerate(found):
        h = jax.eval_shape(lambda p, x, r, i=i: nnx.merge(graphdef, p, r).layers()[i](x, True), params, h, rest)
        entry["out_bytes_per_example"] = int(np.prod(h.shape[1:])) * F32
    return found


@functools.lru_cache(maxsize=32)
def param_leaf_bytes(model: ModelConfig) -> tuple[int, ...]:
    """Bytes of each parameter array (shapes only): a gradient all-reduce of a tree of arrays
    pays each array's latency (one all-reduce of 36 arrays took 3x one of their concatenation
    on 4 simulated devices)."""
    params = split_model(abstract_model(model))[1]
    return tuple(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def layer_profile(model: ModelConfig, batches, iters: int) -> list[dict]:
    """`abstract_layers` plus each layer's forward + backward time (ms) at each of `batches`
    (`partition`'s per-layer training work, timed on real arrays)."""
    found = abstract_layers(model)
    for entry in found:
        entry["ms"] = {}
    graphdef, params, rest = split_model(from_config(model, seed=0))
    for b in batches:
        h = jnp.zeros((b, *IMAGE_SHAPE), jnp.float32)
        for i, entry in enumerate(found):
            def run(p, x, r, i=i):
                return nnx.merge(graphdef, p, r).layers()[i](x, True)

            work = jax.jit(functools.partial(train_work, run, i > 0))
            entry["ms"][str(b)] = fastest_ms(measure.time_calls(lambda: work(params, h, rest), iters))
            h = jax.jit(run)(params, h, rest)
    return found


def fit_latency_bandwidth(points: list[tuple[int, float]]) -> dict:
    """Least-squares `seconds = latency + bytes / bandwidth` over (bytes, seconds) points;
    latency clipped at 0 (a fit through small noisy times can go below)."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    slope, intercept = np.polyfit(x, y, 1) if len(points) > 1 else (y[0] / x[0], 0.0)
    slope = max(slope, 1e-15)
    return {"latency_s": max(float(intercept), 0.0), "bytes_per_s": float(1.0 / slope),
            "points": [[int(a), float(b)] for a, b in points]}


def _collective_fn(op: str, n: int):
    """A shard_map program that runs collective `op` once over an axis of `n` devices on an
    operand of each device's rows."""

    def body(x):
        if op == "all-reduce":
            return jax.lax.psum(x, "x")
        if op == "all-gather":
            return jax.lax.all_gather(x, "x", tiled=True)[: x.shape[0]]
        if op == "reduce-scatter":
            return jnp.tile(jax.lax.psum_scatter(x, "x", tiled=True), n)
        return jax.lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)])

    mesh = meshlib.make_mesh({"data": n}, jax.devices()[:n])
    mesh = jax.sharding.Mesh(mesh.devices, ("x",))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))), mesh


def collective_profile(devices, sizes, iters: int, typical=fastest_ms) -> dict:
    """{op: {devices: fit}} for the simulated devices' collectives (operand bytes per device,
    as `measure.collective_bytes` counts them); `typical` reads ms from the timed calls."""

    out: dict = {}
    for op in COLLECTIVE_OPS:
        for n in devices:
            fn, mesh = _collective_fn(op, n)
            points = []
            for nbytes in sizes:
                rows = max(nbytes // F32, n) // n * n
                # Built per shard: the mesh may span processes (`profiling_dist`).
                x = jax.make_array_from_callback((rows * n,), NamedSharding(mesh, P("x")),
                                                 lambda index, rows=rows: np.ones((rows * n,), np.float32)[index])
                seconds = typical(measure.time_calls(lambda: fn(x), iters)) / 1000
                points.append((rows * F32, seconds))
            out.setdefault(op, {})[str(n)] = fit_latency_bandwidth(points)
    return out


def mpi_profile(ranks, sizes, iters: int, timeout: float = 240.0,
                module: str = "jaxpar.profiling.mpi_rank", launch=None) -> tuple[dict, str]:
    """{op: {ranks: fit}} of the collectives `module` times under `mpiexec` (this venv's) at
    each rank count: mpi4jax's (`profiling_mpi`), or XLA's across jax.distributed processes
    (`profiling_dist`); ({}, why) when MPI is not installed or a run fails. `launch(ranks,
    argv)`: the command line that starts the ranks (default: mpiexec here; the emulated
    cluster's puts them on its hosts)."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(launcher):
        return {}, f"no {launcher}"
    launch = launch or (lambda r, argv: [launcher, "-n", str(r), *argv])
    out: dict = {}
    for r in ranks:
        cmd = launch(r, [sys.executable, "-m", module, json.dumps({"sizes": list(sizes), "iters": iters})])
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {meshlib.SINGLE_THREAD_FLAG}"}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {}, f"mpiexec -n {r} ran past {timeout:.0f} s"
        if done.returncode != 0:
            return {}, f"mpiexec -n {r} failed: {done.stderr.strip()[-300:]}"
        times = json.loads(done.stdout.strip().splitlines()[-1])
        for op, points in times.items():
            out.setdefault(op, {})[str(r)] = fit_latency_bandwidth([tuple(p) for p in points])
    return out, ""


def single_thread_steps(models, batches, iters: int, timeout: float = 600.0) -> dict:
    """`step_times` of every model on one XLA thread (what a `--single-thread` MPI rank has),
    in a child process: XLA reads its thread flag once, when it starts."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {meshlib.SINGLE_THREAD_FLAG}"}
    spec = json.dumps({"models": [[m.model, m.depth, m.width] for m in models],
                       "batches": list(batches), "iters": iters})
    done = subprocess.run([sys.executable, "-m", "jaxpar.profiling.machine", spec], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"one-thread step timing failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def kind_rates(models: dict) -> dict:
    """Achieved GFLOP/s per layer kind at the largest profiled layer batch, over every model."""
    flops: dict = {}
    seconds: dict = {}
    for entry in models.values():
        for layer in entry["layers"]:
            b = max(int(k) for k in layer["ms"])
            flops[layer["kind"]] = flops.get(layer["kind"], 0.0) + layer["flops_per_example"] * b
            seconds[layer["kind"]] = seconds.get(layer["kind"], 0.0) + layer["ms"][str(b)] / 1000
    return {k: flops[k] / seconds[k] / 1e9 for k in flops}


def profile(quick: bool = False, mpi: bool = True) -> dict:
    """Everything a profile holds (see the module docstring); minutes, or seconds with `quick`
    (the MLP only, two batch sizes, no one-thread steps, two message sizes: for tests)."""
    # 30 timed calls a batch: with 10, two profiles of one quiet day differed by up to 1.4x at
    # single batches (this VM's run-to-run noise), moving the check's errors by as much.
    iters = 3 if quick else 30
    models = (ModelConfig("mlp"),) if quick else PROFILED
    batches = QUICK_BATCHES if quick else BATCHES
    out_models = {}
    for m in models:
        out_models[model_key(m)] = {
            "config": {"model": m.model, "depth": m.depth, "width": m.width},
            "steps": step_times(m, batches, iters),
            "update_ms": update_ms(m, iters),
            "layers": layer_profile(m, LAYER_BATCHES if not quick else (16,), iters),
        }
    one_thread = {} if quick else single_thread_steps(models, batches, iters)
    for key, steps in one_thread.items():
        out_models[key]["steps_one_thread"] = steps
    sizes = QUICK_COLLECTIVE_BYTES if quick else COLLECTIVE_BYTES
    devices = [n for n in COLLECTIVE_DEVICES if n <= len(jax.devices())]
    ranks = MPI_RANKS[:1] if quick else MPI_RANKS
    mpi_fits, mpi_note = mpi_profile(ranks, sizes, iters) if mpi else ({}, "not asked")
    dist_fits, dist_note = (mpi_profile(ranks, sizes, iters, module="jaxpar.profiling.dist_rank") if mpi
                            else ({}, "not asked"))
    return {
        "cores": meshlib.cores_available(),
        "matmul_peak_gflops": measure.matmul_peak(jax.devices()[:1], n=1024 if quick else 2048)["gflops"],
        "dispatch_us": dispatch_us(iters),
        "models": out_models,
        "kinds": kind_rates(out_models),
        "collectives": collective_profile(devices, sizes, iters),
        "mpi": mpi_fits,
        "mpi_note": mpi_note,
        "distributed": dist_fits,
        "distributed_note": dist_note,
        "quick": quick,
        # Other work on the machine slows every timing: the load when the profile finished,
        # and whether it ran at real-time priority (`chrt -r`) to keep that work off its cores.
        "load_average_1min": os.getloadavg()[0],
        "scheduling": {os.SCHED_RR: "SCHED_RR", os.SCHED_FIFO: "SCHED_FIFO"}.get(os.sched_getscheduler(0), "normal"),
    }


if __name__ == "__main__":  # the one-thread child of `single_thread_steps`
    spec = json.loads(sys.argv[1])
    found = {}
    for name, depth, width in spec["models"]:
        m = ModelConfig(name, depth=depth, width=width)
        found[model_key(m)] = step_times(m, spec["batches"], spec["iters"])
    print(json.dumps(found))
