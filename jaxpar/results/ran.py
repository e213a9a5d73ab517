"""What ran, as this run resolved it: the forms `--conv-impl` ("auto" resolved) and batch norm
took, oneDNN's version and instruction set where its convolutions ran, XLA's CPU threads per
process, a pipeline's formulation; and the GPU's name and driver where there is one. Results
record them in `env.ran` and `env.gpu` (docs/design.md, "Results and provenance"); `report`'s
machine lines show them.

    env["ran"] = ran.record(config, strategy)    # {'conv': 'onednn', 'batch_norm': None, ...}
    env["gpu"] = ran.gpu()                       # None on a CPU backend

JAX, Flax and the models are imported when asked: importing `jaxpar.results` stays light.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

from jaxpar import mesh

DRIVER_FILE = "/proc/driver/nvidia/version"  # the NVIDIA kernel module's, where it is loaded
NVIDIA_SMI_TIMEOUT_S = 10


def record(config=None, strategy=None) -> dict[str, Any]:
    """env.ran for a run of `config` (a TrainConfig; None: a study's own process, which builds
    no model) placed by `strategy` (None: none).

    Returns:
      {'conv', 'batch_norm'} (jaxpar.models.forms; only with a config), 'onednn' ({'version',
      'isa'} where oneDNN's convolutions ran, else None), 'xla_threads' (per process) and
      'pipeline' (the formulation a pipeline strategy ran: 'spmd' or 'mpmd'; else None).
    """
    # imports JAX and the models: importing jaxpar.results stays light
    from jaxpar.models import forms, onednn

    out: dict[str, Any] = dict(forms(config.model)) if config is not None else {}
    # Resolving "auto" loads oneDNN to see that it builds: only a run whose convolutions are
    # oneDNN's reports it (a study's own process reports it when it ran any).
    out["onednn"] = onednn.used() if out.get("conv", "onednn") == "onednn" else None
    out["xla_threads"] = xla_threads()
    out["pipeline"] = getattr(strategy, "implementation", None)
    return out


def xla_threads() -> int:
    """XLA:CPU's threads in this process: its pool is sized to the cores the process may run
    on (its affinity); single-threaded (--single-thread), one per device."""
    # imports JAX: importing jaxpar.results stays light
    import jax

    return jax.local_device_count() if mesh.single_threaded() else mesh.cores_available()


def gpu() -> dict[str, str | None] | None:
    """{'name', 'driver'} of this process's first GPU; None on another backend."""
    # imports JAX: importing jaxpar.results stays light
    import jax

    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return None
    return {"name": jax.devices()[0].device_kind, "driver": driver_version()}


def driver_version() -> str | None:
    """The NVIDIA driver's version, from its kernel module or nvidia-smi; None if neither says."""
    try:
        with open(DRIVER_FILE) as f:
            found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", f.read())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = smi.stdout.split()
    return lines[0] if smi.returncode == 0 and lines else None
