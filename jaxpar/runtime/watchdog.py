"""A bound on every wait for another process: a thread that ends a stuck multi-process job and
says who went silent.

A collective, a message or a checkpoint's gather waits for the other processes; across hosts,
a cut link (a switch port, a cable: no reset sent) or a lost host leaves it waiting forever
(mpi4jax inside an MPI call in C) or ends it with an abort stack (jax.distributed's heartbeat).
Here every process of a multi-process run runs one thread that

  - sends its rank and last finished step to every other process a few times a second and
    notes when it heard each (`beacons`), so it can always name who went silent;
  - while the loop is armed (from the first training step to the last evaluation), checks
    that some step, evaluation batch or checkpoint finished within --collective-timeout
    (the clock held while another process, still answering, has not reached its own loop:
    ranks that compile different programs, a pipeline's stages, are ready at different times);
    before its own loop (compiling, restoring a checkpoint), that no other process has been
    silent for longer than the bound: a host lost while the job starts ends it too;
    past it, it prints the strategy, the step waited on, who went silent and since when (or
    who is behind), how to go on, and ends the whole job with exit status 75 (MPI_Abort from
    this thread under mpiexec: the main thread may be stuck in C; else its own exit, after
    which srun -K or the others' watchdogs end the rest);
  - acts for a held XLA abort (`abort_guard`: the coordination service lost a process or the
    coordinator) the same way, naming the process XLA's status names.

It learns the step's time from the first steps, refuses a bound a healthy step could reach
(under 10x the median step: ConfigError), and prints a notice at half the bound (a stall a
user can see in the log while it lasts). jax.distributed's heartbeat and the pipelines'
socket timeouts get `distributed.backstop_s` (three times the bound plus 10 s), so that the
watchdog's report comes first and a flap shorter than the bound passes everywhere. docs/faults.md.

    distributed.set_collective_timeout(seconds)    # before jax.distributed starts (its heartbeat)
    watchdog.start(rank, size, exchange, seconds, log)   # every process, once joined (a collective)
    with watchdog.armed("dp-auto", resume_hint):   # the loop
        watchdog.progress(step, seconds)           # where the loop waited for a step
    watchdog.stop()
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from jaxpar.errors import ConfigError, PeerLost
from jaxpar.runtime import abort_guard, distributed
from jaxpar.runtime.beacons import PREPARING, Beacons

WARMUP_STEPS = 2          # first steps left out of the expected step time (first-call costs)
EXPECTED_FROM = 10        # steps after the warm-up whose median is the expected step time
MIN_RATIO = 10            # the bound must be at least this many expected steps
REPORT_GRACE_S = 5.0      # a rank other than 0 waits this long for rank 0 to report and end the job

_dog: Watchdog | None = None


class Watchdog:
    """The thread (one per process) and what it knows: the loop's last progress, the peers."""

    def __init__(self, peers: Beacons, timeout: float, log: Path | None, notice_fd: int | None,
                 what: str = ""):
        self.peers, self.timeout, self.log, self.notice_fd = peers, timeout, log, notice_fd
        self.interval = min(1.0, max(0.1, timeout / 20))   # beacons: several per bound
        self.step, self.last = 0, time.monotonic()
        self.durations: list[tuple[float, int]] = []  # (seconds, steps) between the loop's waits
        self.expected: float | None = None
        self.what, self.resume = what, (lambda: "")  # the strategy (`armed` sets it too)
        self.is_armed = self.in_loop = self.noticed = self.stopping = False
        self.firing = threading.Lock()  # one report per process (the thread or the loop)
        self.started, self.cpu_s = time.monotonic(), 0.0  # the thread's own CPU time: its cost
        self.thread = threading.Thread(target=self._run, name="jaxpar-watchdog", daemon=True)

    # --- the loop's side --------------------------------------------------------------------
    def progress(self, step: int | None, seconds: float | None, steps: int = 1) -> None:
        self.last = time.monotonic()
        if step is not None:
            self.step = step
        if seconds is not None and self.expected is None:
            self.durations.append((seconds, steps))
            if len(self.durations) == WARMUP_STEPS + EXPECTED_FROM:
                measured = self.durations[WARMUP_STEPS:]
                self.expected = statistics.median(s / n for s, n in measured)
                # Between two waits the loop may run several steps (every 10 on an accelerator).
                check_bound(self.timeout, statistics.median(s for s, _ in measured))

    # --- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            try:
                self.peers.send(self.step if self.in_loop else PREPARING)
                if self.peers.receive(self.interval, also=self.notice_fd):
                    self._fire("abort")
                self._check(time.monotonic())
                self.cpu_s = time.thread_time()
            except Exception as e:  # never let the thread die silently: the bound would go
                print(f"jaxpar watchdog: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                time.sleep(self.interval)

    @property
    def fired(self) -> bool:
        return self.firing.locked()

    def _check(self, now: float) -> None:
        if self.fired:
            return
        if not self.is_armed:
            if not self.in_loop and self.peers.silent(now, self.timeout):
                self._fire("start")  # silent past the bound before the loop: gone, not slow
            return
        if self.peers.preparing(now, self._quiet_s()):
            self.last = now  # not a wait for a message: a peer still compiling (silence counts)
        waited = now - self.last
        if waited > self.timeout:
            self._fire("timeout")
        elif waited > self.timeout / 2 and not self.noticed:
            self.noticed = True
            if self.peers.rank == 0:
                print(f"jaxpar: {self.what} step {self.step + 1} has waited {waited:.0f} s "
                      f"({self._usual()}); {self._who(now)}; the job ends at "
                      f"{self.timeout:g} s (--collective-timeout) unless it moves on",
                      file=sys.stderr, flush=True)
        elif self.noticed and waited < self.interval:
            self.noticed = False
            if self.peers.rank == 0:
                print(f"jaxpar: {self.what} moved on at step {self.step}", file=sys.stderr, flush=True)

    def _fire(self, why: str, error: BaseException | None = None) -> None:
        """Report and end the job (never returns). `why`: timeout | start | abort | error."""
        if not self.firing.acquire(blocking=False):
            while True:  # the other caller is ending the job
                time.sleep(1)
        if self.notice_fd is not None:
            abort_guard.set_fallback("")  # this report replaces the held abort's sentence
        now = time.monotonic()
        silent = self.peers.silent(now, self._quiet_s())
        if why in ("timeout", "start") and self.peers.rank != 0 and 0 not in dict(silent):
            time.sleep(REPORT_GRACE_S)  # rank 0 is alive: it reports and ends the job
            now = time.monotonic()
        print(self.report(why, now, error), file=sys.stderr, flush=True)
        distributed.abort_job(PeerLost.exit_code, start_mpi=False)

    def _quiet_s(self) -> float:
        """Silence that means gone: several beacons missed (at most half the bound)."""
        return min(max(5 * self.interval, 2.0), self.timeout / 2)

    # --- the report -------------------------------------------------------------------------
    def report(self, why: str, now: float, error: BaseException | None = None) -> str:
        """What happened, who went silent, what the job does and how to go on."""
        me = self.peers.where(self.peers.rank)
        where = "" if self.peers.rank == 0 else f" ({me})"
        if why == "start":
            return (f"jaxpar{where}: {self.what or 'the run'} stopped before its first step: "
                    f"{self._who(now)}, past --collective-timeout {self.timeout:g} while the "
                    f"processes prepared (compiling, restoring). Ending the job (exit status "
                    f"{PeerLost.exit_code}).")
        if why == "abort":
            lost = abort_guard.lost_in(abort_guard.tail(self.log)) if self.log else None
            cause = f"jax.distributed ended {me}: {self._xla(lost, now)}"
        elif why == "error":
            first = str(error).strip().splitlines()[0][:300] if error is not None else ""
            cause = f"a wait for another process failed ({type(error).__name__}: {first}); {self._who(now)}"
        else:
            cause = (f"no step finished for {now - self.last:.0f} s (--collective-timeout "
                     f"{self.timeout:g}; {self._usual()}); {self._who(now)}")
        log = f" XLA's messages: {self.log}." if self.log and why != "timeout" else ""
        return (f"jaxpar{where}: {self.what or 'the run'} stopped at step {self.step + 1}: {cause}."
                f"{log} Ending the job (exit status {PeerLost.exit_code}). {self.resume()}")

    def _usual(self) -> str:
        return ("steps took " + _seconds(self.expected) if self.expected is not None
                else "before its step time was measured")

    def _who(self, now: float) -> str:
        """The silent processes, else those behind, else that every one is waiting."""
        silent = self.peers.silent(now, self._quiet_s())
        if silent:
            return "; ".join(f"{self.peers.where(r)} has been silent for {s:.0f} s (last heard "
                             f"{_at(self.peers.steps[r])})" for r, s in silent)
        behind = [r for r, s in self.peers.steps.items() if s < self.step]
        if behind:
            return (f"every process answers, but {', '.join(map(self.peers.where, behind))} "
                    f"is behind ({_at(min(self.peers.steps[r] for r in behind))})")
        return ("every process answers and waits in the same step: the messages between them "
                "stopped (a link that drops them, a broken connection)")

    def _xla(self, lost: abort_guard.Lost | None, now: float) -> str:
        if lost is None:
            return f"XLA aborted it; {self._who(now)}"
        if lost.ranks:
            return (f"{', '.join(map(self.peers.where, lost.ranks))} stopped sending its "
                    f"heartbeats to the coordinator")
        if lost.coordinator:
            return (f"it lost the coordinator, {self.peers.where(0)} ({lost.status[:200]}); "
                    f"{self._who(now)}")
        return f"{lost.status[:300]}; {self._who(now)}"


def _at(step: int) -> str:
    return "before its loop" if step == PREPARING else f"at step {step}"


def _seconds(s: float) -> str:
    return f"{1000 * s:.0f} ms" if s < 1 else f"{s:.1f} s"


def check_bound(timeout: float, expected: float) -> None:
    """ConfigError when a healthy wait could reach the bound (under MIN_RATIO of the loop's
    usual time between two waits: a step, or the steps it runs between waits)."""
    if timeout < MIN_RATIO * expected:
        need = MIN_RATIO * expected
        raise ConfigError(f"--collective-timeout {timeout:g} is under {MIN_RATIO}x this run's step "
                          f"({_seconds(expected)} between the loop's waits, the median of its first "
                          f"ones): a step slowed by a busy moment would end the job; give at least "
                          f"{need:.0f} (or --no-watchdog)")


def start(rank: int, size: int, exchange: Callable[[str], list[str]], timeout: float,
          log: Path | None = None, what: str = "") -> Watchdog:
    """Start this process's watchdog (a collective: every process calls it at the same point).

    Args:
      exchange: every process's text by rank (an MPI allgather, jax.distributed's store).
      log: send what C and C++ write to standard error there (`abort_guard.divert_stderr`),
        hold XLA's aborts and read their status from it; None leaves both alone. `stop`
        undoes both.
      what: the strategy, for a report before the loop names it (`armed` sets it too).
    """
    global _dog
    stop()
    peers = Beacons.join(rank, size, exchange)
    notice = None
    if log is not None:
        abort_guard.divert_stderr(log)
        fallback = (f"jaxpar ({peers.where(rank)}): jax.distributed ended this process; XLA's "
                    f"message: {log}. Ending the job (exit status {PeerLost.exit_code}).\n")
        notice = abort_guard.guard_aborts(sys.stderr.fileno(), fallback, PeerLost.exit_code)
    _dog = Watchdog(peers, timeout, log, notice, what)
    _dog.thread.start()
    return _dog


def stop() -> None:
    """End the thread (at the end of a run; idempotent)."""
    global _dog
    dog, _dog = _dog, None
    if dog is not None:
        dog.stopping = True
        dog.thread.join(timeout=2 * dog.interval + 1)
        dog.peers.close()
        if dog.notice_fd is not None:
            abort_guard.unguard(dog.notice_fd)
        if dog.log is not None:
            abort_guard.restore_stderr()


def usage() -> dict[str, float] | None:
    """What this process's watchdog thread has cost: its CPU seconds, over how many seconds
    of running (None without a watchdog)."""
    if _dog is None:
        return None
    return {"thread_cpu_s": _dog.cpu_s, "running_s": time.monotonic() - _dog.started}


def progress(step: int | None = None, seconds: float | None = None, steps: int = 1) -> None:
    """The loop made progress: `steps` steps up to `step` finished (waited for, `seconds` since
    the last wait), or an evaluation batch or checkpoint did (no arguments). Nothing without
    a watchdog."""
    if _dog is not None:
        _dog.progress(step, seconds, steps)


# Errors of a wait whose peer went away (connections closed or reset, transports that time
# out): reported like a timeout, naming who went silent, rather than as a crash.
TRANSPORT_ERRORS = ("Connection closed", "Connection reset", "Broken pipe", "jaxpar p2p",
                    "jaxpar recv", "Gloo", "gloo", "UNAVAILABLE", "DEADLINE_EXCEEDED", "timed out",
                    "Timed out", "Socket", "socket")


@contextmanager
def armed(what: str, resume: Callable[[], str] = lambda: ""):
    """Bound every wait inside: `what` (the strategy) and `resume` (how to go on) are for the
    report. An error of a wait for another process inside is reported the same way."""
    dog = _dog
    if dog is None:
        yield
        return
    dog.what, dog.resume = what, resume
    dog.last, dog.is_armed, dog.in_loop = time.monotonic(), True, True
    try:
        yield
    except (OSError, RuntimeError) as e:  # jax's JaxRuntimeError is a RuntimeError
        if any(word in str(e) for word in TRANSPORT_ERRORS):
            dog.is_armed = False
            time.sleep(dog._quiet_s() + dog.interval)  # a dead peer's beacons go quiet first
            dog._fire("error", e)
        raise
    finally:
        dog.is_armed = False
