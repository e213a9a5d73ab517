"""Gloo's network thread made to give way: the fix for jax.distributed's ~4 ms collectives on CPU.

Across processes XLA:CPU runs its collectives over gloo, whose TCP transport has one thread per
process polling its sockets (`epoll_wait(fd, events, 64, 10 ms)` in a loop, and spinning while
a collective is in flight). Where that thread shares a core with the thread that runs the
program (a rank pinned to one core, `--single-thread`, or any busy machine), the program's
thread, woken when the data arrives, waits for the poller's time slice to end: one scheduler
tick. Measured on this 2-core machine (2 single-threaded ranks, 200 calls): a psum of 4 KB or
0.5 MB took 4.0 ms (this kernel's 250 Hz tick), the poller burning 64% of its core; with the
poller under SCHED_IDLE 0.21 ms. A SCHED_IDLE thread still runs whenever its core has nothing
else to do, and is preempted at once when another thread wakes. (Nice 19 gave 2.3 ms;
unpinning the poller alone, 1.0 ms, with both ranks' pollers then contending for the other
rank's core.)

    distributed.initialize("mpi")   # calls `give_way()` once the CPU backend is up

Lowering a thread's own policy needs no privilege. Linux only; found by its system call
(read from /proc/self/task/*/syscall, x86_64 and aarch64 numbers); where none is found, nothing
changes and `state()` says so in every result's environment.
"""

from __future__ import annotations

import os
import platform
import time

# (epoll_wait and epoll_pwait system call numbers) per machine; gloo's loop polls 64 events
# with a 10 ms timeout (as its thread shows between two collectives: jaxlib 0.10's gloo).
_EPOLL_CALLS = {"x86_64": {"232", "281"}, "aarch64": {"22"}}
_SIGNATURE = ["0x40", "0xa"]  # (maxevents, timeout ms) as /proc prints them
_LOOK_S = 0.5  # how long to look for the thread after the backend starts (it starts idle)

_found: list[int] = []
_looked = False


def pollers() -> list[int]:
    """Thread ids of this process that sit in gloo's loop (`epoll_wait(_, _, 64, 10)`)."""
    calls = _EPOLL_CALLS.get(platform.machine(), set())
    found = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                call = f.read().split()
        except OSError:
            continue  # the thread ended, or no such file
        if call and call[0] in calls and call[3:5] == _SIGNATURE:
            found.append(int(tid))
    return found


def give_way() -> list[int]:
    """Put gloo's polling thread(s) under SCHED_IDLE; returns their thread ids (none found:
    []). Call once the CPU backend of a multi-process run exists."""
    global _looked
    if not hasattr(os, "sched_setscheduler"):
        return []
    _looked = True
    deadline = time.monotonic() + _LOOK_S
    while True:
        found = pollers()
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # between two polls, or busy for a moment
    for tid in found:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            _found.append(tid)
        except OSError:
            pass
    return given_way()


def given_way() -> list[int]:
    """The thread ids `give_way` put under SCHED_IDLE in this process."""
    return list(_found)


def state() -> str | None:
    """For a result's environment: what `give_way` did in this process (None: not asked)."""
    if not _looked:
        return None
    if not _found:
        return "not found (unchanged)"
    return f"SCHED_IDLE ({len(_found)} thread{'' if len(_found) == 1 else 's'})"
