"""Optional dependencies: each imported only by the commands that need it, with one message.

`import jaxpar`, `python -m experiments bench`, `train` on synthetic data and `machine` need
jax, jaxlib, flax, optax, numpy and rich only, so they run from a source checkout
(`pip install --no-deps -e .`) on a machine where JAX is already installed. Everything else
is imported through `require` where it is used:

    tfds = require("tensorflow_datasets", "real data sets (--dataset fashion_mnist, mnist)")

and, when absent, fails with "optional dependency X needed for Y: pip install Z" (a
`MissingDependency`, a UserError: the CLI prints it alone and exits 2).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from jaxpar.errors import UserError

# mpi4jax is built from source against the MPI that mpi4py uses (the Makefile's `mpi` extra);
# on a GPU machine against the CUDA toolkit too (docs/machines.md).
MPI4JAX_INSTALL = ("`make test` does it, or `pip install mpi4py mpich` then `MPI4JAX_BUILD_MPICC="
                   "$VENV/bin/mpicc CUDA_PATH=<an empty folder; the CUDA toolkit on a GPU machine> "
                   "pip install --no-cache-dir --no-build-isolation mpi4jax`")

# The import name -> how to install it. The pyproject.toml extras hold the same packages; this
# says which one a message names.
INSTALL_COMMANDS = {
    "tensorflow_datasets": "pip install tensorflow-datasets array_record importlib_resources",
    "array_record.python.array_record_module": "pip install array_record",
    "orbax.checkpoint": "pip install orbax-checkpoint",
    "matplotlib": "pip install matplotlib",
    "gradio": "pip install -e '.[demo]'",
    "mpi4py": "pip install mpi4py mpich",
    "mpi4jax": MPI4JAX_INSTALL,
    "torch": ("pip install '.[peer]' (torch==2.13.0, the CPU wheel; `make peer`), or the torch "
              "build for your GPU"),
}


class MissingDependency(UserError):
    """An optional package a command needs is not installed; the message says how to install it."""


def install_message(module: str, needed_for: str) -> str:
    """'optional dependency X needed for Y: pip install Z' (X: the top-level package)."""
    return (f"optional dependency {module.split('.')[0]} needed for {needed_for}: "
            f"{INSTALL_COMMANDS[module]}")


def available(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (torch takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or half-installed
        return False


def require(module: str, needed_for: str) -> ModuleType:
    """`module`, imported; MissingDependency naming the install when it is absent.

    Args:
      module: an import name listed in INSTALL_COMMANDS (e.g. "orbax.checkpoint").
      needed_for: what the caller was asked to do, for the message ("checkpoints (--checkpoint-dir)").
    """
    if module not in INSTALL_COMMANDS:
        raise KeyError(f"{module} is not one of jaxpar's optional dependencies ({', '.join(INSTALL_COMMANDS)})")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # Only the module itself (or a parent) missing is "not installed"; an import error
        # inside an installed package is a broken install and keeps its traceback.
        if e.name is not None and not f"{module}.".startswith(f"{e.name}."):
            raise
        raise MissingDependency(install_message(module, needed_for)) from None
