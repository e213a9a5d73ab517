"""Network study: what the link between hosts does to each multi-process strategy.

Two emulated hosts (`experiments/infra/cluster.py`: network namespaces joined through a bridge by
veth links, each rate-limited with tc at both ends), one single-threaded rank per host, for
each link bandwidth: every multi-process strategy on the CNN and the MLP, strong scaling at
global batch 128, timed by `bench`; and per model a reference that needs no network: `single`
as one single-threaded rank on one host.

    python -m experiments network --out figures/data/network        # full: tens of minutes, root
    python -m experiments network --quick --out /tmp/network         # tiny MLP, ~1 minute

Each point also reads host 0's `eth0` counters around the timed steps (bench's `wire`
option: read after the warm-up steps and after the last timed step, so compilation, the
connections' set-up and the warm-up are outside); with 2 hosts that link carries all of
the job's traffic, sent one way and received the other. The study writes
OUT/<bandwidth>/<model>-<strategy>/result.json per point (each recording the link: bandwidth,
rate, hosts, in config["point"]["labels"]), OUT/one-host/<model>-single/result.json, and
OUT/network.json (rows, crossovers: rows.py) and OUT/summary.md (tables.py),
atomically. Bandwidth is emulated, latency is not (this kernel has no netem).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments import options
from experiments.infra import cluster
from experiments.options import BenchOptions, option
from experiments.points import points
from experiments.points.mpi import check_ranks, places_model
from experiments.points.points import Point, PointError
from experiments.studies.network.rows import analyse
from experiments.studies.network.tables import network_summary
from experiments.studies.scaling.speedup import REFERENCE
from experiments.studies.study import Study, at_least, distinct
from jaxpar import results
from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import UserError
from jaxpar.parallel import STRATEGIES

# Every strategy that runs its ranks across hosts at 2 processes: mpi4jax's, and the
# jax.distributed ones with one device per process (tensor-auto, hybrid, dp-pmap and gems
# left out: tensor-auto is tensor by XLA's partitioner, hybrid needs 4 devices, dp-pmap is
# dp-auto's older form, gems runs in one process).
STRATEGY_NAMES = ("mpi-allreduce", "mpi-param-server", "mpi-pipeline", "dp-auto", "dp-shard-map",
                  "fsdp", "local-sgd", "tensor", "pipeline", "layer-split")
BANDWIDTHS = ("100mbit", "1gbit", "10gbit", "unlimited")
INTERFACE = "eth0"  # each emulated host's link (cluster.py)


@dataclass(frozen=True)
class NetworkConfig:
    out: str = options.out("network")
    models: tuple[str, ...] = option(("cnn", "mlp"), "models, one figure panel each", choices="model")
    width: int | None = options.train_option("width")
    depth: int | None = options.train_option("depth")
    strategies: tuple[str, ...] = option(STRATEGY_NAMES, "multi-process strategies to measure "
                                         "(each on the --models it places)", choices="strategy")
    bandwidths: tuple[str, ...] = option(BANDWIDTHS, "link rates, e.g. 100mbit,1gbit,10gbit,"
                                         "unlimited (unlimited: the compute/communication split's "
                                         "compute)")
    hosts: int = option(2, "emulated hosts, one single-threaded rank each (the wire counters are "
                           "host 0's link: all the traffic with 2 hosts)")
    batch_size: int = options.train_option("batch_size")
    microbatches: int = options.train_option("microbatches", 8)
    sync_every: int = options.train_option("sync_every")
    iters: int = options.iters()
    warmup: int = options.warmup()
    timeout: int = options.timeout()


# A tiny MLP, 2 strategies (gradients and activations sent), a slow and an unlimited link.
QUICK = dataclasses.replace(NetworkConfig(), models=("mlp",), width=64, depth=2,
                            strategies=("mpi-allreduce", "mpi-pipeline"),
                            bandwidths=("100mbit", "unlimited"), microbatches=4, iters=10, warmup=2,
                            timeout=120)


def network_points(config: NetworkConfig) -> tuple[list[Point], dict[str, list[Point]]]:
    """(the one-host reference points, {bandwidth: its points}); checks every option first."""
    at_least(config, 1, "batch_size", "iters", "microbatches", "sync_every")
    at_least(config, 0, "warmup")
    at_least(config, 2, "hosts")
    distinct(config, "models", "strategies", "bandwidths")
    for bandwidth in config.bandwidths:
        cluster.rate_bits(bandwidth)  # ConfigError naming --bandwidth
    check_ranks(config.strategies, (config.hosts,), config.models)
    refs = [link_point(config, model, REFERENCE, None) for model in config.models]
    across = {bw: [link_point(config, model, strategy, bw) for model in config.models
                   for strategy in config.strategies if places_model(strategy, model)]
              for bw in config.bandwidths}
    for p in refs + [p for found in across.values() for p in found]:
        points.check_point(p)
    return refs, across


def link_point(config: NetworkConfig, model: str, strategy: str, bandwidth: str | None) -> Point:
    """One bench point: `strategy` as one rank per host over links of `bandwidth`, or (None)
    the reference on one host, one rank; either way single-threaded ranks of one device."""
    opts = STRATEGIES[strategy].options
    train = with_options(TrainConfig(), dataset="synthetic", model=model, width=config.width,
                         depth=config.depth, strategy=strategy, devices=1,
                         batch_size=config.batch_size, single_thread=True,
                         **({"microbatches": config.microbatches} if "microbatches" in opts else {}),
                         **({"sync_every": config.sync_every} if "sync_every" in opts else {}))
    # --no-matmul-peak: strategies are compared with one another; a peak costs seconds a point.
    if bandwidth is None:
        bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False)
        return Point(f"one-host/{model}-{strategy}", train, bench, 1, {"hosts": 1, "bandwidth": None})
    bench = BenchOptions(iters=config.iters, warmup=config.warmup, matmul_peak=False, wire=INTERFACE)
    link = {"hosts": config.hosts, "ranks_per_host": 1, "bandwidth": bandwidth,
            "rate_bits_per_s": cluster.rate_bits(bandwidth),
            "link": "veth pair per host through one bridge, tc tbf at both ends, no added latency"}
    return Point(f"{bandwidth}/{model}-{strategy}", train, bench, config.hosts, link)


def across_hosts(point: Point, folder: Path) -> list[str]:
    """A point's ranks launched one per emulated host (the cluster that is up)."""
    return cluster.mpiexec_on_hosts(point.ranks, [sys.executable, "-m", "experiments.points.run", str(folder)])


def run(config: NetworkConfig) -> list[Path] | None:
    """The reference points, then each bandwidth's points on a cluster made for it (removed
    however the block ends); then OUT/network.json and OUT/summary.md. None when a point
    failed (the others are still written)."""
    refs, across = network_points(config)
    pending = {bw: [p for p in found if points.stored(Path(config.out) / p.folder, p) is None]
               for bw, found in across.items()}
    if any(pending.values()) and (why := cluster.missing()) is not None:
        raise UserError(f"the network study runs its points on an emulated cluster: {why}")
    out = results.ensure_writable(config.out)
    outcomes = list(zip(refs, points.run_points(refs, out, config.timeout, keep_going=True)))
    for bw, found in across.items():
        if not pending[bw]:  # every point already measured: no cluster needed
            outcomes += zip(found, points.run_points(found, out, config.timeout))
            continue
        print(f"{config.hosts} emulated hosts at {bw}", flush=True)
        with cluster.running(config.hosts, bw):
            outcomes += zip(found, points.run_points(found, out, config.timeout, keep_going=True,
                                              launch=across_hosts))
    done = [(p, r) for p, r in outcomes if not isinstance(r, PointError)]
    failed = {p.folder: str(r)[-2000:] for p, r in outcomes if isinstance(r, PointError)}
    metrics = analyse(done)
    study = results.RunResult(kind="network", config=dataclasses.asdict(config),
                              env=done[0][1].env if done else results.environment(),
                              metrics={**metrics, "failed": failed})
    paths = [results.write_atomic(out / "network.json", study.to_json() + "\n"),
             results.write_summary(out / "summary.md", network_summary(dataclasses.asdict(study)))]
    print(paths[1].read_text())
    return None if failed else paths


STUDY = Study("network", "every multi-process strategy on 2 emulated hosts (root: network "
                         "namespaces, tc-limited links) at each link bandwidth: step time, images/s, "
                         "bytes on the wire per step beside theory, compute and exposed "
                         "communication, against one host; writes OUT/network.json and OUT/summary.md",
              NetworkConfig, QUICK, run)
