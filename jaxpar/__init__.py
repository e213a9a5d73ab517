"""jaxpar: train image classifiers with many kinds of parallelism and measure what each buys.

The library (`jaxpar.api`, docs/library.md): `fit` trains any Flax NNX classifier on your
arrays (`Dataset.from_arrays`) under any strategy and mesh, `benchmark` times its step,
`register_model` names a model for them and for `--model`. Below them: `train.fit` (the
loop), `bench.benchmark`, `parallel.STRATEGIES`. The command line is `python -m experiments`
(see README.md).
"""

from jaxpar.runtime import host_memory
from jaxpar.mesh import cpu_backend_expected, eigen_cpu_convolutions

eigen_cpu_convolutions()  # before any JAX backend starts: XLA reads XLA_FLAGS once
if cpu_backend_expected():
    host_memory.keep_freed_memory()  # before JAX's threads first allocate

API = ("Dataset", "Trained", "benchmark", "fit", "register_model")


def __getattr__(name: str):
    """`jaxpar.fit` and the rest of `API`, imported on first use: `import jaxpar` (which every
    submodule's import runs first) stays light and sets XLA's flags before anything else."""
    if name in API:
        from jaxpar import api  # deferred for import time only; jaxpar.api imports no `jaxpar` name

        return getattr(api, name)
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")


__all__ = list(API)
