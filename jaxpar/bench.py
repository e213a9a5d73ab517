"""Benchmark one strategy's training step: time, images/s, FLOP/s, bytes and memory.

Steady-state step time, images/s and compile time; achieved FLOP/s against a measured matmul
peak; collective bytes and memory per device.

    python -m experiments bench --model cnn --batch-size 128 --strategy single

Batches are synthetic (the shapes and classes of the run's dataset): the step's cost does not depend on
pixel values, and a benchmark should not wait on data preparation.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from jaxpar import data as datalib
from jaxpar.profiling import measure
from jaxpar.config import TrainConfig, to_dict
from jaxpar.errors import ConfigError
from jaxpar.optim import make_optimizer
from jaxpar.parallel.pipeline.host import serial as host_serial, timeline as host_timeline
from jaxpar.parallel.pipeline.schedules import timed_bubble
from jaxpar.parallel.transport import addresses, p2p, processes
from jaxpar.results import RunResult, capture_provenance, environment
from jaxpar.runtime import watchdog
from jaxpar.train import build_model, make_strategy
from jaxpar.validate import validate


def benchmark(config: TrainConfig, iters: int = 20, warmup: int = 3,
              matmul_peak: bool = True, timeline: bool = False,
              wire: str | None = None) -> RunResult:
    """Time `iters` steps of `config`'s strategy (each waited for) after `warmup` steps; with
    --steps-per-dispatch K, `iters` calls of K steps each, a step's time being a call's / K.

    Args:
      matmul_peak: also time a 2048^3 matmul on every device, the ceiling achieved FLOP/s is
        compared with (seconds on a CPU); False leaves `matmul_peak_gflops` and
        `percent_of_peak` None, for studies that compare strategies with one another.
      timeline: also record one stamped step's per-device timeline (`metrics["timeline"]`),
        for strategies whose stages are separate programs (`host_timeline`).
      wire: a network interface of this host (e.g. `eth0`): also record its counters' change
        over the timed steps alone (`metrics["wire"]`: bytes and packets sent and received,
        headers included), read after the warm-up steps and after the last timed step.
    """
    wall_start = time.perf_counter()
    capture_provenance(None)  # the revision this run starts from; no dataset is read
    validate(config)  # every option and combination (the CLI has checked them too)
    if wire:
        wire_counters(wire)  # a missing interface fails before any work
    strategy = _strategy(config, timeline)
    mesh = strategy.make_mesh(jax.devices())
    batch_size, host_batch = config.data.batch_size, _synthetic_batch(config)
    k = config.parallel.steps_per_dispatch
    tx = make_optimizer(config.optim, total_steps=(warmup + iters) * k + 1)
    state = strategy.init(build_model(config), tx, mesh)
    batch = strategy.place_batch(host_batch)
    in_program = timeline and strategy.stamp_programs()  # one program a process: its timed steps stamped
    programs = strategy.compile("step", state, batch)  # also for K > 1: FLOPs of one step
    chained = strategy.compile("steps", state, (batch,) * k) if k > 1 else None

    with watchdog.armed(config.parallel.strategy):  # every timed wait bounded in a multi-process run
        state, times, measured, stamps = _time_steps(strategy, state, batch, k > 1, k, warmup, iters, wire)
    median_s = sorted(times)[len(times) // 2]
    peak = measure.matmul_peak(list(mesh.devices.flat))["gflops"] if matmul_peak else None
    measured_timeline = _timeline(strategy, state, batch, stamps if in_program else None) if timeline else {}
    accounting = strategy.accounting(programs, state)
    achieved = programs.flops / median_s / 1e9
    metrics = {
        "step_time_ms_median": 1000 * median_s,
        "step_time_ms_min": 1000 * min(times),
        "step_time_ms_max": 1000 * max(times),
        "images_per_sec": batch_size / median_s,
        "compile_s": programs.seconds if chained is None else chained.seconds,
        "steps_per_dispatch": k,
        "flops_per_step": programs.flops,
        "achieved_gflops": achieved,
        "matmul_peak_gflops": peak,
        "percent_of_peak": None if peak is None else 100 * achieved / peak,
        "flops_loop_bodies_once": programs.has_loops,
        **accounting,
        "iters": iters,
        "watchdog": watchdog.usage(),  # its thread's CPU seconds (None: no watchdog ran)
        **measured_timeline,
        **measured,
        "wall_s": time.perf_counter() - wall_start,
    }
    return RunResult(kind="bench", config=to_dict(config), env=environment(config, strategy),
                     metrics=metrics, strategy=strategy.describe())


def _strategy(config: TrainConfig, timeline: bool):
    """The strategy to time; ConfigError before any work when a timeline cannot be stamped."""
    strategy = make_strategy(config)
    if timeline and not (getattr(strategy, "implementation", None) == "mpmd" and hasattr(strategy, "timeline")):
        raise ConfigError(f"--timeline needs stages run as separate programs: --strategy layer-split, "
                          f"or pipeline / gems with --pipeline-impl mpmd (not {strategy.name} "
                          f"as {getattr(strategy, 'implementation', 'one program')})")
    return strategy


def _synthetic_batch(config: TrainConfig) -> dict:
    """One synthetic batch of the run's image shape and classes."""
    batch_size, spec = config.data.batch_size, datalib.spec(config.data)
    datalib.check_batch_size(batch_size, batch_size, "benchmark")
    images, labels = datalib.synthetic(batch_size, 0, shape=spec.image_shape, classes=spec.num_classes)
    return {"image": images, "label": labels, "weight": np.ones(batch_size, np.float32)}


WIRE_COUNTERS = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")


def _time_steps(strategy, state, batch, chained: bool, k: int, warmup: int, iters: int,
                wire: str | None):
    """Warm up, then time `iters` calls (each waited for): the state after, each step's
    seconds, what else the timed calls measured ({"wire": the interface's counter changes}
    where asked, "p2p_waited_ms" where messaged) and the stamps their programs took
    (`p2p.take_stamps`)."""
    holder = {"state": state}
    waited = []  # p2p.waited() as each timed call starts (the one before it was waited for)

    def one_call():
        watchdog.progress()  # the call before this one was waited for
        waited.append(p2p.waited())
        if not chained:
            holder["state"], sums = strategy.step(holder["state"], batch)
        else:  # --steps-per-dispatch K: K steps per call, each timed as the call's K-th part
            holder["state"], sums = strategy.steps(holder["state"], (batch,) * k)
        # Waited for with the state: a stage on another process leaves this one's sums a
        # handle (nothing to wait for here), its own stage's update is what it computes.
        return holder["state"], sums

    measure.time_calls(one_call, 0, warmup=warmup)
    before = wire_counters(wire) if wire else None
    waited.clear()
    p2p.take_stamps()  # the warm-up's
    times = [t / k for t in measure.time_calls(one_call, iters, warmup=0)]
    waited.append(p2p.waited())
    stamps = p2p.take_stamps()
    measured_wire = {} if before is None else {"wire": {
        "interface": wire, "steps": iters * k,
        **{name: n - before[name] for name, n in wire_counters(wire).items()}}}
    return holder["state"], times, {**measured_wire, **_waited_ms(waited, k)}, stamps


def _waited_ms(marks: list, k: int) -> dict:
    """{"p2p_waited_ms": each process's median milliseconds a step in its programs' socket
    receives and flushes} (`marks`: p2p.waited() as each timed call started, and after the
    last), when this run spans processes whose programs message each other (a pipeline's
    stages, one program per process); else {}. A collective under jax.distributed: every
    process calls it, whatever its strategy, at the same point."""
    if not processes.many():
        return {}
    messaged = None not in marks and marks[-1][1] > marks[0][1]
    mine = 1000 * float(np.median(np.diff([m[0] for m in marks]))) / k if messaged else np.nan
    every = [float(x) for x in addresses.every_process(np.float64(mine))]
    return {} if any(np.isnan(every)) else {"p2p_waited_ms": every}


def wire_counters(interface: str) -> dict[str, int]:
    """The kernel's counters of a network interface (Linux sysfs): what it has sent and
    received since it was made, headers included."""
    folder = Path("/sys/class/net") / interface / "statistics"
    if not folder.is_dir():
        raise ConfigError(f"--wire {interface}: no such network interface here ({folder} is "
                          "missing); name one of `ip link`'s, e.g. eth0")
    return {name: int((folder / name).read_text()) for name in WIRE_COUNTERS}


def _timeline(strategy, state, batch, stamps) -> dict:
    """The timeline asked for: the timed steps as their programs stamped them (`stamps`, where
    the step stamps itself), else one walk stamped after them."""
    if stamps is not None:
        return {"timeline": {**strategy.program_timeline(stamps), **_bubbles(strategy)}}
    return _walked_timeline(strategy, state, batch)


def _bubbles(strategy) -> dict:
    """The schedule's table's bubble (unit times) and its formula's, beside a timeline's."""
    describe = strategy.describe()
    return {"bubble_fraction": describe.get("bubble_fraction", 0.0),
            "bubble_theory": describe.get("bubble_theory", 0.0)}


def _walked_timeline(strategy, state, batch) -> dict:
    """One stamped step's events and its idle fraction (the order, for the figure), and the
    bubble twice, for the steps walked from the host: the schedule's table replayed with each
    action's measured time (`bubble_timed`, its theory) and the walk's own (`bubble_measured`:
    the devices' work against devices x the median walk, less what it runs outside any
    action). Action times come from walks whose programs ran alone (`host.serial`), not from
    the stamped one: its stamps lengthen every program. Both time the walk's programs, not
    the one program per device a step may run instead (`step_programs`)."""
    events = strategy.timeline(state, batch)
    seconds, outside_s = host_serial.medians(strategy.serial_steps(state, batch))
    walk_s = float(np.median(strategy.walked_seconds(state, batch)))
    schedule = strategy.schedule
    busy_s = sum(seconds[a.kind, a.stage] for lst in schedule.lists for a in lst)
    return {"timeline": {"events": events,
                         "idle_fraction": host_timeline.idle_fraction(events, len(strategy.devices)),
                         "bubble_measured": 1.0 - busy_s / (schedule.devices * (walk_s - outside_s)),
                         **_bubbles(strategy),
                         "bubble_timed": timed_bubble(schedule, seconds),
                         "action_ms": {f"{k}{s}": 1000 * v for (k, s), v in sorted(seconds.items())},
                         "outside_ms": 1000 * outside_s, "walk_ms": 1000 * walk_s}}


def report(result: RunResult) -> str:
    """A few human lines for the terminal."""
    m, env = result.metrics, result.env
    peak = ("(matmul peak not measured)" if m.get("matmul_peak_gflops") is None else
            f"= {m['percent_of_peak']:.1f}% of a measured f32 matmul peak of "
            f"{m['matmul_peak_gflops']:.1f} GFLOP/s")
    return "\n".join([
        f"{result.config['model']['model']} / {result.strategy.get('strategy')} / batch "
        f"{result.config['data']['batch_size']} on {env['device_count']} x {env['device_kind']} "
        f"({env['backend']}, {env['cpu_cores']} cores, threads: {env['threads']})",
        f"  median step      {m['step_time_ms_median']:.2f} ms  (min {m['step_time_ms_min']:.2f}, "
        f"max {m['step_time_ms_max']:.2f}, {m['iters']} calls of {m['steps_per_dispatch']} step(s))",
        f"  images/s         {m['images_per_sec']:,.0f}",
        f"  compile          {m['compile_s']:.2f} s",
        f"  achieved         {m['achieved_gflops']:.1f} GFLOP/s {peak}",
        f"  collective bytes {m['collective_bytes_per_step']:,} per step (theory: "
        f"{m['collective_bytes_theory'].get('total', 0):,})",
        f"  state/device     {m['state_bytes_per_device']:,} B (parameters + optimizer state)",
        f"  memory/device    args {m['memory_per_device']['argument_bytes']:,} B, temp "
        f"{m['memory_per_device']['temp_bytes']:,} B",
        *([f"  idle in p2p      {', '.join(f'{w:.2f}' for w in m['p2p_waited_ms'])} ms a step (process by "
           f"process: blocked in receives and flushes)"] if "p2p_waited_ms" in m else []),
        *_timeline_lines(m.get("timeline")),
    ])


def _timeline_lines(timeline: dict | None) -> list[str]:
    """The report's line on a timeline: a walk's or the stamped step programs'."""
    if timeline is None:
        return []
    if "walk_ms" not in timeline:
        lived = "" if timeline["idle_ms"] is None else f"a step idles {timeline['idle_ms']:.2f} ms a device, "
        return [f"  timeline         {timeline['steps']} steps stamped in their programs: {lived}messages "
                f"awaited {', '.join(f'{w:.2f}' for w in timeline['receive_ms'])} ms (device by device); "
                f"the table with their action times idles {timeline['idle_ms_timed']:.2f} ms a device "
                f"({timeline['bubble_timed']:.1%}; unit times {timeline['bubble_fraction']:.1%})"]
    return [f"  timeline         walked step {timeline['walk_ms']:.2f} ms idles "
            f"{timeline['bubble_measured']:.1%} of devices x walk; its table with the same action "
            f"times {timeline['bubble_timed']:.1%} (unit times {timeline['bubble_fraction']:.1%})"]
