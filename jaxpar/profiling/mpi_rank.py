"""One rank of the MPI collective profile (`jaxpar.profiling.machine.mpi_profile` starts it):

    mpiexec -n 2 python -m jaxpar.profiling.mpi_rank '{"sizes": [4096, 1048576], "iters": 5}'

Times mpi4jax's allreduce, gather (to rank 0), bcast (from rank 0) and sendrecv (a ring
shift) inside jit at each operand size (the fastest of the timed calls); rank 0 prints
{op: [[bytes, seconds], ...]} as one JSON line. Every rank times the same calls, each
between two barriers: from all ranks starting to all ranks done (a barrier's few
microseconds on one host, a round trip across emulated hosts, are in the time).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp

from jaxpar.parallel.mpi.common import import_mpi


def main(spec: dict) -> None:
    MPI, mpi4jax = import_mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ops = {
        "mpi_allreduce": lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm),
        "mpi_gather": lambda x: mpi4jax.gather(x, root=0, comm=comm),
        "mpi_bcast": lambda x: mpi4jax.bcast(x, root=0, comm=comm),
        "mpi_sendrecv": lambda x: mpi4jax.sendrecv(x, x, source=(rank - 1) % size,
                                                   dest=(rank + 1) % size, comm=comm),
    }
    found: dict = {}
    for name, op in ops.items():
        fn = jax.jit(op)
        for nbytes in spec["sizes"]:
            x = jnp.ones((nbytes // 4,), jnp.float32)
            jax.block_until_ready(fn(x))
            times = []
            for _ in range(spec["iters"]):
                comm.Barrier()
                start = time.perf_counter()
                jax.block_until_ready(fn(x))
                # Until every rank has its part: a broadcast's root returns once its message is
                # in the socket's buffer (2 MB "sent" in 52 ms over a 100 Mbit/s link).
                comm.Barrier()
                times.append(time.perf_counter() - start)
            found.setdefault(name, []).append([nbytes, min(times)])  # fastest: see profiling.fastest_ms
    if rank == 0:
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
