"""jax.distributed's own failures said in a sentence: XLA's messages to a log file, its abort held.

When jax.distributed's coordination service misses a process's heartbeats, or a process
cannot reach the coordinator any more, XLA's client logs the status with a C++ stack and
aborts (exit status 6). In a multi-process run jaxpar instead sends what C and C++ write to
the process's standard error (XLA's, gloo's, MPI's) to a log file, keeps Python's own
`sys.stderr` (jaxpar's messages, tracebacks) on the terminal, and holds SIGABRT
(`abort_guard.cc`) until the watchdog has named the lost process from the log's last status
and its beacons, and ended the job with exit status 75.

    terminal = divert_stderr(Path("out/logs/rank-1.log"))   # C/C++ -> the log; sys.stderr stays
    notice = guard_aborts(terminal, "jaxpar: ...", 75)      # a pipe's read end, or None
    lost_in(log_text)                                       # what XLA's last status says
    unguard(notice); restore_stderr()                       # the run is over
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from jaxpar.runtime import native

SOURCE = Path(__file__).with_name("abort_guard.cc")
WAIT_MS = 10_000  # how long the held abort waits for the watchdog before it ends the process


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(native.build_library(SOURCE)))
    lib.JaxparGuardAborts.argtypes = [ctypes.c_int] * 4
    lib.JaxparAbortMessage.argtypes = [ctypes.c_char_p]
    return lib


_diverted: list[tuple[int, object]] = []  # (the terminal's descriptor, sys.stderr before)


def divert_stderr(log: Path) -> int:
    """Point file descriptor 2 (what C and C++ write) at `log`, appending, and `sys.stderr`
    at the terminal it was. Returns the terminal's descriptor."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    _diverted.append((terminal, sys.stderr))
    sys.stderr = io.TextIOWrapper(io.FileIO(terminal, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    return terminal


def restore_stderr() -> None:
    """Undo the last `divert_stderr`: descriptor 2 and `sys.stderr` as they were."""
    if not _diverted:
        return
    terminal, before = _diverted.pop()
    sys.stderr.flush()
    os.dup2(terminal, 2)
    os.close(terminal)
    sys.stderr = before


def guard_aborts(report_fd: int, fallback: str, code: int) -> int | None:
    """Hold SIGABRT: the read end of a pipe that receives a byte when an abort starts, for the
    watchdog to act on; after `WAIT_MS` the handler writes `fallback` to `report_fd` and exits
    with `code`. None where the guard cannot be built (no C++ compiler): XLA's abort then ends
    the process as before."""
    try:
        lib = _library()
    except native.Unavailable:
        return None
    read, write = os.pipe()
    lib.JaxparAbortMessage(fallback.encode())
    if lib.JaxparGuardAborts(write, report_fd, code, WAIT_MS) != 0:
        os.close(read)
        os.close(write)
        return None
    return read


def unguard(notice: int) -> None:
    """SIGABRT as before `guard_aborts` (which returned `notice`, closed here)."""
    _library().JaxparUnguardAborts()
    os.close(notice)


def set_fallback(text: str) -> None:
    """The sentence the held abort writes if the watchdog does not act ('' for none)."""
    try:
        _library().JaxparAbortMessage(text.encode())
    except native.Unavailable:
        pass


@dataclass(frozen=True)
class Lost:
    """What XLA's last fatal status in a log says went away."""

    ranks: tuple[int, ...]   # processes that stopped sending heartbeats (the coordinator's view)
    coordinator: bool        # this process lost the coordinator (rank 0's service)
    status: str              # the status's first line, as XLA wrote it


_STATUS = re.compile(r"absl::Status: (.*)")
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*\n((?:\s*(?:/job:\S*task:)?\d+\s*\n)+)")
_LEADER = re.compile(r"leader task was preempted|Failed to send RPC to coordination service|"
                     r"failed to connect to all addresses|Socket closed|Connection reset", re.I)


def lost_in(text: str) -> Lost | None:
    """The last fatal status of XLA's coordination client in `text` (a log's tail), or None."""
    at = text.rfind("Terminating process because the JAX distributed service")
    if at < 0:
        return None
    tail = text[at:]
    status = _STATUS.search(tail)
    unhealthy = _UNHEALTHY.search(tail)
    ranks = tuple(int(re.sub(r".*task:", "", r.strip())) for r in unhealthy[1].split()) if unhealthy else ()
    return Lost(ranks=ranks, coordinator=not ranks and bool(_LEADER.search(tail)),
                status=(status[1] if status else tail.splitlines()[0]).strip())


def tail(log: Path, size: int = 1 << 16) -> str:
    """The last `size` bytes of `log` as text ('' when it cannot be read)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
