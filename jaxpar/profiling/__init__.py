"""Measuring: compiled programs' FLOPs, memory and collective bytes, and timing (`measure`,
what every benchmark and result reports); this machine profiled once for the cost model
(`machine`), with one process of its MPI and jax.distributed collective profiles each
(`mpi_rank`, `dist_rank`, started under mpiexec)."""
