"""Results as versioned JSON: `RunResult` (schema_version, config, env, metrics) <-> file.

Every number in README, docs and figures comes from one of these files, and `env` records the
machine behind it, the revision the run started from and the data it read (docs/design.md,
"Results and provenance"). Files are written atomically: a reader sees the old file or the
new one, never half of one.

    results.capture_provenance(config.data)   # first thing in a run
    results.save(RunResult(kind="train", config=..., env=results.environment(), metrics=...), out)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpar.runtime import gloo_poller, host_memory
from jaxpar import mesh
from jaxpar.results import portable, provenance, ran
from jaxpar.runtime.distributed import mpi_rank
from jaxpar.errors import ResultsError

# Read where a run starts from (revision, dirty diff, data source): see jaxpar/results/provenance.py.
capture_provenance = provenance.capture

SCHEMA_VERSION = 1
RESULT_FILE = "result.json"


@dataclass
class RunResult:
    kind: str                      # "train", "bench", or a study name
    config: dict[str, Any]
    env: dict[str, Any]
    metrics: dict[str, Any]
    strategy: dict[str, Any] = field(default_factory=dict)  # Strategy.describe()
    history: list[dict[str, Any]] = field(default_factory=list)  # per-evaluation records
    status: str = "completed"      # or "diverged": the run stopped at a non-finite loss
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        """The result as JSON, every path in it (options, data files, messages) relative to
        its named root (jaxpar.results.portable): a result names no folder of the machine."""
        return json.dumps(portable.value(dataclasses.asdict(self)), indent=2, sort_keys=False,
                          default=_jsonable)

    @classmethod
    def from_json(cls, text: str) -> "RunResult":
        d = json.loads(text)
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ResultsError(
                f"results schema_version {d.get('schema_version')} is not {SCHEMA_VERSION}; "
                "re-run the experiment that wrote it")
        return cls(**d)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy / jax scalars
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def ensure_writable(directory: str | os.PathLike) -> Path:
    """Create `directory` and prove a file can be written there, before any work is done."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        raise ResultsError(
            f"cannot write results to {str(path)!r} ({e.strerror or e}); pass --out with a "
            "folder you can write to") from e
    return path


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` via a temporary file in the same folder and a rename.

    A `.json` result whose `env.git_diff_file` names the run's diff (its tree was dirty when
    it started) gets that diff beside it as `git-diff-<hash>.patch`."""
    path = Path(path)
    ensure_writable(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file owner-only; results are for sharing: the umask's usual mode.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if path.suffix == ".json":
        provenance.write_diff_beside(path, text)
    return path


def write_summary(path: str | os.PathLike, text: str) -> Path:
    """A study's summary (markdown written beside its results) atomically, its paths relative
    to their roots as the results' are (jaxpar.results.portable)."""
    return write_atomic(path, portable.text(text))


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def save(result: RunResult, out_dir: str | os.PathLike) -> Path:
    """Write `out_dir/result.json` atomically; returns its path."""
    return write_atomic(Path(out_dir) / RESULT_FILE, result.to_json() + "\n")


def load(path: str | os.PathLike) -> RunResult:
    """Read a result file (or `DIR/result.json`)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULT_FILE
    try:
        return RunResult.from_json(path.read_text())
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ResultsError(f"cannot read results {str(path)!r}: {e}") from e


def _mpi_ranks() -> int:
    """Processes in the launch (mpiexec/srun), whether or not JAX joined them."""
    return mpi_rank()[1]


def environment(config=None, strategy=None) -> dict[str, Any]:
    """The machine and software behind a result (device kind and count, processes, cores, the
    GPU), the revision its run started from, the data it read (`capture_provenance`) and what
    ran (`ran`: the layer forms of `config`'s model, oneDNN, XLA's threads, the formulation
    `strategy` ran; a study's own process passes neither)."""
    # imports JAX: only when a result's environment is read
    import flax
    import jax
    import optax

    devices = jax.devices()
    affinity = mesh.cores_available()
    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "python": sys.version.split()[0],
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "mpi_ranks": _mpi_ranks(),
        "cpu_cores": os.cpu_count(),
        "cores_available": affinity,
        "threads": threads_setting(),
        "threads_per_process": ran.xla_threads(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "gloo_poller": gloo_poller.state(),  # None: one process (no gloo)
        "malloc": host_memory.state(),
        "host": platform.node(),
        "platform": platform.platform(),
        "gpu": ran.gpu(),  # None: no GPU backend
        **provenance.environment_fields(),
        "ran": ran.record(config, strategy),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def threads_setting() -> str:
    """How many threads XLA's CPU backend may use, as far as the environment says."""
    if mesh.single_threaded():
        return f"1 per device ({mesh.SINGLE_THREAD_FLAG.lstrip('-')})"
    return f"default (up to {os.cpu_count()} cores shared by all simulated devices)"
