"""What the data-parallel strategies cost (`Strategy.cost`): each device a replica on B/D rows,
their collectives and memory, as a `jaxpar.cost.Work` for `jaxpar.cost.predict`."""

from __future__ import annotations

from jaxpar.cost import SUMS_BYTES, Collective, Problem, Work


def replicas(p: Problem, per_device_s: float, collectives, state_bytes: float) -> Work:
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
    ops = per_leaf(p, "all-reduce", d) + [Collective("all-reduce", SUMS_BYTES, d)]
    return replicas(p, c.step_s(p.batch / d), ops, c.state_bytes)


def fsdp(p: Problem) -> Work:
    """Replica compute on B/D rows, the update on 1/D of the parameters; all-gather of each
    device's slice, reduce-scatter of the whole gradient."""
    c, d = p.compute, p.size("data")
    per_device = c.backprop_s(p.batch / d) + c.update_s / d
    ops = per_leaf(p, "all-gather", d, divide=d) + per_leaf(p, "reduce-scatter", d) + [
        Collective("all-reduce", SUMS_BYTES, d)]
    return replicas(p, per_device, ops, c.state_bytes / d)


def local_sgd(p: Problem) -> Work:
    """Independent replicas; the parameters all-reduced once every k steps."""
    c, d = p.compute, p.size("data")
    return replicas(p, c.step_s(p.batch / d), per_leaf(p, "all-reduce", d, count=1.0 / p.sync_every),
                 c.state_bytes)
