"""The pipeline family: `pipeline`, `gems`, `layer-split`, `hybrid` and `mpi-pipeline`.

A model's layers cut into stages (planning), a schedule (per-stage lists of actions), and
runtimes that execute any schedule."""
