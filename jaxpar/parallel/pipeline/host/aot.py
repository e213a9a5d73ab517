"""AOT compilation of a host-driven pipeline's stage programs, each on the device of each
stage copy, for `Strategy.compile`: compile time, FLOPs (a program counted as often as a
step runs it: once per micro-batch for the stage work), memory per stage.

One micro-batch's shapes stand for all (they are the same), and each program's outputs give
the next one's arguments, so nothing runs.
"""

from __future__ import annotations

from jaxpar.profiling import measure


def compile_stage_programs(programs, placement, states, name: str, state, batch) -> list[measure.Program]:
    """Every program one call of `name` ('step' or 'eval_step') runs, compiled and stored in
    `programs.compiled` under (name, program, device id)."""
    parts: list[measure.Program] = []

    def build(prog, r, s, calls, *args):
        device = placement.device(s, r)
        executable = programs.jitted[prog].lower(*args).compile()
        programs.compiled[(name, prog, device.id)] = executable
        parts.append(measure.Program(f"{prog}@{r}", executable, devices=1, calls=calls, stage=s))
        return executable.out_info

    if name == "step":
        for r in range(states.fns.replicas):
            programs_of = _split_programs if placement.schedule.splits_backward else _step_programs
            programs_of(placement, states, build, r, state, batch)
    else:
        _eval_programs(placement, states, build, state, batch)
    return parts


def _inputs(states, build, r, batch):
    """Replica r's micro-batches (first stage) and labels, weights and denominator (last
    stage); the shape of one micro-batch stands for all."""
    x = build(f"split_images{r}", r, 0, 1, batch["image"][r])[0]
    labels, weights, denom = build(f"split_labels{r}", r, states.S - 1, 1, batch["label"][r], batch["weight"][r])
    return x, labels[0], weights[0], denom


def _stage_start(placement, states, build, r, s, state):
    """Stage copy (r, s)'s parameters and model state, and its zeroed accumulators."""
    p, z = states.copy(state.params, r, s), states.copy(state.model_state, r, s)
    acc, z_sum, sums = build(f"zeros{s}", r, s, 1, p, z)
    return p, z, placement.abstract_on(acc, s, r), placement.abstract_on(z_sum, s, r), sums


def _step_programs(placement, states, build, r, state, batch):
    fns, S = states.fns, states.S
    per, on = fns.microbatches // fns.replicas, placement.abstract_on
    x, label, weight, denom = _inputs(states, build, r, batch)
    for s in range(S):
        p, z, acc, z_sum, sums = _stage_start(placement, states, build, r, s, state)
        opt = states.copy(state.opt_state, r, s)
        if s < S - 1:
            out, vjp, _ = build(f"train_fwd{s}", r, s, per, p, z, x, z_sum)
            g = on(out, s, r)  # the gradient of the output: its shape
            args = (p, z, x, g) if fns.remat else (on(vjp, s, r), g)
            build(f"bwd{s}", r, s, per, *args, acc)
            x = on(out, s + 1, r)
        else:
            build("last", r, s, per, p, z, x, label, weight, denom, acc, z_sum, on(sums, s, r))
        build(f"update{s}", r, s, 1, p, opt, acc, z_sum)
        if fns.replicas > 1:
            build(f"add{s}", r, s, 1, (acc, z_sum), (acc, z_sum))
            if s == S - 1 and r == 0:
                build("add_sums", r, s, 1, *(2 * (on(sums, s, r),)))


def _split_programs(placement, states, build, r, state, batch):
    """As `_step_programs`, for a schedule that splits backwards into input and weight
    gradients (each counted once per micro-batch; a whole backward runs both)."""
    fns, S = states.fns, states.S
    per, on = fns.microbatches // fns.replicas, placement.abstract_on
    x, label, weight, denom = _inputs(states, build, r, batch)
    for s in range(S):
        p, z, acc, z_sum, sums = _stage_start(placement, states, build, r, s, state)
        if s < S - 1:
            out, vjps, _ = build(f"layers_fwd{s}", r, s, per, p, z, x, z_sum)
            g = on(out, s, r)
            args = (p, z, x, g) if fns.remat else (on(vjps, s, r), g)
            found = build(f"bwd_in{s}", r, s, per, *args)
            cts, vjps = (found[1], found[2]) if fns.remat else (found[1], vjps)
            x = on(out, s + 1, r)
        else:
            _, vjps, cts, _, _ = build("last_in", r, s, per, p, z, x, label, weight, denom, z_sum,
                                       on(sums, s, r))
        build(f"bwd_w{s}", r, s, per, on(vjps, s, r), on(cts, s, r), acc)
        build(f"update{s}", r, s, 1, p, states.copy(state.opt_state, r, s), acc, z_sum)


def _eval_programs(placement, states, build, state, batch):
    S, x = states.S, batch["image"][0]
    for s in range(S - 1):
        x = placement.abstract_on(build(f"fwd{s}", 0, s, 1, state.params[s], state.model_state[s], x), s + 1)
    labels = {"label": batch["label"][0], "weight": batch["weight"][0]}
    build("last_eval", 0, S - 1, 1, state.params[S - 1], state.model_state[S - 1], x, labels)
