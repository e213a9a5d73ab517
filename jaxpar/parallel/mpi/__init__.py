"""MPI ranks joined by mpi4jax collectives inside `jit`: `mpi-allreduce` (Horovod-style) and
`mpi-param-server`, their shared plumbing (`common`) and what they cost (`cost`). The pipeline
over MPI ranks, `mpi-pipeline`, lives with the pipeline family."""
