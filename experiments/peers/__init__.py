"""PyTorch beside jaxpar: the `peers` study and the PyTorch code it runs (torch is optional:
only the modules named torch_* import it, and only where a PyTorch point runs).

  study.py           the study: configurations, screening, interleaved rounds, peers.json
  jaxpar_side.py     what a jaxpar point of the study trains
  model_parallel.py  the model-parallel section (PyTorch's pipelining and DTensor beside jaxpar's)
  rows.py            rows and the results file from the rounds' records
  tables.py, figures.py   its tables (the docs' and OUT/summary.md) and peers.png
  torch_point.py     a PyTorch point as data (imports neither torch nor JAX)
  torch_launch.py    a PyTorch point run in its own process, resumed like a jaxpar point
  torch_models.py    the PyTorch twins of jaxpar's models
  torch_bench.py     a PyTorch point's process: eager, torch.compile, DDP
  torch_parallel.py  a PyTorch point's process: pipelining, tensor parallelism
"""
