"""The cost model: a strategy's step time (compute, exposed communication, pipeline bubble) and
memory per device, predicted from what the strategy states about itself
(`Strategy.cost`, each strategy family's `cost` module) and a machine: a measured profile
(`jaxpar.profiling.machine`) or assumed hardware (DEVICES, LINKS).

    profile = load_profile("figures/data/cost/profile.json")
    machine = simulated(profile)                       # this machine's CPU devices
    machine = cluster(profile, device="h100", link="10gbit")
    pred = predict(problem(model_config, "pipeline", {"stage": 4}, batch=128), machine)
    pred.total_s == pred.compute_s + pred.comm_s + pred.bubble_s

How a machine turns a strategy's work into time:
- dedicated devices (GPUs, hosts): the devices compute at once; the step's compute is the
  busiest device's, a pipeline's M slots of its slowest stage and, as bubble, the fill and
  drain: one micro-batch of each other stage ((S - 1) slots when the stages are equal);
- simulated CPU devices share the machine's cores: one device's work is timed on every core
  (XLA's one intra-op pool), so D devices' work adds up (D x step(B/D) for data parallelism,
  not step(B/D)), and a pipeline's bubble costs nothing unless its critical path is longer
  than the sum (an idle stage leaves its cores to the others); except a convolutional model's
  pipeline in one program per stage (`side_by_side`): its stages run at once, a core each;
- MPI ranks run one pinned thread each: their one-thread work adds up over min(ranks, cores);
  more ranks than cores: a rank that waits in MPI polls (MPICH's default) and keeps its share
  of a core, so every rank runs at cores / ranks of a core for the whole step and the
  critical path (a pipeline's slowest stage, the parameter server's rank 0) stretches by
  ranks / cores.
Communication is not overlapped with compute (XLA:CPU runs both on the same threads; on a
cluster this is the upper bound) and is priced per collective from the profile's measured
message sizes or, on a link, by the formulas of `link_seconds`; except a host-driven
pipeline's sends over a link, whose wire is a resource of its own (`_exposed_sends`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from dataclasses import field
from typing import Callable

import numpy as np

F32 = 4
ADAM_SLOTS = 2  # Adam's two moments: state = parameters x (1 + 2)


@dataclass(frozen=True)
class Link:
    """A network between devices: one message costs latency + bytes / bandwidth."""
    name: str
    bytes_per_s: float
    latency_s: float
    source: str


@dataclass(frozen=True)
class Device:
    """An assumed accelerator: its f32 peak, memory and memory bandwidth."""
    name: str
    peak_gflops: float
    memory_bytes: float
    memory_bytes_per_s: float
    source: str
    layer_overhead_s: float = 0.0   # per layer and step: kernel launches a small batch cannot hide


# Assumed hardware (docs/studies/cost-check.md names these as assumptions, with their sources).
LINKS = {
    "10gbit": Link("10gbit", 10e9 / 8, 20e-6, "10 Gbit/s Ethernet; 20 us per message (TCP, typical)"),
    "100gbit": Link("100gbit", 100e9 / 8, 5e-6, "100 Gbit/s InfiniBand/RoCE; 5 us per message"),
    "nvlink": Link("nvlink", 450e9, 3e-6, "H100 SXM NVLink 4: 900 GB/s both ways, 450 GB/s each way"),
}
DEVICES = {
    "h100": Device("h100", 67e3, 80e9, 3.35e12,
                   "NVIDIA H100 SXM datasheet: 67 TFLOP/s FP32 (no tensor cores), 80 GB HBM3 at 3.35 TB/s; "
                   "30 us per layer and step: ~6 kernels (forward, two gradients, their element-wise "
                   "parts) at ~5 us of CUDA launch latency each (assumed)", layer_overhead_s=30e-6),
}


@dataclass(frozen=True)
class Collective:
    """One collective a step runs: operand bytes per device (as `measure.collective_bytes`
    counts them), the devices in its group and how many times per step (1/k: every k steps)."""
    op: str
    bytes: float
    group: int
    count: float = 1.0


@dataclass(frozen=True)
class Work:
    """What a strategy states about one step (`Strategy.cost`): each device's compute, its
    collectives and memory; a pipeline also its stages (per micro-batch) and micro-batches."""
    device_s: tuple[float, ...]              # compute seconds of each device, on all its cores
    collectives: tuple[Collective, ...] = ()
    state_bytes: float = 0.0                 # parameters + optimizer state, fullest device
    activation_bytes: float = 0.0            # kept for the backward pass, fullest device
    stage_s: tuple[float, ...] = ()          # pipeline: each stage's time per micro-batch
    microbatches: int = 1
    serial: bool = False                     # devices run one after another (layer-split)
    programs: float = 0.0                    # programs the host dispatches per step (one per stage program)
    span_s: float | None = None              # pipeline: its schedule's span replayed with stage times


@dataclass(frozen=True)
class Prediction:
    compute_s: float
    comm_s: float
    bubble_s: float
    state_bytes: float
    activation_bytes: float
    batch: int
    devices: int
    notes: tuple[str, ...] = ()
    wire_s: float = 0.0    # of comm_s: bytes on a link's wire (not this machine's speed)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.bubble_s

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def images_per_s(self) -> float:
        return self.batch / self.total_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s, "memory_bytes": self.memory_bytes,
                "images_per_s": self.images_per_s}


# --- compute: how long a model's pieces take on one device ---------------------------------

def _interp(xs, ys, x: float) -> float:
    """Piecewise-linear in x through the measured points, extended linearly past both ends
    (a step's time is nearly affine in its batch: a fixed part + a per-example part)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) == 1:
        return float(ys[0] * x / xs[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(max(ys[i] + slope * (x - xs[i]), 0.05 * ys[0]))


def step_line(xs, ys) -> Callable[[float], float]:
    """A step's time against its batch as one line (a fixed part + a per-example part) fitted
    by least squares through every measured batch (relative errors, so that the small batches
    a split device runs count as much as the large ones): one batch's timing noise (e.g. a
    step at 16 rows 3x faster than at 32 while the cost per example is flat) then no longer
    decides the step of every device count that lands near it. Fewer than 3 points: through
    them (`_interp`)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) < 3:
        return lambda x: _interp(xs, ys, x)
    slope, fixed = np.polyfit(xs, ys, 1, w=1 / ys)
    return lambda x: float(max(slope * x + fixed, 0.05 * ys[0]))


@dataclass(frozen=True)
class LayerCost:
    name: str
    kind: str
    flops_per_example: float
    param_bytes: float
    out_bytes_per_example: float
    seconds: Callable[[float], float]   # forward + backward of a batch of this many examples


@dataclass(frozen=True)
class Compute:
    """One device's time for a model: the whole step (`step_s`, what `single` takes), the
    optimizer update alone and each layer's forward + backward, plus the model's bytes."""
    key: str
    step_s: Callable[[float], float]
    update_s: float
    layers: tuple[LayerCost, ...]
    temp_bytes: Callable[[float], float]
    source: str                     # "measured" or how it was derived
    leaf_bytes: tuple[int, ...] = ()  # each parameter array's bytes (collectives pay each's latency)

    @property
    def param_bytes(self) -> float:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def state_bytes(self) -> float:
        return self.param_bytes * (1 + ADAM_SLOTS)

    def backprop_s(self, batch: float) -> float:
        """The step without its optimizer update: the part that a batch split divides."""
        return max(self.step_s(batch) - self.update_s, 0.0)

    def shares(self, batch: float) -> list[float]:
        """Each layer's share of the forward + backward time at this batch."""
        times = [max(layer.seconds(batch), 1e-12) for layer in self.layers]
        return [t / sum(times) for t in times]

    def part_s(self, batch: float, layers) -> float:
        """Forward + backward of the layers `layers` (indices) at this batch, plus their share of
        the update: one pipeline stage or layer-split device."""
        shares = self.shares(batch)
        params = sum(self.layers[i].param_bytes for i in layers) / max(self.param_bytes, 1)
        return self.backprop_s(batch) * sum(shares[i] for i in layers) + self.update_s * params


def _typical_ms(steps: dict) -> list[float]:
    """The profile's median step at each batch (the studies report each point's median step,
    and the profile is taken on a quiet machine, as they are); the fastest where a profile has
    no medians."""
    return steps.get("step_ms_median") or steps["step_ms"]


def profiled_compute(entry: dict, key: str, one_thread: bool = False, leaf_bytes=()) -> Compute:
    """A model's `Compute` from a profile entry (`jaxpar.profiling.machine`); `one_thread`: the
    one-thread step times (an MPI rank's)."""
    steps = entry["steps_one_thread"] if one_thread and "steps_one_thread" in entry else entry["steps"]
    line = step_line(steps["batch"], _typical_ms(steps))
    scale = 1.0
    if one_thread and "steps_one_thread" in entry:  # the update on one thread, in proportion
        every_core = entry["steps"]
        first = steps["batch"][0]
        scale = line(first) / step_line(every_core["batch"], _typical_ms(every_core))(first)
    layers = []
    for layer in entry["layers"]:
        xs = sorted(int(b) for b in layer["ms"])
        ys = [layer["ms"][str(b)] / 1000 for b in xs]
        layers.append(LayerCost(layer["name"], layer["kind"], layer["flops_per_example"], layer["param_bytes"],
                            layer["out_bytes_per_example"], lambda b, xs=xs, ys=ys: _interp(xs, ys, b)))
    return Compute(key, lambda b: line(b) / 1000, entry["update_ms"] * scale / 1000,
                   tuple(layers), lambda b: _interp(entry["steps"]["batch"], entry["steps"]["temp_bytes"], b),
                   "measured" + (" (one thread)" if one_thread else ""), tuple(leaf_bytes))


def flops_compute(key: str, layers: list[dict], rates_gflops: dict, memory_bytes_per_s: float,
                  source: str, leaf_bytes=(), layer_overhead_s: float = 0.0) -> Compute:
    """A model's `Compute` from its layers' FLOPs at an achieved rate per layer kind (for
    models or devices without a measured profile): a layer takes FLOPs / rate (+ a fixed
    overhead per layer), the update reads and writes every parameter, gradient and Adam moment
    (7 passes) at the memory's bandwidth, and the step is their sum."""
    def seconds(b, f, k):
        return f * b / (rates_gflops[k] * 1e9) + layer_overhead_s

    built = tuple(LayerCost(l["name"], l["kind"], l["flops_per_example"], l["param_bytes"],
                        l["out_bytes_per_example"],
                        lambda b, f=l["flops_per_example"], k=l["kind"]: seconds(b, f, k))
                  for l in layers)
    update = 7 * sum(l.param_bytes for l in built) / memory_bytes_per_s
    out_bytes = sum(l.out_bytes_per_example for l in built)
    return Compute(key, lambda b: sum(l.seconds(b) for l in built) + update, update, built,
                   lambda b: 2 * out_bytes * b, source, tuple(leaf_bytes))


# --- machines: how work and collectives become time ----------------------------------------

@dataclass(frozen=True)
class Machine:
    name: str
    compute: Callable[[str, bool], Compute]   # (model key, one thread?) -> Compute
    collective_s: Callable[[Collective], float]
    slots: int                 # how many devices' work runs at once (1: they share one pool)
    memory_bytes: float | None
    notes: tuple[str, ...] = ()
    wire_s: Callable[[Collective], float] | None = None   # of collective_s: time on a link's wire
    dispatch_s: float = 0.0    # the host's time per program it dispatches (host-driven pipelines)
    busy_wait: bool = False    # a device that waits holds its core (MPI ranks polling)
    step_host_s: float = 0.0   # the host's time per step on each process's own core (pinned processes)


def fitted_seconds(fits: dict, op: str, group: int, nbytes: float) -> float:
    """Seconds of collective `op` on `nbytes` from a profile's measurements at the measured
    group size nearest `group` (scaled by (group - 1) / (nearest - 1) past the largest: a
    ring's steps): piecewise-linear through the measured message sizes (a cache-sized message
    and a memory-sized one differ in bandwidth; one affine fit would let the largest decide),
    linear past both ends."""
    if op not in fits:
        raise KeyError(op)
    sizes = sorted(int(n) for n in fits[op])
    near = min(sizes, key=lambda n: (abs(n - group), n))
    points = sorted(fits[op][str(near)]["points"])
    scale = (group - 1) / (near - 1) if group > max(sizes) and near > 1 else 1.0
    return scale * _interp([p[0] for p in points], [p[1] for p in points], nbytes)


def fitted_collectives(fits: dict, send_share: float = 1.0,
                       fixed_hidden: bool = False) -> Callable[[Collective], float]:
    """A collective's seconds from a profile's fits (`fitted_seconds`), `count` times a step;
    nothing for a group of one. A `send` (one way: a host-driven pipeline's message on
    jaxpar's channels) costs `send_share` of the 2-device collective-permute the profile
    times, a swap: on one host each side's copy runs at once with the other's, so a send
    costs what the swap costs (1); across 2 emulated hosts the swap's directions went one
    after the other, twice the bytes' time on the link, so a send is half of it.
    `fixed_hidden`: each priced at its bytes' part alone, less the fit's time at zero bytes
    (`shared_pool_collectives`)."""
    def seconds(c: Collective) -> float:
        if c.group <= 1:
            return 0.0
        op, group = ("collective-permute", 2) if c.op == "send" else (c.op, c.group)
        share = send_share if c.op == "send" else 1.0
        fixed = max(fitted_seconds(fits, op, group, 0.0), 0.0) if fixed_hidden else 0.0
        return c.count * share * max(fitted_seconds(fits, op, group, c.bytes) - fixed, 0.0)
    return seconds


def shared_pool_collectives(fits: dict) -> Callable[[Collective], float]:
    """Collectives inside the step of simulated devices that share one pool of cores: each at
    its bytes' part of the profile's fit (copies and sums, core time), not the fixed part a
    program of one collective pays (its time at zero bytes: the program's launch on every
    device and their rendezvous, 60-220 us in the committed profile against 4 us for a
    one-device program). Inside a step the devices reach a collective at different times and
    the cores run the others' work while one waits, so that fixed part is no core time."""
    return fitted_collectives(fits, fixed_hidden=True)


def link_seconds(link: Link, c: Collective) -> float:
    """A collective over `link`, each at its usual best algorithm's cost: the bandwidth of a
    ring (all-reduce moves 2(n-1)/n of the bytes, reduce-scatter (n-1)/n, all-gather n-1
    operands) with the latency of recursive halving/doubling (log2 n messages; 2 log2 n for
    an all-reduce), as NCCL's and MPI's large-scale collectives approach; a permute is one
    message, a broadcast a binary tree, a gather n-1 messages into the root."""
    n, b, a, bw = c.group, c.bytes, link.latency_s, link.bytes_per_s
    if n <= 1:
        return 0.0
    hops = float(np.ceil(np.log2(n)))
    op = c.op.removeprefix("mpi_")
    seconds = {
        "all-reduce": 2 * hops * a + 2 * (n - 1) / n * b / bw,
        "allreduce": 2 * hops * a + 2 * (n - 1) / n * b / bw,
        "all-gather": hops * a + (n - 1) * b / bw,
        "reduce-scatter": hops * a + (n - 1) / n * b / bw,
        "collective-permute": a + b / bw, "sendrecv": a + b / bw, "send": a + b / bw,
        "bcast": hops * (a + b / bw),
        "gather": a + (n - 1) * b / bw,
    }[op]
    return c.count * seconds


def _exposed_sends(work: Work, machine: Machine, sends: list[Collective]) -> float:
    """What a host-driven pipeline's sends over a link add to its step. Each direction of each
    boundary's link is a resource of its own that the sends hold while the stages compute, so
    the link is one more stage each way on every micro-batch's path, a message's time there:
    the step's bound with those hops (M slots of the slowest stage or hop, and the fill and
    drain through every stage and hop) less its bound without them. A slow link sets the
    pace (M messages a direction); a fast one adds its fill and drain only."""
    hops = [machine.collective_s(dataclasses.replace(c, count=1)) for c in sends]
    m, stages = work.microbatches, work.stage_s

    def bound(hop_path: float, slowest: float) -> float:
        return m * slowest + sum(stages) + hop_path - slowest

    return bound(2 * sum(hops), max(*stages, *hops)) - bound(0.0, max(stages))


def predict(work: Work, machine: Machine, batch: int, devices: int) -> Prediction:
    """The step's time split into compute, exposed communication and bubble (see the module
    docstring for how each kind of machine adds devices' work)."""
    on_wire = bool(work.stage_s) and machine.wire_s is not None
    sends = [c for c in work.collectives if on_wire and c.op == "send"]
    others = [c for c in work.collectives if not (on_wire and c.op == "send")]
    comm = sum(machine.collective_s(c) for c in others)
    wire = sum(machine.wire_s(c) for c in others) if machine.wire_s else 0.0
    if sends:   # they overlap the stages' compute: what they add is the wire's
        exposed = _exposed_sends(work, machine, sends)
        comm, wire = comm + exposed, wire + exposed
    if work.stage_s:   # a pipeline: M micro-batches through S stages
        slowest = max(work.stage_s)
        dedicated = work.microbatches * slowest
        # fill and drain: each other stage's one micro-batch ((S - 1) slots of the slowest when
        # the stages are equal; a stage much faster than the slowest idles less); a schedule
        # with its own span (interleaved, zero bubble) idles what its replay says
        bubble = sum(work.stage_s) - slowest if work.span_s is None else max(work.span_s - dedicated, 0.0)
        updates = max(work.device_s) if work.device_s else 0.0
        critical = dedicated + bubble + updates
        total_work = work.microbatches * sum(work.stage_s) + sum(work.device_s)
    else:
        updates = 0.0
        dedicated, bubble = (sum(work.device_s) if work.serial else max(work.device_s)), 0.0
        critical = dedicated
        total_work = sum(work.device_s)
    if machine.slots >= devices:   # every device computes at once
        compute = critical - bubble
    else:                          # devices share cores: their work adds up
        compute = total_work / machine.slots
        if machine.busy_wait:      # waiting ranks spin on their share: each runs at slots/devices
            critical *= devices / machine.slots
        bubble = max(critical - compute, 0.0)
    compute += work.programs * machine.dispatch_s   # the host's dispatches, on the same cores
    # each pinned process's host work, at once: a core holding several processes runs each one's
    compute += machine.step_host_s * max(1.0, devices / machine.slots)
    return Prediction(compute, comm, bubble, work.state_bytes, work.activation_bytes, batch, devices,
                      machine.notes, wire)


def load_profile(path) -> dict:
    """A saved profile's metrics and env (`python -m experiments profile` writes it)."""
    with open(path) as f:
        d = json.load(f)
    if d.get("kind") != "profile":
        raise ValueError(f"{path} holds a {d.get('kind')!r} result, not a profile")
    return {**d["metrics"], "env": d["env"]}


def simulated(profile: dict, model_compute: Callable[[str, bool], Compute], fixed_hidden: bool = False) -> Machine:
    """This machine's simulated CPU devices: one shared pool, the profile's collectives
    (`fixed_hidden`: at their bytes' part, `shared_pool_collectives`)."""
    collectives = (shared_pool_collectives if fixed_hidden else fitted_collectives)(profile["collectives"])
    return Machine("simulated CPU devices", model_compute, collectives,
                   slots=1, memory_bytes=None,
                   notes=(f"simulated devices share {profile['cores']} cores: their work adds up",),
                   dispatch_s=profile.get("dispatch_us", 0.0) / 1e6)


def side_by_side(profile: dict, model_compute: Callable[[str, bool], Compute]) -> Machine:
    """This machine's simulated devices running a convolutional model's pipeline, one program
    per stage: the stages run at once, each at its one-thread speed on a core of its own. Their
    convolutions are oneDNN calls whose chunks run on whichever of the pool's threads is free
    (jaxpar/models/onednn.py), and a stage waiting for a message holds no thread (p2p.cc), so
    two stages' micro-batches take a core each instead of splitting every small micro-batch
    over both, and a waiting stage leaves its core to the others. XLA's own dense layers split
    each op over the whole pool and wait for every part: the MLPs' stages queue behind each
    other, and `simulated` (their work added up) prices them."""
    return Machine("simulated CPU devices, stages side by side", lambda key, _: model_compute(key, True),
                   fitted_collectives(profile["collectives"]), slots=profile["cores"], memory_bytes=None,
                   notes=(f"pipeline stages side by side, one of {profile['cores']} cores each",),
                   dispatch_s=profile.get("dispatch_us", 0.0) / 1e6)


def _one_thread_ranks(name: str, profile: dict, model_compute: Callable[[str, bool], Compute],
                      fits: dict, **options) -> Machine:
    """Processes of one pinned thread each (their one-thread work adds up over the cores),
    each collective at the profile's `fits`."""
    return Machine(name, lambda key, _: model_compute(key, True), fitted_collectives(fits),
                   slots=profile["cores"], memory_bytes=None,
                   notes=(f"ranks run one thread each on {profile['cores']} cores",), **options)


def mpi_ranks(profile: dict, model_compute: Callable[[str, bool], Compute]) -> Machine:
    """This machine's MPI ranks, the profile's mpi4jax collectives; a waiting rank polls."""
    return _one_thread_ranks("MPI ranks (one thread each)", profile, model_compute, profile["mpi"],
                             busy_wait=True)


def distributed_ranks(profile: dict, model_compute: Callable[[str, bool], Compute]) -> Machine:
    """Processes joined by jax.distributed, one single-threaded device each (the scaling
    study's ranks), each collective at what the profile measured across such processes
    (XLA:CPU over gloo)."""
    fits = profile.get("distributed") or {}
    if not fits:
        raise KeyError(f"no jax.distributed collectives in this profile ({profile.get('distributed_note', 'older profile')})")
    return _one_thread_ranks("jax.distributed processes (one thread each)", profile, model_compute, fits,
                             dispatch_s=profile.get("dispatch_us", 0.0) / 1e6)


def cluster(model_compute: Callable[[str, bool], Compute], link: Link, memory_bytes: float | None,
            name: str) -> Machine:
    """Dedicated devices joined by `link`: every device computes at once."""
    return Machine(name, model_compute, lambda c: link_seconds(link, c), slots=1 << 30,
                   memory_bytes=memory_bytes, notes=(f"link {link.name}: {link.source}",))


SUMS_BYTES = 3 * F32   # the metric sums every data-parallel step all-reduces


@dataclass(frozen=True)
class Problem:
    """What a strategy's cost is asked for: the model's measured `Compute`, the mesh axes, the
    global batch and the options that change the step (micro-batches, schedule, sync period,
    formulation). Each strategy turns it into a `Work` (`Strategy.cost`), `predict` into time."""

    compute: Compute
    axes: dict = field(default_factory=dict)   # {"data": D, "tensor": T, "stage": S}; ranks as data/stage
    batch: int = 128
    microbatches: int = 4
    schedule: str = "gpipe"
    sync_every: int = 1
    model: dict = field(default_factory=dict)  # the model config (tensor's collective bytes)
    implementation: str = "spmd"  # pipelines: one program ("spmd") or one per stage ("mpmd")
    collective_form: str = "native"  # tensor's CNN split: XLA's gathers or "permute" (comm_forms)
    cut_inside: bool = False  # pipelines: the CNN's conv2 parted between stages (`inner_cut`)
    virtual_stages: int = 0   # pipelines: stages per device (0: the schedule's own)

    def size(self, axis: str) -> int:
        return int(self.axes.get(axis, 1))

    @property
    def devices(self) -> int:
        return self.size("data") * self.size("tensor") * self.size("stage")

