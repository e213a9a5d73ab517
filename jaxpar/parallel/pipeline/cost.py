"""What the pipeline family costs: its bound (docs/design.md, invariant 7): `single`'s compute
split over the stages by the layers' measured times, the schedule's fill and drain, and the
sends of the form it runs (`Problem.implementation`: one program per stage sends each
micro-batch across each boundary; the single SPMD program shifts a buffer at every tick).

    work = pipeline(Problem(compute, {"stage": 4}, batch=128, microbatches=8))
"""

from __future__ import annotations

import dataclasses

from jaxpar.cost import SUMS_BYTES, Collective, Problem, Work
from jaxpar.errors import ConfigError
from jaxpar.parallel.pipeline import inner_cut
from jaxpar.parallel.pipeline.partition import balanced
from jaxpar.parallel.pipeline.schedules import build, peak_in_flight, simulate, table
from jaxpar.parallel.tensor.cost import tensor_ops, tensor_parts


def stage_starts(p: Problem, stages: int) -> tuple[int, ...]:
    """Stages cut as `jaxpar.parallel.pipeline.partition` cuts them: balanced by the layers' FLOPs."""
    layers = p.compute.layers
    if stages > len(layers):
        raise ConfigError(f"{stages} stages need at least {stages} layers; {p.model.get('model')} has "
                          f"{len(layers)}: use at most {len(layers)} stages (the rest as data replicas)")
    return balanced([layer.flops_per_example for layer in layers], stages)


def stage_layers(p: Problem, stages: int) -> list[range]:
    starts = stage_starts(p, stages)
    ends = (*starts[1:], len(p.compute.layers))
    return [range(a, b) for a, b in zip(starts, ends)]


def layer_split(p: Problem) -> Work:
    """Stages one after another on their own devices (no overlap); activations and their
    gradients cross each boundary once."""
    c, s = p.compute, p.size("stage")
    parts = [c.part_s(p.batch, r) for r in stage_layers(p, s)]
    sends = [Collective("send", c.layers[r[-1]].out_bytes_per_example * p.batch, 2, 2)
             for r in stage_layers(p, s)[:-1]]
    state = max(sum(c.layers[i].param_bytes for i in r) for r in stage_layers(p, s)) * 3
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
    device per stage, one per device (`host.column`, the device's lowered schedule written out in it);
    with a stage over several devices (hybrid) the table walked slot by slot, every
    micro-batch a forward and a backward on each stage but the last, which runs both in one,
    then each stage copy's update."""
    return stages if one_each else microbatches * (2 * stages - 1) + updates


def with_inner_cut(p: Problem) -> Problem:
    """`p` with the CNN's conv2 in two layers, as `mpi-pipeline` cuts it and the stage
    programs do on accelerators and across processes (`jaxpar.parallel.pipeline.inner_cut`; the result
    says which: `cut_inside`): each part a share of conv2's time, FLOPs and parameters; the
    first hands on conv1's output with its own channels."""
    c = p.compute
    if p.model.get("model") != "cnn":
        return p
    plan = inner_cut.finest(tuple(layer.name for layer in c.layers),
                        tuple(layer.flops_per_example for layer in c.layers), p.size("stage"))
    if plan is None:
        return p
    conv1, conv2 = c.layers[0], c.layers[1]
    parts = []
    for name, share, handed in ((plan.names[1], plan.channels / inner_cut.CNN.CONV2_FEATURES, conv1.out_bytes_per_example),
                                (plan.names[2], 1 - plan.channels / inner_cut.CNN.CONV2_FEATURES, 0.0)):
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
    split each stage as `tensor` does and all-reduce the stage's gradient. Any other schedule
    (several stages per device, the backward split in two) is replayed with the stages' times
    (`schedule_span`): its span, its per-device work and its peak of activations in flight."""
    if p.cut_inside:
        p = with_inner_cut(p)
    if p.schedule not in ("gpipe", "1f1b", "gems"):
        return scheduled(p, op)
    c, s, m, d, t = p.compute, p.size("stage"), p.microbatches, p.size("data"), p.size("tensor")
    b = p.batch / d / m
    ranges = stage_layers(p, s)
    stage_s, stage_params = [], []
    for r in ranges:
        seconds, params = tensor_parts(p, b, r) if t > 1 else (c.part_s(b, r), sum(c.layers[i].param_bytes for i in r))
        update = c.update_s * params / max(c.param_bytes, 1)
        stage_s.append(seconds - update)
        stage_params.append(params)
    updates = tuple(c.update_s * q / max(c.param_bytes, 1) for q in stage_params)
    ops = _sends(p, ranges, b / t, op)
    if t > 1:
        ops += [Collective(o.op, o.bytes / s, t, o.count * m)
                for o in tensor_ops((p.model.get("model"), p.model.get("depth"), p.model.get("width")), int(b), t)]
    if d > 1:
        ops.append(Collective("all-reduce", max(stage_params) + SUMS_BYTES, d))
    in_flight = m if p.schedule == "gpipe" else min(m, s)
    act = max(sum(c.layers[i].out_bytes_per_example for i in r) for r in ranges) * b * in_flight * 2
    programs = d * _programs(s, m, s, one_each=d == t == 1) if p.implementation == "mpmd" else 0
    return Work(updates, tuple(ops), max(stage_params) * 3, act, stage_s=tuple(stage_s), microbatches=m,
                programs=programs)


def scheduled(p: Problem, op: str) -> Work:
    """A schedule with its own lists on S devices (one replica, no tensor or data axes): its
    S x V stages' times per micro-batch (a forward a third, its backward two, split evenly
    into input and weight gradients), replayed for its span; the sends that cross devices."""
    c, s, m, b = p.compute, p.size("stage"), p.microbatches, p.batch / p.microbatches
    schedule = build(p.schedule, s, m, p.virtual_stages)
    ranges = stage_layers(p, schedule.stages)
    params = [sum(c.layers[i].param_bytes for i in r) for r in ranges]
    train = [c.part_s(b, r) - c.update_s * q / max(c.param_bytes, 1) for r, q in zip(ranges, params)]
    per_device = [[k for k in range(schedule.stages) if schedule.device_of(k) == dev] for dev in range(s)]
    updates = tuple(sum(c.update_s * params[k] / max(c.param_bytes, 1) for k in ks) for ks in per_device)
    crossing = [r for k, r in enumerate(ranges[:-1]) if schedule.device_of(k) != schedule.device_of(k + 1)]
    ops = _sends(p, crossing + [ranges[-1]], b, op)
    peak = max(peak_in_flight(table(schedule)))
    act = max(sum(c.layers[i].out_bytes_per_example for i in r) for r in ranges) * b * peak * 2
    programs = _programs(s, m, s, one_each=True) if p.implementation == "mpmd" else 0
    return Work(updates, tuple(ops), max(sum(params[k] for k in ks) for ks in per_device) * 3, act,
                stage_s=tuple(sum(train[k] for k in ks) for ks in per_device), microbatches=m,
                programs=programs, span_s=schedule_span(schedule, train))


def schedule_span(schedule, stage_s: list[float]) -> float:
    """The span of `schedule` replayed with stage k's training time per micro-batch
    `stage_s[k]`: its forward a third of it, its backward two thirds (input and weight
    gradients a third each)."""
    seconds = {}
    for k, t in enumerate(stage_s):
        seconds.update({("F", k): t / 3, ("B", k): 2 * t / 3, ("I", k): t / 3, ("W", k): t / 3})
    times = simulate(schedule, lambda a: seconds[a.kind, a.stage])
    return max(e for _, e in times.values())


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
