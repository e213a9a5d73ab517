"""The host-driven pipeline runtime: each stage's programs on its own device (or sub-mesh),
the step as one program per device where each stage has one (`column`), else the schedule
walked from the host (`walk`). No stage program holds control flow: XLA:CPU runs convolutions
inside a conditional or a loop body on a slow path (a conv's forward and backward ~20x slower
inside `lax.switch`; jax-ml/jax#12868), which the single SPMD program cannot avoid.

    runtime = HostRuntime(schedule, fns, placement, plan, trace_counts, boundary_shapes)
    state = runtime.init_state(reference_state)
    state, sums = runtime.step(state, runtime.place_batch(batch))
"""

from __future__ import annotations

import math
import time

from jaxpar.parallel.pipeline.host import aot, column, serial, timeline, walk
from jaxpar.parallel.pipeline.host.programs import ProgramTable, register_stage_programs
from jaxpar.parallel.pipeline.host.state import StageStates
from jaxpar.parallel.pipeline.schedules import peak_in_flight, sent_early, table
from jaxpar.parallel.transport import processes
from jaxpar.profiling import measure


class HostRuntime:
    implementation = "mpmd"

    def __init__(self, schedule, fns, placement, plan, trace_counts, boundary_shapes):
        self.schedule, self.fns, self.placement, self.plan = schedule, fns, placement, plan
        self.states = StageStates(fns, placement, plan, fns.tx)
        self.programs = ProgramTable(trace_counts)
        register_stage_programs(self.programs, fns, split=schedule.splits_backward)
        self.boundary_shapes = boundary_shapes  # what stage b hands on, per example
        self.boundaries = [math.prod(b) for b in boundary_shapes]  # elements per example
        self.not_one_program = column.why_not(placement, schedule)
        self.column = (column.ColumnStep(schedule, fns, placement, self.states, self.programs, boundary_shapes)
                       if self.not_one_program is None else None)

    # --- state and batches -------------------------------------------------------------------
    def init_state(self, ref):
        return self.states.from_reference(ref)

    def state_from_reference(self, ref):
        return self.states.from_reference(ref)

    def state_to_reference(self, state):
        return self.states.to_reference(state)

    def place_batch(self, batch):
        return self.states.place_batch(batch)

    def host_sums(self, sums):
        return {k: float(v) for k, v in processes.fetch_held(sums).items()}  # from the last stage

    # --- programs ----------------------------------------------------------------------------
    def _walk(self, state, batch, kind):
        return walk.walk(self.schedule, self.programs, self.placement, self.states, state, batch, kind)

    def step(self, state, batch):
        if self.column is not None:
            return self.column.step(state, batch)
        acc, z_sum, sums = self._walk(state, batch, "step")
        states, get = self.states, self.programs.get
        out = [get(f"update{s}", "step", self.placement.device(s, r))(
            states.copy(state.params, r, s), states.copy(state.opt_state, r, s),
            states.copy(acc, r, s), states.copy(z_sum, r, s)) for r, s in states.copies]
        params, opts, stats = zip(*out)
        return state.replace(step=state.step + 1, params=params, opt_state=opts, model_state=stats), sums

    def gradients(self, state, batch):
        acc, _, _ = self._walk(state, batch, "gradients")
        from_stages = processes.fetch_held(list(acc[:self.schedule.stages]))
        return self.plan.from_view(self.fns.join(from_stages))

    def eval_step(self, state, batch):
        S, get, device = self.schedule.stages, self.programs.get, self.placement.device
        x = batch["image"][0]
        for s in range(S - 1):
            x = self.placement.move(get(f"fwd{s}", "eval_step", device(s))(
                state.params[s], state.model_state[s], x), s + 1)
        labels = {"label": batch["label"][0], "weight": batch["weight"][0]}
        return get("last_eval", "eval_step", device(S - 1))(state.params[S - 1], state.model_state[S - 1],
                                                           x, labels)

    def compile(self, name, state, batch) -> measure.Programs:
        """AOT-compile every program `name` ('step' or 'eval_step') runs, each on the device of
        each stage copy; returns them all with how often a call runs each."""
        start = time.perf_counter()
        if name == "step" and self.column is not None:
            parts = self.column.compile(state, batch)
        else:
            parts = aot.compile_stage_programs(self.programs, self.placement, self.states, name, state, batch)
        return measure.Programs(name, time.perf_counter() - start, tuple(parts))

    def timeline(self, state, batch) -> list[dict]:
        """A measured per-device timeline of one step (the walk's programs, stamped)."""
        return timeline.timeline(lambda: self._walk(state, batch, "timeline"), self.programs.stamps)

    def stamp_programs(self) -> bool:
        """Whether the step runs as one program per process (`column` across processes): if
        so, its programs, traced from now on, stamp each action and receive."""
        if self.column is None or not self.column.across:
            return False
        self.column.stamping = True
        return True

    def program_timeline(self, stamps) -> dict:
        """The steps those programs stamped, every process's (a collective), beside the table
        replayed as this runtime lists it (the last stage's gradients sent from its forwards)."""
        column = self.column
        return timeline.program_timeline(self.schedule, column.lowered, column.mine, stamps,
                                         sent_early(self.schedule))

    def serial_steps(self, state, batch, walks: int) -> list[serial.SerialStep]:
        """`walks` steps' programs each run alone and timed (`serial`), after one that compiles
        what the step's own compile did not (the walk's programs, where the step is one
        program per device)."""
        run = lambda: serial.serial_step(self.schedule, self.programs, self.placement, self.states, state, batch)  # noqa: E731
        run()
        return [run() for _ in range(walks)]

    def walked_seconds(self, state, batch, iters: int) -> list[float]:
        """The walk's time (the step before its updates) when its programs run as dispatched,
        the devices overlapping as the table lets them: `iters` walks each waited for, after
        one that compiles. Where the step is one program per device (`column`), it is that
        program, not this walk, that `bench` times."""
        return measure.time_calls(lambda: self._walk(state, batch, "step"), iters, warmup=1)

    # --- accounting ----------------------------------------------------------------------------
    def transfer_bytes_per_step(self, batch_size: int) -> int:
        """Bytes moved between devices per step: each example's activation crosses each
        boundary forward once and its gradient back once (f32, no padding); with replicas,
        each stage's gradient (and batch-norm statistics) also goes to its other copy."""
        sends = 2 * batch_size * sum(self.boundaries) * 4
        copies = 2 * sum(self.states.stage_param_bytes()) if self.schedule.replicas > 1 else 0
        return sends + copies

    def theory(self, batch_size: int) -> dict[str, int]:
        """Within a process activations move with device_put (no collectives); a boundary
        between two processes' devices moves its bytes each way (inside each process's one
        program with one stage per process, `column`; else `processes.move`: on CPU a
        point-to-point transfer, elsewhere a two-device collective-permute), outside XLA's
        collectives; counted, as the cost model prices it, as a collective-permute."""
        device = self.placement.device
        crossing = sum(2 * batch_size * n * 4 for b, n in enumerate(self.boundaries)
                       if device(b).process_index != device(b + 1).process_index)
        return {"collective-permute": crossing, "total": crossing} if crossing else {"total": 0}

    def accounting(self, programs: measure.Programs) -> dict:
        """Memory per stage (the most of the programs on its device) and the most activation
        memory a device holds."""
        memory = {p.name: p.stats["memory"] for p in programs.parts}
        stage_of = {p.name: p.stage for p in programs.parts}
        held_here = sorted(set(stage_of.values()))  # with a program per stage, this process's
        per_stage = [measure.max_memory([m for prog, m in memory.items() if stage_of[prog] == s])
                     for s in held_here]
        return {"param_bytes_per_device": max(self.states.stage_param_bytes()) * self.schedule.replicas,
                "memory_per_stage": per_stage, "activation_bytes_per_device": self._activation_bytes(memory)}

    def _activation_bytes(self, memory) -> int:
        """With one program per stage, its temporaries (the residuals of every micro-batch in
        flight among them); walked from the host, the residuals are outputs a stage's forward
        returns and its backward consumes later, one set per micro-batch in flight."""
        if self.column is not None:
            return max(m["temp_bytes"] for m in memory.values())
        schedule = self.schedule
        peaks = peak_in_flight(table(schedule))  # per device, over every stage it holds
        forward, backward, last = (("layers_fwd", "bwd_in", "last_in") if schedule.splits_backward
                                   else ("train_fwd", "bwd", "last"))
        held = [memory[f"{forward}{s}@0"]["output_bytes"] * max(1, peaks[schedule.device_of(s, 0)])
                + memory[f"{backward}{s}@0"]["temp_bytes"] for s in range(schedule.stages - 1)]
        return max([*held, memory[f"{last}@0"]["temp_bytes"]])

    def facts(self, batch_size: int) -> dict:
        """What `describe` reports of the runtime."""
        return {"implementation": self.implementation,
                "stage_param_bytes": self.states.stage_param_bytes(),
                "step_programs": "one per device, its messages inside (p2p)" if self.column
                else f"per stage and slot, walked from the host ({self.not_one_program})",
                "boundary_elements_per_example": self.boundaries,
                "stage_transfer_bytes_per_step": self.transfer_bytes_per_step(batch_size)}
