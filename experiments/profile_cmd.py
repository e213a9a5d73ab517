"""`python -m experiments profile`: measure this machine once for the cost model and save it.

    python -m experiments profile --out figures/data/cost          # a few minutes
    python -m experiments profile --quick --out /tmp/profile        # seconds: the MLP only

Writes OUT/profile.json (a RunResult of kind "profile": `jaxpar.profiling`'s measurements,
with the machine in `env`). Simulates COLLECTIVE_DEVICES' largest count of CPU devices, so run
it as its own process (JAX fixes the device count when it starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.options import option
from jaxpar import mesh as meshlib
from jaxpar import results
from jaxpar.errors import ConfigError

PROFILE_FILE = "profile.json"


@dataclass(frozen=True)
class ProfileOptions:
    out: str = option("results/profile", "folder for profile.json")
    quick: bool = option(False, "the MLP only, two batch sizes, two message sizes (seconds; for tests)")
    mpi: bool = option(True, "also time mpi4jax's collectives under mpiexec (when installed)")


def run(args: ProfileOptions) -> Path:
    from jaxpar import profiling  # imports JAX: after the device count is set

    try:
        meshlib.simulate_cpu_devices(max(profiling.COLLECTIVE_DEVICES))
    except meshlib.MeshError as e:
        raise ConfigError(f"{e} (run `python -m experiments profile` as its own process)") from None
    out = results.ensure_writable(args.out)
    metrics = profiling.profile(quick=args.quick, mpi=args.mpi)
    result = results.RunResult(kind="profile", config={"quick": args.quick, "mpi": args.mpi},
                               env=results.environment(), metrics=metrics)
    path = results.write_atomic(out / PROFILE_FILE, result.to_json())
    print(f"wrote {path}" + (f" (no MPI collectives: {metrics['mpi_note']})" if not metrics["mpi"] else ""))
    return path
