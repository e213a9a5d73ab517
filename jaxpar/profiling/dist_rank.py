"""One process of the jax.distributed collective profile (`jaxpar.profiling.machine.mpi_profile`
starts it under mpiexec):

    mpiexec -n 2 python -m jaxpar.profiling.dist_rank '{"sizes": [4096, 1048576], "iters": 5}'

The processes join one JAX runtime (`jaxpar.runtime.distributed`, one single-threaded CPU device
each, as the scaling study's ranks run) and time the simulated devices' collectives
(`profiling.COLLECTIVE_OPS`) over one global mesh of every process's device: XLA:CPU runs
them across processes over gloo (TCP), not in shared memory: called back to back, as a
training step's are, each waited for, and read as the median of 3 x iters calls, not the
fastest, as the studies' steps are medians (before gloo's polling thread was put under
SCHED_IDLE, `jaxpar/runtime/gloo_poller.py`, the same 4 KB all-reduce took 0.3 ms or, mostly, ~4 ms). Rank 0 prints {op:
[[bytes, seconds], ...]} as one JSON line.
"""

from __future__ import annotations

import json
import sys

from jaxpar.runtime import distributed


def main(spec: dict) -> None:
    distributed.setup("mpi", single_threaded=True)  # before JAX's backend starts
    import jax  # imports JAX's backend: after the setup above

    from jaxpar.profiling import machine as profiling, measure  # import JAX too

    found = {op: fit["points"] for op, fits in
             profiling.collective_profile([jax.device_count()], spec["sizes"], 3 * spec["iters"],
                                          typical=measure.median_ms).items()
             for fit in fits.values()}
    if jax.process_index() == 0:
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
