"""Fault study: what a cut link, a lost host and a short flap do to each multi-process family
across 2 emulated hosts, and what the watchdog that bounds every wait costs a step.

One strategy per family, one rank per host (`experiments/infra/cluster.py`, 1 Gbit/s links), each
training a small model with --collective-timeout as configured:

  - flap: host 1's link down (`ip link set eth0 down` inside it: no reset sent) for --flap-s
    seconds and up again; survived when training goes on, and how long the steps stalled;
  - cut link: the same link down for good; the seconds from the cut to the launch's end, its
    exit status, and whether rank 0's report names host 1;
  - lost host: every process in host 1's namespace killed at once (kill -9: its ranks and
    MPI's proxy); the seconds to the launch's end and its exit status.

And the watchdog's cost: `bench` of `mpi-allreduce` on 2 single-threaded ranks of one host,
with and without it (--no-watchdog), alternated over --rounds.

    python -m experiments faults --out figures/data/faults      # root; ~15 minutes
    python -m experiments faults --quick --out /tmp/faults       # 2 families, ~3 minutes

Writes OUT/faults.json (kind "faults") and OUT/summary.md; the overhead's bench points in
OUT/overhead/. docs/faults.md shows the tables (`report`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.infra import cluster
from experiments.points import points
from experiments.studies.faults.tables import overhead_table, round_ratio, table
from experiments.options import BenchOptions, option
from experiments.points.points import Point
from experiments.studies.study import Study, at_least, distinct
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import PeerLost, UserError

CHECKOUT = Path(__file__).resolve().parents[3]  # where `python -m experiments` runs from

# One strategy per family: the mechanism that bounds its waits is shared within a family.
FAMILIES = {"mpi-allreduce": "mpi4jax all-reduce", "mpi-param-server": "mpi4jax parameter server",
            "mpi-pipeline": "mpi4jax message-passing pipeline",
            "dp-auto": "jax.distributed data parallel", "tensor": "jax.distributed tensor",
            "pipeline": "jax.distributed pipeline (p2p messages)"}
TINY = ["--model", "mlp", "--width", "16", "--depth", "1"]
STACK = ["--model", "stack-mlp", "--width", "32", "--depth", "2"]  # layers to cut, width to split
MODELS = {"mpi-pipeline": STACK, "tensor": STACK, "pipeline": STACK}
RUN = ["--dataset", "synthetic", "--synthetic-size", "2000", "--val-size", "0", "--batch-size", "32",
       "--no-progress"]
# PyTorch's defaults for the same waits (torch.distributed.init_process_group's timeout), for
# the docs' table: NCCL's watchdog 10 minutes (since PyTorch 2.2), gloo's 30 minutes.
PYTORCH = {"NCCL process group (watchdog aborts the process)": 600, "gloo process group": 1800}


@dataclass(frozen=True)
class FaultsConfig:
    out: str = options.out("faults")
    strategies: tuple[str, ...] = option(tuple(FAMILIES), "one multi-process strategy per family",
                                         choices="strategy")
    # 10 s, not the default 30: the study waits the bound out once per family and fault.
    collective_timeout: float = options.train_option("collective_timeout", 10.0)
    flap_s: float = option(3.0, "seconds host 1's link is down in the flap")
    long_flaps_s: tuple[float, ...] = option((10.0, 20.0), "longer flaps, one after another in "
                                             "one launch under train's default bound")
    long_flap_strategies: tuple[str, ...] = option(("mpi-allreduce", "dp-auto"), "the families "
                                                   "the longer flaps meet", choices="strategy")
    overhead_models: tuple[str, ...] = option(("mlp", "cnn"), "models whose mpi-allreduce step "
                                              "is timed with and without the watchdog", choices="model")
    rounds: int = option(5, "alternations of the watchdog's bench points (with, without)")
    iters: int = options.iters()
    warmup: int = options.warmup()
    timeout: int = options.timeout()


QUICK = dataclasses.replace(FaultsConfig(), strategies=("mpi-allreduce", "dp-auto"),
                            long_flaps_s=(10.0,), long_flap_strategies=("dp-auto",),
                            overhead_models=("mlp",), rounds=2, iters=20, warmup=2, timeout=300)


class Launch:
    """One 2-host launch of `train` (rank 1 on host 1) with --collective-timeout `bound`, its
    output in files under `folder` (the cluster must be up)."""

    def __init__(self, strategy: str, folder: Path, bound: float, *extra: str, env: dict | None = None):
        self.strategy, self.folder = strategy, Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.events = self.folder / "events.jsonl"
        argv = [sys.executable, "-m", "mpi4py", "-m", "experiments", "train", "--strategy", strategy,
                *MODELS.get(strategy, TINY), *RUN, "--collective-timeout", f"{bound:g}",
                "--events", str(self.events), "--out", str(self.folder / "out"), *extra]
        env = env or {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self.out, self.err = open(self.folder / "stdout", "w"), open(self.folder / "stderr", "w")
        self.proc = subprocess.Popen(cluster.mpiexec_on_hosts(2, argv), env=env, stdout=self.out,
                                     stderr=self.err, start_new_session=True, cwd=CHECKOUT)
        self.ended: float | None = None
        self._read, self._times = 0, []  # bytes of the events file read, its steps' times

    def step_times(self) -> list[float]:
        """When each logged step was logged (the events file read on from where it was left)."""
        if self.events.exists():
            with open(self.events, "rb") as f:
                f.seek(self._read)
                chunk = f.read()
            whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
            self._read += len(whole)
            self._times += [json.loads(line)["time"] for line in whole.decode().splitlines()
                            if '"event": "step"' in line]
        return self._times

    def steps(self) -> int:
        return len(self.step_times())

    def stderr(self) -> str:
        self.err.flush()
        return (self.folder / "stderr").read_text(errors="replace")

    def alive(self) -> bool:
        if self.proc.poll() is not None and self.ended is None:
            self.ended = time.monotonic()
        return self.proc.poll() is None

    def kill(self) -> None:
        """End this launch's own processes (its session), if still running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()
        self.err.close()


def until(launches: list[Launch], done, what: str, within: float) -> None:
    """Poll until done(launch) for every launch; UserError naming `what` and each one's state,
    at the deadline or as soon as a launch ended without being done (it never will be)."""
    deadline = time.monotonic() + within
    while not all(done(launch) for launch in launches):
        ended = any(not launch.alive() and not done(launch) for launch in launches)
        if ended or time.monotonic() > deadline:
            raise UserError(f"{what}: " + " | ".join(
                f"{l.strategy}: alive={l.alive()} steps={l.steps()} {l.stderr()[-800:]}" for l in launches))
        time.sleep(0.1)


def link(host: str, state: str) -> None:
    """Host `host`'s link up or down (from inside it: no reset sent, as a cable or port dies)."""
    subprocess.run(["ip", "netns", "exec", host, "ip", "link", "set", "eth0", state], check=True)


def report_line(text: str, strategy: str) -> str | None:
    """Rank 0's report in a launch's stderr ('jaxpar: STRATEGY stopped at step ...')."""
    found = re.findall(rf"^jaxpar: {re.escape(strategy)} stopped at step .*$", text, re.M)
    return found[-1] if found else None


def flap(launches: list[Launch], host: str, seconds: float, within: float = 120) -> dict[str, dict]:
    """`host`'s link down for `seconds`, then up: per launch, whether it trained on (10 steps
    logged after the link came back, `within` seconds) and its longest gap between steps."""
    down = time.time()
    link(host, "down")
    time.sleep(seconds)
    link(host, "up")
    back = time.time()
    until(launches, lambda l: not l.alive() or sum(t > back for t in l.step_times()) >= 10,
          "training after the flap", within)
    found = {}
    for launch in launches:
        times = [t for t in launch.step_times() if t >= down - 1]
        found[launch.strategy] = {"seconds": seconds, "survived": launch.alive(),
                                  "longest_step_gap_s": max((b - a for a, b in zip(times, times[1:])),
                                                            default=None)}
    return found


def ended(launches: list[Launch], since: float, within: float) -> dict[str, dict]:
    """Wait for every launch to end: per launch the seconds from `since`, its exit status and
    rank 0's report."""
    until(launches, lambda l: not l.alive(), "every launch's end", within)
    found = {}
    for launch in launches:
        line = report_line(launch.stderr(), launch.strategy) or ""
        found[launch.strategy] = {"end_s": launch.ended - since, "exit": launch.proc.returncode,
                                  "report": line, "said": launch.stderr().strip().splitlines()[-1:] or [""]}  # paths made portable by to_json
    return found


def cut(launches: list[Launch], host: str, bound: float) -> dict[str, dict]:
    """`host`'s link down for good: `ended`, and whether each report names `host` as silent."""
    link(host, "down")
    found = ended(launches, time.monotonic(), bound + 120)
    for row in found.values():
        row["names_host"] = f"on {host} has been silent" in row["report"]
    return found


def lose(launches: list[Launch], inode: int, bound: float) -> dict[str, dict]:
    """Every process in the host of network namespace `inode` killed at once: `ended`."""
    for pid in cluster._processes({inode}):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return ended(launches, time.monotonic(), bound + 120)


def family(strategy: str, folder: Path, config: FaultsConfig, host: str, inode: int) -> dict:
    """One family alone: a launch that a flap and then a cut link meet, and one whose host 1
    is lost."""
    row = {"strategy": strategy, "family": FAMILIES[strategy]}
    launch = Launch(strategy, folder / "cut", config.collective_timeout, "--steps", "100000")
    try:
        until([launch], lambda l: l.steps() >= 20, "training", config.timeout)
        row["flap"] = flap([launch], host, config.flap_s)[strategy]
        row["cut"] = cut([launch], host, config.collective_timeout)[strategy]
    finally:
        link(host, "up")
        launch.kill()
    launch = Launch(strategy, folder / "lost", config.collective_timeout, "--steps", "100000")
    try:
        until([launch], lambda l: l.steps() >= 20, "training", config.timeout)
        row["lost_host"] = lose([launch], inode, config.collective_timeout)[strategy]
    finally:
        launch.kill()
    if strategy in config.long_flap_strategies and config.long_flaps_s:
        row["long_flaps"] = long_flaps(strategy, folder / "long", config, host)
    return row


def long_flaps(strategy: str, folder: Path, config: FaultsConfig, host: str) -> dict:
    """One launch under train's default bound, the longer flaps one after another: each
    survived? and the longest step gap around it."""
    bound = TrainConfig().parallel.collective_timeout
    launch = Launch(strategy, folder, bound, "--steps", "1000000")
    try:
        until([launch], lambda l: l.steps() >= 20, "training", config.timeout)
        flaps = []
        for seconds in config.long_flaps_s:
            flaps.append(flap([launch], host, seconds, within=bound + 60)[strategy])
            if not flaps[-1]["survived"]:
                break
        return {"bound_s": bound, "flaps": flaps}
    finally:
        link(host, "up")
        launch.kill()


def overhead_points(config: FaultsConfig) -> list[Point]:
    """`bench` of mpi-allreduce, 2 single-threaded ranks on this host, with and without the
    watchdog, per model."""
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
    return [Point(f"overhead/{model}-{'watchdog' if on else 'no-watchdog'}",
                  with_options(TrainConfig(), dataset="synthetic", model=model, strategy="mpi-allreduce",
                               devices=1, single_thread=True, watchdog=on,
                               collective_timeout=config.collective_timeout),
                  bench, 2, {"watchdog": on})
            for model in config.overhead_models for on in (True, False)]


def overhead(config: FaultsConfig, out: Path) -> dict:
    """Each model's median step with and without the watchdog (alternated rounds), and the
    ratio of the medians."""
    planned = overhead_points(config)
    # Round after round, each model's two points in turn, the first of them alternating.
    rounds = [dataclasses.replace(p, folder=f"{p.folder}/r{k}") for k in range(config.rounds)
              for i in range(0, len(planned), 2) for p in planned[i:i + 2][::1 if k % 2 == 0 else -1]]
    measured = points.by_point(rounds, points.run(rounds, out, config.timeout))
    found = {}
    for model in config.overhead_models:
        with_, without = (measured[f"overhead/{model}-{w}"] for w in ("watchdog", "no-watchdog"))
        ms = {k: [r.metrics["step_time_ms_median"] for r in rs] for k, rs in
              (("with_ms", with_), ("without_ms", without))}
        # Rank 0's watchdog thread: its CPU seconds over the seconds it ran (noise-free).
        share = [r.metrics["watchdog"]["thread_cpu_s"] / r.metrics["watchdog"]["running_s"] for r in with_]
        found[model] = {**ms, "ratio": statistics.median(ms["with_ms"]) / statistics.median(ms["without_ms"]),
                        "thread_cpu_share": statistics.median(share)}
        found[model]["round_ratio"] = round_ratio(found[model])
    return found


def run(config: FaultsConfig) -> list[Path] | None:
    """The watchdog's cost (one host), then every family's faults on a 2-host cluster (made
    and removed here); OUT/faults.json and OUT/summary.md."""
    at_least(config, 1, "iters", "rounds")
    at_least(config, 0, "warmup")
    distinct(config, "strategies", "overhead_models", "long_flap_strategies")
    for s in config.strategies:
        if s not in FAMILIES:
            raise UserError(f"--strategies {s}: the fault study runs one strategy per family: "
                            f"{', '.join(FAMILIES)}")
    if (why := cluster.missing()) is not None:
        raise UserError(f"the fault study makes its faults on an emulated cluster: {why}")
    out = results.ensure_writable(config.out)
    cost = overhead(config, out)
    scratch = Path(tempfile.mkdtemp(prefix="launches-", dir=out))
    rows = []
    try:
        with cluster.running(2, "1gbit") as made:
            host, inode = made["hosts"][1], made["netns_inodes"][1]
            for strategy in config.strategies:
                print(f"{strategy}: a {config.flap_s:g} s flap, a cut link; a lost host", flush=True)
                rows.append(family(strategy, scratch / strategy, config, host, inode))
                print(f"  {json.dumps(rows[-1])[:400]}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    metrics = {"bound_s": config.collective_timeout, "families": rows, "overhead": cost,
               "pytorch_default_s": PYTORCH, "link": "2 emulated hosts, 1 Gbit/s, one rank each"}
    study = results.RunResult(kind="faults", config=dataclasses.asdict(config),
                              env=results.environment(), metrics=metrics)
    paths = [results.write_atomic(out / "faults.json", study.to_json() + "\n"),
             results.write_atomic(out / "summary.md", table(metrics) + "\n\n" + overhead_table(metrics) + "\n")]
    print(paths[1].read_text())
    good = all(r["flap"]["survived"] and all(f["survived"] for f in r.get("long_flaps", {}).get("flaps", [])) and r["cut"]["exit"] == PeerLost.exit_code and r["cut"]["names_host"]
               and r["cut"]["end_s"] < config.collective_timeout + 10 and r["lost_host"]["exit"] != 0
               for r in rows)
    return paths if good else None


STUDY = Study("faults", "a flap, a cut link and a lost host on 2 emulated hosts (root) for one "
                        "strategy per multi-process family: survived, or the seconds to the job's "
                        "end, its exit status and report; and mpi-allreduce's step with and "
                        "without the watchdog; writes OUT/faults.json and OUT/summary.md",
              FaultsConfig, QUICK, run)
