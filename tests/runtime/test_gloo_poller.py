"""Finding gloo's polling thread (jaxpar/runtime/gloo_poller.py) by its system call, on a faked /proc.
The real thread, in a real two-process run: tests/mpi/test_jax_distributed.py."""

import os
import platform

import pytest

from jaxpar.runtime import gloo_poller

# /proc/<pid>/task/<tid>/syscall lines: number, six arguments, stack and program counters.
POLLER = "232 0x5 0x7f00 0x40 0xa 0x0 0x0 0x7ffd 0x7f01\n"        # epoll_wait(5, _, 64, 10 ms)
OTHER_EPOLL = "232 0x7 0x7f00 0x64 0xffffffff 0x0 0x0 0x7ffd 0x7f01\n"  # grpc's: 100, forever
FUTEX = "202 0x7f00 0x80 0x0 0x0 0x0 0x0 0x7ffd 0x7f01\n"


@pytest.fixture
def proc(tmp_path, monkeypatch):
    """A fake /proc/self/task with the threads given, on an x86_64 machine."""
    real_open, real_listdir = open, os.listdir

    def make(threads: dict[int, str]):
        for tid, line in threads.items():
            (tmp_path / str(tid)).mkdir()
            (tmp_path / str(tid) / "syscall").write_text(line)

    def fake(path):
        return str(path).replace("/proc/self/task", str(tmp_path))

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(os, "listdir", lambda p: real_listdir(fake(p)))
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(fake(p), *a, **k))
    return make


def test_only_the_thread_in_gloos_poll_is_found(proc):
    proc({11: FUTEX, 12: POLLER, 13: OTHER_EPOLL, 14: "running\n"})
    assert gloo_poller.pollers() == [12]


def test_no_poller_changes_nothing_and_says_so(proc, monkeypatch):
    proc({11: FUTEX, 13: OTHER_EPOLL})
    set_to = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: set_to.append(a))
    monkeypatch.setattr(gloo_poller, "_LOOK_S", 0.05)
    monkeypatch.setattr(gloo_poller, "_found", [])
    monkeypatch.setattr(gloo_poller, "_looked", False)
    assert gloo_poller.give_way() == [] and set_to == []
    assert gloo_poller.state() == "not found (unchanged)"


def test_the_poller_found_is_put_under_sched_idle(proc, monkeypatch):
    proc({11: FUTEX, 12: POLLER})
    set_to = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda tid, policy, param: set_to.append((tid, policy)))
    monkeypatch.setattr(gloo_poller, "_found", [])
    monkeypatch.setattr(gloo_poller, "_looked", False)
    assert gloo_poller.give_way() == [12] and set_to == [(12, os.SCHED_IDLE)]
    assert gloo_poller.state() == "SCHED_IDLE (1 thread)"


def test_one_process_records_nothing(monkeypatch):
    monkeypatch.setattr(gloo_poller, "_looked", False)
    assert gloo_poller.state() is None


@pytest.mark.parametrize("cpu", [True, False])
def test_only_a_cpu_backend_touches_the_poller(cpu, monkeypatch):
    """On a GPU (or any accelerator) host nothing is looked for: gloo is the CPU's transport."""
    from jaxpar.runtime import distributed
    from jaxpar import mesh

    asked = []
    monkeypatch.setattr(mesh, "cpu_backend_expected", lambda: cpu)
    monkeypatch.setattr(gloo_poller, "give_way", lambda: asked.append(True) or [])
    distributed._gloo_gives_way()
    assert asked == ([True] if cpu else [])
