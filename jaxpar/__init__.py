"""jaxpar: train image classifiers with many kinds of parallelism and measure what each buys.

The library: `train.fit` (the loop), `bench.benchmark`, `parallel.STRATEGIES`; the command
line is `python -m experiments` (see README.md).
"""

from jaxpar.mesh import eigen_cpu_convolutions

eigen_cpu_convolutions()  # before any JAX backend starts: XLA reads XLA_FLAGS once
