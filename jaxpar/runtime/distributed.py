"""Many processes: rank threads and pinning, a job-wide abort hook, `jax.distributed` start-up.

Per-rank threads and pinning, a fault hook that aborts the whole MPI job, and
`jax.distributed` start-up from MPI or SLURM, all BEFORE JAX's backend starts.

    mpiexec -n 2 python -m mpi4py -m experiments train --strategy mpi-allreduce --single-thread
    mpiexec -n 2 python -m mpi4py -m experiments train --strategy single --distributed mpi
    srun -n 2 python -m experiments train --distributed slurm ...
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from typing import Callable

from jaxpar import mesh as meshlib
from jaxpar.config import ParallelConfig
from jaxpar.runtime import optional
from jaxpar.errors import ConfigError
from jaxpar.runtime import gloo_poller

MODES = ("auto", "mpi", "slurm", "none")  # --distributed
# How long a rank other than 0 waits for rank 0 to report the same user error (and end the
# job) before it reports the error itself: longer than rank 0 can lag behind at start-up.
ONE_ERROR_GRACE_S = 5
OUTPUT_GRACE_S = 0.5  # before an abort, for the launcher to forward what was printed
# An MPI_Abort that cannot reach the launcher (its host cut off) may never return: the process
# ends itself after this long.
ABORT_WAIT_S = 5

# Short on purpose: a missing or dead rank must end the job in tens of seconds, not JAX's
# default 300 s initialisation / 100 s heartbeat / 300 s shutdown. The heartbeat's timeout is
# the watchdog's backstop (`backstop_s`, from --collective-timeout), so that the watchdog
# (`jaxpar.runtime.watchdog`), which says who went silent, acts first.
INIT_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 10
_collective_timeout_s = ParallelConfig().collective_timeout  # this process's --collective-timeout


def set_collective_timeout(seconds: float) -> None:
    """This process's --collective-timeout, before anything waits for another process (the
    watchdog's bound; jax.distributed's heartbeat and the p2p sockets take `backstop_s`)."""
    global _collective_timeout_s
    _collective_timeout_s = float(seconds)


def collective_timeout_s() -> float:
    return _collective_timeout_s


def backstop_s() -> float:
    """The timeouts behind the watchdog (jax.distributed's heartbeat, the pipelines' sockets):
    three times the bound plus 10 s, past the watchdog's report, so that they end a job only
    where no watchdog runs (--no-watchdog, a wait outside the loop) and a flap it lets pass
    passes. XLA counts a silent process from its last heartbeat that got through, which a flap
    before the cut can put a heartbeat interval or more before it: at twice the bound plus 5 s
    the coordination service ended a job 12.2-12.6 s after its link was cut, bound 12 s, in 4
    of 10 runs of tests/experiments/infra/test_cluster.py's flap-then-cut test, before the
    watchdog could say who went silent (in none of 6 at this backstop)."""
    return 3 * _collective_timeout_s + 10

INSTALL_HINT = f"install the `mpi` extra: {optional.MPI4JAX_INSTALL}"


def import_mpi():
    """(MPI, mpi4jax) modules, or a ConfigError saying how to install them. Imported when
    asked: both are optional (the `mpi` extra), and mpi4py starts MPI when imported.

    Returns:
      (mpi4py.MPI, mpi4jax)
    """
    try:
        # MPI only for runs launched under mpiexec
        from mpi4py import MPI
        import mpi4jax
    except (ImportError, RuntimeError) as error:  # RuntimeError: mpi4jax built against another MPI
        raise ConfigError(f"the MPI strategies need mpi4py and mpi4jax ({error}); {INSTALL_HINT}") from error
    return MPI, mpi4jax


def launcher() -> str | None:
    """'mpi' when started by mpiexec/mpirun (MPICH's PMI or OpenMPI's env), 'slurm' under srun,
    else None."""
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or os.environ.get("PMI_RANK"):
        return "mpi"
    # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: srun sets both, but a batch script (one process,
    # which then runs srun or not) has SLURM_NTASKS and SLURM_PROCID of its own.
    if int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1 and os.environ.get("SLURM_PROCID"):
        return "slurm"
    return None


def mpi_rank() -> tuple[int, int]:
    """(rank, size) from the launcher's environment, without importing MPI; (0, 1) alone."""
    for rank_key, size_key in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")):
        if os.environ.get(size_key):
            return int(os.environ.get(rank_key, 0)), int(os.environ[size_key])
    return 0, 1


def is_main() -> bool:
    """True on rank 0 (or alone): the one process that prints progress and writes results."""
    return mpi_rank()[0] == 0


def single_thread(devices: int = 1) -> None:
    """One XLA:CPU thread per device, this rank pinned to as many cores: rank r of D devices
    each on cores r*D .. r*D+D-1 (modulo the cores it may use), so that D simulated devices
    or R ranks of one device each run one thread per core. Before JAX's backend starts; only
    when it will be the CPU (`mesh.cpu_backend_expected`): a GPU rank keeps its host threads."""
    if not meshlib.cpu_backend_expected():
        return
    flag = meshlib.SINGLE_THREAD_FLAG
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    try:
        cores = sorted(os.sched_getaffinity(0))
        first = mpi_rank()[0] * devices
        os.sched_setaffinity(0, {cores[(first + i) % len(cores)] for i in range(devices)})
    except (AttributeError, OSError):
        pass  # no affinity API (macOS): single-threaded, unpinned


def _mpi():
    """mpi4py's MPI module, or None without mpi4py. The first import runs MPI_Init, which
    returns once every rank has called it: import it early, not in a hurry to abort."""
    try:
        from mpi4py import MPI  # a lazy import: MPI starts only when a job needs it
    except ImportError:
        return None
    return MPI


def abort_job(code: int, start_mpi: bool = True) -> None:
    """End every rank of the MPI job now (MPI_Abort), or just this process without MPI.

    Args:
      start_mpi: import mpi4py (MPI_Init) if no one has; False (the watchdog's thread) uses
        only an MPI already started: under plain srun a job has none, and its processes end
        one by one (srun -K, or each one's own watchdog).
    """
    MPI = _mpi() if start_mpi else _running_mpi()
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI is not None:
        # The launcher forwards a rank's output on its own time: an abort straight after a
        # print lost it (the whole job's stderr empty, 2 runs in 30), so give it a moment.
        time.sleep(OUTPUT_GRACE_S)
        fallback = threading.Timer(ABORT_WAIT_S, os._exit, (code,))
        fallback.daemon = True
        fallback.start()
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _running_mpi():
    """mpi4py's MPI module when MPI is initialized in this process, else None."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() else None


_exchanges = itertools.count()


def world() -> tuple[int, int, Callable[[str], list[str]]] | None:
    """(rank, size, exchange) of this multi-process run, or None alone: jax.distributed's
    processes when it runs (texts swapped through its key-value store), else MPI's ranks (an
    allgather). `exchange(text)` is a collective: every process's text, by rank."""
    import jax  # imports JAX: only once a run is under way, after its threads and devices are set

    if jax.distributed.is_initialized():
        from jax._src import distributed as state  # the client is not public API

        client, rank, size = state.global_state.client, jax.process_index(), jax.process_count()

        def through_store(text: str) -> list[str]:
            key = f"jaxpar/exchange/{next(_exchanges)}"
            client.key_value_set(f"{key}/{rank}", text)
            return [client.blocking_key_value_get(f"{key}/{r}", INIT_TIMEOUT_S * 1000)
                    for r in range(size)]

        return (rank, size, through_store) if size > 1 else None
    if launcher() is None:
        return None
    MPI, _ = import_mpi()
    comm = MPI.COMM_WORLD
    return (comm.rank, comm.size, comm.allgather) if comm.size > 1 else None


def report_user_error(message: str, code: int) -> None:
    """Print a user error once per job, then end the job with `code`.

    Every rank validates the same options, so usually every rank fails the same way at the
    same point: rank 0 prints and ends the whole job. Another rank waits `ONE_ERROR_GRACE_S`
    first; if rank 0 has not ended the job by then, this rank failed alone, and it prints the
    message naming itself (the other ranks would otherwise wait for it forever)."""
    rank, size = mpi_rank()
    if size == 1:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return
    _mpi()  # MPI_Init on every rank now, so rank 0's abort below is not held up by it
    if rank != 0:
        time.sleep(ONE_ERROR_GRACE_S)
    where = "" if rank == 0 else f" (on rank {rank} of {size})"
    print(f"error{where}: {message}", file=sys.stderr, flush=True)
    abort_job(code)


def install_abort_hook() -> None:
    """An uncaught exception on any rank aborts the whole MPI job (naming the rank), instead
    of leaving the other ranks blocked in a collective forever."""
    if launcher() != "mpi":
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        rank, size = mpi_rank()
        previous(kind, value, tb)
        print(f"jaxpar: rank {rank} of {size} failed ({kind.__name__}: {value}); aborting the job",
              file=sys.stderr, flush=True)
        abort_job(1)

    sys.excepthook = hook


def initialize(mode: str, heartbeat_s: float | None = None) -> None:
    """Join all processes into one JAX runtime (`jax.distributed`), with short timeouts.

    Args:
      mode: 'none' (do nothing), 'auto' (MPI or SLURM when launched by one), 'mpi' or 'slurm'.
      heartbeat_s: how long a process may miss its heartbeats (the coordination service's
        and each client's timeout) before XLA ends the job; default `backstop_s()`.
    """
    if mode == "none" or (mode == "auto" and launcher() is None):
        return
    kind = launcher() if mode == "auto" else mode
    # imports JAX: after the process's threads and devices are set
    import jax

    heartbeat_s = backstop_s() if heartbeat_s is None else heartbeat_s

    timeouts = dict(initialization_timeout=INIT_TIMEOUT_S,
                    heartbeat_timeout_seconds=max(1, round(heartbeat_s)),
                    shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    if kind == "slurm":
        jax.distributed.initialize(**timeouts)  # JAX reads SLURM's environment itself
        _gloo_gives_way()
        return
    if kind != "mpi":
        raise ConfigError(f"--distributed {mode!r}: choose {', '.join(MODES)}")
    MPI, _ = import_mpi()
    comm = MPI.COMM_WORLD
    # Rank 0's address and a free port, broadcast by us: JAX's own mpi4py detection runs MPI
    # collectives before its timeout starts, so a missing rank would hang rank 0 forever.
    import socket
    names = comm.allgather(socket.gethostname())
    address = None
    if comm.rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        host = "127.0.0.1" if len(set(names)) == 1 else socket.gethostbyname(names[0])
        address = f"{host}:{port}"
    address = comm.bcast(address, root=0)
    jax.distributed.initialize(coordinator_address=address,
                               num_processes=comm.size, process_id=comm.rank,
                               local_device_ids=[0], **timeouts)
    _gloo_gives_way()


def _gloo_gives_way() -> None:
    """On CPU, start the backend (which starts gloo's transport) and put gloo's polling thread
    under SCHED_IDLE (`jaxpar.runtime.gloo_poller`: collectives 4.0 -> 0.2 ms on shared cores)."""
    if not meshlib.cpu_backend_expected():
        return
    # imports JAX: after the process's threads and devices are set
    import jax

    jax.devices()
    gloo_poller.give_way()


def setup(mode: str, single_threaded: bool, devices: int = 1) -> None:
    """Everything a rank does before JAX's backend starts: threads, fault hook, distributed.

    Args:
      devices: this process's devices (simulated CPU devices), one thread each when
        `single_threaded`.
    """
    if single_threaded:
        single_thread(devices)
    install_abort_hook()
    initialize(mode)
    if os.environ.get("JAXPAR_FAIL_RANK") == str(mpi_rank()[0]):  # fault-handling test
        raise RuntimeError("JAXPAR_FAIL_RANK: injected failure")
