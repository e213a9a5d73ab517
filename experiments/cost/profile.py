"""`python -m experiments profile`: measure this machine once for the cost model and save it.

    python -m experiments profile --out figures/data/cost          # a few minutes
    python -m experiments profile --quick --out /tmp/profile        # seconds: the MLP only
    python -m experiments profile --links 100mbit,1gbit,10gbit,unlimited --out figures/data/cost

Writes OUT/profile.json (a RunResult of kind "profile": `jaxpar.profiling.machine`'s measurements,
with the machine in `env`). Simulates COLLECTIVE_DEVICES' largest count of CPU devices, so run
it as its own process (JAX fixes the device count when it starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.infra import cluster
from experiments.options import option
from jaxpar import mesh as meshlib
from jaxpar import results
from jaxpar.errors import ConfigError, UserError
from jaxpar.profiling import machine as profiling

PROFILE_FILE = "profile.json"


@dataclass(frozen=True)
class ProfileOptions:
    out: str = option("results/profile", "folder for profile.json")
    quick: bool = option(False, "the MLP only, two batch sizes, two message sizes (seconds; for tests)")
    mpi: bool = option(True, "also time mpi4jax's and jax.distributed's collectives under mpiexec "
                             "(when installed)")
    links: str = option("", "also time both across 2 emulated hosts at these link bandwidths, "
                            "e.g. 100mbit,1gbit,10gbit,unlimited (root: experiments/infra/cluster.py)")


LINK_SIZES = (4 << 10, 256 << 10, 2 << 20)   # a 2 MB message takes 0.17 s at 100 Mbit/s
LINK_ITERS = 5
LINK_RANKS = (2,)                           # one per host, as the network study runs them


def link_profile(bandwidths, sizes=LINK_SIZES, iters: int = LINK_ITERS) -> dict:
    """{bandwidth: {"mpi": fits, "distributed": fits}}: mpi4jax's and jax.distributed's
    collectives between 2 emulated hosts, one single-threaded rank each, on a cluster made for
    each bandwidth (removed however the block ends): what the network study's points pay."""
    found = {}
    for bw in bandwidths:
        print(f"collectives across 2 emulated hosts at {bw}", flush=True)
        with cluster.running(2, bw):
            entry = {}
            for kind, module in (("mpi", "jaxpar.profiling.mpi_rank"), ("distributed", "jaxpar.profiling.dist_rank")):
                fits, why = profiling.mpi_profile(LINK_RANKS, sizes, iters, module=module, launch=cluster.mpiexec_on_hosts)
                if why:
                    raise UserError(f"--links {bw}: the {kind} collectives across hosts failed: {why}")
                entry[kind] = fits
        found[bw] = entry
    return found


def run(args: ProfileOptions) -> Path:
    try:
        meshlib.simulate_cpu_devices(max(profiling.COLLECTIVE_DEVICES))
    except meshlib.MeshError as e:
        raise ConfigError(f"{e} (run `python -m experiments profile` as its own process)") from None
    bandwidths = [b.strip() for b in args.links.split(",") if b.strip()]
    if bandwidths:  # refused before minutes of profiling, not after
        for bw in bandwidths:
            try:
                cluster.rate_bits(bw)
            except ConfigError:
                raise ConfigError(f"--links {args.links!r}: {bw!r} is not a bandwidth; give rates like "
                                  "100mbit,1gbit,10gbit,unlimited") from None
        if (why := cluster.missing()) is not None:
            raise UserError(f"--links: {why}")
    out = results.ensure_writable(args.out)
    metrics = profiling.profile(quick=args.quick, mpi=args.mpi)
    metrics["links"] = link_profile(bandwidths) if bandwidths else {}
    result = results.RunResult(kind="profile", config={"quick": args.quick, "mpi": args.mpi, "links": args.links},
                               env=results.environment(), metrics=metrics)
    path = results.write_atomic(out / PROFILE_FILE, result.to_json())
    print(f"wrote {path}" + (f" (no MPI collectives: {metrics['mpi_note']})" if not metrics["mpi"] else ""))
    return path
