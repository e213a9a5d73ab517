"""What each strategy states about its step's cost (`Strategy.cost`): each device's compute,
its collectives and its memory, as a `jaxpar.cost.Work`, from a `Problem` (the model's
`Compute`, the mesh, the batch, the schedule). `jaxpar.cost.predict` turns it into time on a
machine. A new strategy brings its own function here (or on its class).

    work = COSTS["fsdp"](Problem(compute, {"data": 4}, batch=128))

The pipeline's cost is its bound (docs/design.md, invariant 7): `single`'s compute split over
the stages by the layers' measured times, the schedule's fill and drain, and the sends of the
form it runs (`Problem.implementation`: one program per stage sends each micro-batch across
each boundary; the single SPMD program shifts a buffer at every tick).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from jaxpar.cost import F32, Collective, Compute, Work
from jaxpar.data import IMAGE_SHAPE  # the built-in models' images

SUMS = 3 * F32   # the metric sums every data-parallel step all-reduces


@dataclass(frozen=True)
class Problem:
    compute: Compute
    axes: dict = field(default_factory=dict)   # {"data": D, "tensor": T, "stage": S}; ranks as data/stage
    batch: int = 128
    microbatches: int = 4
    schedule: str = "gpipe"
    sync_every: int = 1
    model: dict = field(default_factory=dict)  # the model config (tensor's collective bytes)
    implementation: str = "spmd"  # pipelines: one program ("spmd") or one per stage ("mpmd")
    collective_form: str = "native"  # tensor's CNN split: XLA's gathers or "permute" (comm_forms)
    cut_inside: bool = False  # pipelines: the CNN's conv2 parted between stages (`finer`)

    def size(self, axis: str) -> int:
        return int(self.axes.get(axis, 1))

    @property
    def devices(self) -> int:
        return self.size("data") * self.size("tensor") * self.size("stage")


def single(p: Problem) -> Work:
    c = p.compute
    return Work((c.step_s(p.batch),), (), c.state_bytes, c.temp_bytes(p.batch))


def _data(p: Problem, per_device_s: float, collectives, state_bytes: float) -> Work:
    d = p.size("data")
    return Work((per_device_s,) * d, tuple(collectives), state_bytes, p.compute.temp_bytes(p.batch / d))


def per_leaf(p: Problem, op: str, group: int, divide: int = 1, count: float = 1.0) -> list[Collective]:
    """One collective per parameter array (XLA all-reduces a gradient tree as one op whose
    arrays each pay the latency), or one of the whole when the arrays are not known."""
    leaves = p.compute.leaf_bytes or (p.compute.param_bytes,)
    return [Collective(op, b / divide, group, count) for b in leaves]


def data_parallel(p: Problem) -> Work:
    """Every device a replica on B/D rows; the gradient all-reduced (+ metric sums)."""
    c, d = p.compute, p.size("data")
    ops = per_leaf(p, "all-reduce", d) + [Collective("all-reduce", SUMS, d)]
    return _data(p, c.step_s(p.batch / d), ops, c.state_bytes)


def mpi_allreduce(p: Problem) -> Work:
    """Ranks as data-parallel replicas; gradient and sums fused into one buffer, one allreduce."""
    c, r = p.compute, p.size("data")
    return _data(p, c.step_s(p.batch / r), [Collective("mpi_allreduce", c.param_bytes + SUMS, r)],
                 c.state_bytes)


def fsdp(p: Problem) -> Work:
    """Replica compute on B/D rows, the update on 1/D of the parameters; all-gather of each
    device's slice, reduce-scatter of the whole gradient."""
    c, d = p.compute, p.size("data")
    per_device = c.backprop_s(p.batch / d) + c.update_s / d
    ops = per_leaf(p, "all-gather", d, divide=d) + per_leaf(p, "reduce-scatter", d) + [
        Collective("all-reduce", SUMS, d)]
    return _data(p, per_device, ops, c.state_bytes / d)


def local_sgd(p: Problem) -> Work:
    """Independent replicas; the parameters all-reduced once every k steps."""
    c, d = p.compute, p.size("data")
    return _data(p, c.step_s(p.batch / d), per_leaf(p, "all-reduce", d, count=1.0 / p.sync_every),
                 c.state_bytes)


def mpi_param_server(p: Problem) -> Work:
    """Ranks compute gradients of B/R rows; rank 0 gathers them, updates, broadcasts the state.
    Every rank runs the update (the others a throw-away one of the same shape, replaced by the
    broadcast: `MpiParamServer._step`), so each rank's compute is a whole step at B/R."""
    c, r = p.compute, p.size("data")
    ops = [Collective("mpi_gather", c.param_bytes + SUMS, r), Collective("mpi_bcast", c.state_bytes + SUMS, r)]
    return Work((c.step_s(p.batch / r),) * r, tuple(ops), c.state_bytes, c.temp_bytes(p.batch / r))


# --- model parallel --------------------------------------------------------------------

def split_layers(p: Problem) -> list[int]:
    """The layers whose parameters tensor parallelism splits: stack-mlp and ResNet blocks, the
    CNN's conv2, fc1 and fc2 (its conv1 runs replicated on B/T rows)."""
    names = [layer.name for layer in p.compute.layers]
    if p.model.get("model") == "cnn":
        return [i for i, n in enumerate(names) if n != "conv1"]
    return [i for i, n in enumerate(names) if n.startswith("block")]


@functools.lru_cache(maxsize=64)
def _tensor_ops(model: tuple, batch_local: int, degree: int) -> tuple[Collective, ...]:
    """The collectives of the Megatron / channel split per step, from `jaxpar.theory` and
    `jaxpar.parallel.channels` (as `Tensor.theory` states them)."""
    from jaxpar import theory
    from jaxpar.config import ModelConfig
    from jaxpar.models import abstract_model, option_value
    from jaxpar.parallel import channels

    name, depth, width = model
    if degree <= 1:
        return ()
    if name == "stack-mlp":
        depth, width = option_value(name, "depth", depth), option_value(name, "width", width)
        nbytes = theory.tensor_collective_bytes(batch_local=batch_local, width=width, depth=depth,
                                                degree=degree, vit=False)
        return (Collective("all-reduce", nbytes / (2 * depth), degree, 2 * depth),)
    net = abstract_model(ModelConfig(name, depth=depth, width=width))
    ops = channels.collective_bytes(net, batch_local, IMAGE_SHAPE, degree)
    if name == "cnn":  # all-gathers and reduce-scatters of activations, the all-reduce of grads
        return tuple(Collective(op, nbytes, degree) for op, nbytes in ops.items())
    count = 2 * len(net.blocks)  # a block's output forward, its input gradient backward
    return (Collective("all-reduce", ops["all-reduce"] / count, degree, count),)


def _tensor_parts(p: Problem, batch: float, layers) -> tuple[float, float]:
    """(compute seconds, parameter bytes) of one tensor shard of `layers` at this batch: split
    layers' work and parameters / T; the CNN's conv1 also runs on B/T rows (its parameters
    whole)."""
    c, t = p.compute, p.size("tensor")
    split = set(split_layers(p))
    rows = set(range(len(c.layers))) - split if p.model.get("model") == "cnn" else set()
    shares = c.shares(batch)
    frac = sum(shares[i] / (t if i in split | rows else 1) for i in layers)
    params = sum(c.layers[i].param_bytes / (t if i in split else 1) for i in layers)
    return c.backprop_s(batch) * frac + c.update_s * params / max(c.param_bytes, 1), params


def _permuted(ops: list[Collective], degree: int, data: int) -> list[Collective]:
    """The CNN split's collectives in their permute form (`channels.as_permutes`): the 3
    all-gathers, 3 reduce-scatters (and without DATA the loss denominator) as T - 1 permutes
    each."""
    from jaxpar.parallel import channels

    found = channels.as_permutes({o.op: o.bytes for o in ops}, degree, denominator=data == 1)
    count = channels.permutes_per_step(degree, denominator=data == 1)
    return [Collective(op, n / count, degree, count) if op == "collective-permute" else Collective(op, n, degree)
            for op, n in found.items()]


def tensor(p: Problem) -> Work:
    """Split layers' compute and parameters divided by T; their activations all-reduced twice
    (forward and backward) per pair (the CNN: gathered and reduce-scattered, or permuted);
    over data > 1 also the gradient all-reduce."""
    d, t = p.size("data"), p.size("tensor")
    b = p.batch / d
    seconds, params = _tensor_parts(p, b, range(len(p.compute.layers)))
    ops = list(_tensor_ops((p.model.get("model"), p.model.get("depth"), p.model.get("width")), int(b), t))
    if p.collective_form == "permute" and t > 1:
        ops = _permuted(ops, t, d)
    if d > 1:
        ops.append(Collective("all-reduce", params + SUMS, d))
    return Work((seconds,) * (d * t), tuple(ops), params * 3, p.compute.temp_bytes(b))


def stage_starts(p: Problem, stages: int) -> tuple[int, ...]:
    """Stages cut as `jaxpar.parallel.partition` cuts them: balanced by the layers' FLOPs."""
    from jaxpar.errors import ConfigError
    from jaxpar.parallel.partition import balanced

    layers = p.compute.layers
    if stages > len(layers):
        raise ConfigError(f"{stages} stages need at least {stages} layers; {p.model.get('model')} has "
                          f"{len(layers)}: use at most {len(layers)} stages (the rest as data replicas)")
    return balanced([layer.flops_per_example for layer in layers], stages)


def _stage_layers(p: Problem, stages: int) -> list[range]:
    starts = stage_starts(p, stages)
    ends = (*starts[1:], len(p.compute.layers))
    return [range(a, b) for a, b in zip(starts, ends)]


def layer_split(p: Problem) -> Work:
    """Stages one after another on their own devices (no overlap); activations and their
    gradients cross each boundary once."""
    c, s = p.compute, p.size("stage")
    parts = [c.part_s(p.batch, r) for r in _stage_layers(p, s)]
    sends = [Collective("send", c.layers[r[-1]].out_bytes_per_example * p.batch, 2, 2)
             for r in _stage_layers(p, s)[:-1]]
    state = max(sum(c.layers[i].param_bytes for i in r) for r in _stage_layers(p, s)) * 3
    return Work(tuple(parts), tuple(sends), state, c.temp_bytes(p.batch) / s, serial=True,
                programs=_programs(s, 1, s, one_each=True))


def _sends(p: Problem, ranges: list[range], rows: float, op: str) -> list[Collective]:
    """The activations and their gradients between stages per step. One program per stage
    (`mpmd`, one-way messages on jaxpar's channels: `send`) and MPI ranks send each real
    micro-batch across each boundary once forward and once back (its own bytes, 2M sends,
    between 2 devices); the single SPMD program shifts
    the largest boundary's buffer at every one of its M + S - 1 ticks, both ways."""
    c, s, m = p.compute, len(ranges), p.microbatches
    if s <= 1:
        return []
    if p.implementation == "mpmd" or op.startswith("mpi_"):
        op = "send" if p.implementation == "mpmd" and not op.startswith("mpi_") else op
        return [Collective(op, c.layers[r[-1]].out_bytes_per_example * rows, 2, 2 * m) for r in ranges[:-1]]
    boundary = max(c.layers[r[-1]].out_bytes_per_example for r in ranges[:-1]) * rows
    return [Collective(op, boundary, s, 2 * (m + s - 1))]


def _programs(stages: int, microbatches: int, updates: int, one_each: bool) -> int:
    """Programs the host dispatches per step when each stage has programs of its own: with a
    device per stage, one per device (`rank_step`, the device's column written out in it);
    with a stage over several devices (hybrid) the table walked slot by slot, every
    micro-batch a forward and a backward on each stage but the last, which runs both in one,
    then each stage copy's update."""
    return stages if one_each else microbatches * (2 * stages - 1) + updates


def _finer(p: Problem) -> Problem:
    """`p` with the CNN's conv2 in two layers, as `mpi-pipeline` cuts it and the stage
    programs do on accelerators and across processes (`jaxpar.parallel.finer`; the result
    says which: `cut_inside`): each part a share of conv2's time, FLOPs and parameters; the
    first hands on conv1's output with its own channels."""
    from jaxpar.parallel import finer

    c = p.compute
    if p.model.get("model") != "cnn":
        return p
    plan = finer.finest(tuple(layer.name for layer in c.layers),
                        tuple(layer.flops_per_example for layer in c.layers), p.size("stage"))
    if plan is None:
        return p
    conv1, conv2 = c.layers[0], c.layers[1]
    parts = []
    for name, share, handed in ((plan.names[1], plan.channels / finer.CNN.CONV2_FEATURES, conv1.out_bytes_per_example),
                                (plan.names[2], 1 - plan.channels / finer.CNN.CONV2_FEATURES, 0.0)):
        parts.append(dataclasses.replace(
            conv2, name=name, flops_per_example=conv2.flops_per_example * share,
            param_bytes=conv2.param_bytes * share,
            out_bytes_per_example=handed + conv2.out_bytes_per_example * (share if handed else 1.0),
            seconds=lambda b, share=share: conv2.seconds(b) * share))
    return dataclasses.replace(p, compute=dataclasses.replace(c, layers=(conv1, *parts, *c.layers[2:])))


def pipeline(p: Problem, op: str = "collective-permute") -> Work:
    """The pipeline's bound: S stages of `single`'s layers (cut by FLOPs), each micro-batch of
    B/(D*M) rows through every stage, (S - 1) slots of bubble, the activations and their
    gradients between stages (`_sends`), the update once per step;
    GPipe keeps M micro-batches' activations, 1F1B at most S. Tensor and data axes (hybrid)
    split each stage as `tensor` does and all-reduce the stage's gradient."""
    if p.cut_inside:
        p = _finer(p)
    c, s, m, d, t = p.compute, p.size("stage"), p.microbatches, p.size("data"), p.size("tensor")
    b = p.batch / d / m
    ranges = _stage_layers(p, s)
    stage_s, stage_params = [], []
    for r in ranges:
        seconds, params = _tensor_parts(p, b, r) if t > 1 else (c.part_s(b, r), sum(c.layers[i].param_bytes for i in r))
        update = c.update_s * params / max(c.param_bytes, 1)
        stage_s.append(seconds - update)
        stage_params.append(params)
    updates = tuple(c.update_s * q / max(c.param_bytes, 1) for q in stage_params)
    ops = _sends(p, ranges, b / t, op)
    if t > 1:
        ops += [Collective(o.op, o.bytes / s, t, o.count * m)
                for o in _tensor_ops((p.model.get("model"), p.model.get("depth"), p.model.get("width")), int(b), t)]
    if d > 1:
        ops.append(Collective("all-reduce", max(stage_params) + SUMS, d))
    in_flight = m if p.schedule == "gpipe" else min(m, s)
    act = max(sum(c.layers[i].out_bytes_per_example for i in r) for r in ranges) * b * in_flight * 2
    programs = d * _programs(s, m, s, one_each=d == t == 1) if p.implementation == "mpmd" else 0
    return Work(updates, tuple(ops), max(stage_params) * 3, act, stage_s=tuple(stage_s), microbatches=m,
                programs=programs)


def mpi_pipeline(p: Problem) -> Work:
    return pipeline(dataclasses.replace(p, cut_inside=True), op="mpi_sendrecv")


def gems(p: Problem) -> Work:
    """GEMS: the pipeline's bound, two model copies in opposite directions, so device d holds
    stage d of one and stage S-1-d of the other: it holds and updates both (the SPMD form in
    one layout padded to the largest stage, as `pipeline`'s: twice the fullest's state), and
    after the schedule swaps both stages' gradients with device S-1-d, so that both copies
    take the whole batch's gradient."""
    work = pipeline(p)
    s, updates = len(work.device_s), work.device_s
    params = [u / p.compute.update_s * p.compute.param_bytes if p.compute.update_s else 0.0 for u in updates]
    both = tuple(updates[d] + updates[s - 1 - d] for d in range(s))
    swaps = tuple(Collective("collective-permute", params[d] + params[s - 1 - d], 2, 2) for d in range(s // 2))
    # one program per stage holds each stage at its own size; the SPMD layout pads to the largest
    state = (max(params[d] + params[s - 1 - d] for d in range(s)) * 3 if p.implementation == "mpmd"
             else 2 * work.state_bytes)
    return dataclasses.replace(work, device_s=both, collectives=work.collectives + swaps, state_bytes=state,
                               programs=work.programs)  # one per device, the swaps inside
