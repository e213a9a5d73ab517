"""Running study points: one `train` or `bench` process per point and round, resumable.

  points.py   a point as data (`Point`), run each in its own process (`points.run_points`),
              reused when its folder holds its result, refused when it holds other settings;
              rounds of points (`in_rounds`, `run_rounds`, `median_round`)
  run.py      the process of one point (`python -m experiments.points.run FOLDER`) and the
              `train` and `bench` commands (`execute`)
  mpi.py      the launcher (this venv's mpiexec) and whether rank points can run here
"""
