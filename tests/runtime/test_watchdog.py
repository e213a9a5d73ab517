"""The watchdog of multi-process runs (jaxpar/runtime/watchdog.py, beacons.py, abort_guard.py)
in one process: a bad bound refused naming the fix, beacons that tell who went silent, the
report, and a stuck wait, a wait that failed and a held XLA abort each ending the process with
status 75 and a sentence naming the silent process (in a child process: it ends itself).
Across processes and emulated hosts: tests/runtime/test_watchdog_across_ranks.py, tests/experiments/infra/test_cluster.py, tests/experiments/infra/test_slurm.py.

    python -m pytest -q tests/runtime/test_watchdog.py
"""

import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxpar.config import TrainConfig, with_options
from jaxpar.errors import ConfigError, PeerLost
from jaxpar.runtime import abort_guard, native, watchdog
from jaxpar.runtime.beacons import PREPARING, Beacons
from jaxpar.validate import validate_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf])
def test_a_bound_that_is_not_a_positive_number_of_seconds_is_refused_naming_the_fix(bad):
    with pytest.raises(ConfigError, match=r"--collective-timeout .* is not valid: it must be a "
                                          r"number of seconds > 0, e.g. 30 \(--no-watchdog"):
        validate_options(with_options(TrainConfig(), collective_timeout=bad))


def test_a_bound_a_healthy_step_could_reach_is_refused_naming_what_to_give():
    watchdog.check_bound(30, 2.9)  # 10x the step fits
    with pytest.raises(ConfigError, match=r"--collective-timeout 30 is under 10x this run's step "
                                          r"\(3.5 s.*give at least 35 \(or --no-watchdog\)"):
        watchdog.check_bound(30, 3.5)


def test_the_backstops_come_after_the_bound_and_its_report():
    from jaxpar.runtime import distributed

    distributed.set_collective_timeout(10)
    try:
        # past the bound and its report by more than XLA's heartbeat interval (half of it)
        assert distributed.backstop_s() == 40 and distributed.backstop_s() / 2 > 10 + watchdog.REPORT_GRACE_S
    finally:
        distributed.set_collective_timeout(TrainConfig().parallel.collective_timeout)


def beacon_pair(hosts=("host-a", "host-b")) -> list[Beacons]:
    """Two processes' beacons on the loopback, as `Beacons.join` would make them."""
    socks = []
    for _ in range(2):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        socks.append(s)
    addresses = [s.getsockname() for s in socks]
    now = time.monotonic()
    return [Beacons(r, list(hosts), addresses, b"jobnonce", socks[r], heard={1 - r: now},
                    steps={1 - r: 0}) for r in range(2)]


def test_joining_swaps_hosts_and_addresses_by_rank():
    """`join` through an exchange (here two threads meeting at a barrier): every process's
    host and beacon address, by rank, and rank 0's nonce."""
    barrier, texts, joined = threading.Barrier(2), {}, {}

    def exchange_for(rank):
        calls = iter(range(10))

        def exchange(text):
            slot = texts.setdefault(next(calls), {})
            slot[rank] = text
            barrier.wait()
            return [slot[0], slot[1]]
        return exchange

    threads = [threading.Thread(target=lambda r=r: joined.__setitem__(r, Beacons.join(r, 2, exchange_for(r))))
               for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    zero, one = joined[0], joined[1]
    assert zero.hosts == one.hosts == [socket.gethostname()] * 2
    assert zero.addresses == one.addresses and zero.nonce == one.nonce
    zero.send(7)
    one.receive(0.5)
    assert one.steps == {0: 7}
    [b.close() for b in joined.values()]


def test_beacons_tell_who_went_silent_and_ignore_another_jobs():
    zero, one = beacon_pair()
    one.send(41)
    zero.receive(0.3)
    assert zero.steps[1] == 41 and zero.silent(time.monotonic(), 1.0) == []
    stranger = Beacons(1, zero.hosts, zero.addresses, b"otherjob", one.sock, heard={0: 0}, steps={0: 0})
    stranger.send(99)  # another job's datagram on this port: not heard
    zero.receive(0.3)
    assert zero.steps[1] == 41
    later = time.monotonic() + 3
    [(rank, quiet)] = zero.silent(later, 1.0)
    assert rank == 1 and quiet > 2.5 and zero.where(1) == "rank 1 on host-b"


def test_the_report_names_the_silent_process_the_step_and_how_to_go_on():
    zero, one = beacon_pair()
    dog = watchdog.Watchdog(zero, 10, None, None)
    dog.what, dog.resume = "mpi-allreduce", lambda: "To go on, run the same command again."
    dog.step, dog.expected, dog.last = 120, 0.025, time.monotonic() - 11
    zero.steps[1], zero.heard[1] = 118, time.monotonic() - 12
    text = dog.report("timeout", time.monotonic())
    assert text.startswith("jaxpar: mpi-allreduce stopped at step 121: no step finished for 11 s "
                           "(--collective-timeout 10; steps took 25 ms); rank 1 on host-b has been "
                           "silent for 12 s (last heard at step 118)")
    assert text.endswith(f"Ending the job (exit status {PeerLost.exit_code}). To go on, run the same command again.")
    zero.heard[1] = time.monotonic()  # alive, but behind
    assert "every process answers, but rank 1 on host-b is behind (at step 118)" in dog.report("timeout", time.monotonic())
    zero.steps[1] = 120
    assert "every process answers and waits in the same step" in dog.report("timeout", time.monotonic())


def test_a_peer_still_preparing_holds_the_clock_until_it_falls_silent(monkeypatch):
    """A rank still compiling its own programs (a pipeline's last stage takes longest) is not a
    stalled message: while it answers and says it has not reached its loop, the bound waits;
    silent, it counts. A peer in its loop holds nothing."""
    zero, one = beacon_pair()
    dog = watchdog.Watchdog(zero, 2.0, None, None)
    fired = []
    monkeypatch.setattr(dog, "_fire", fired.append)
    assert dog.in_loop is False  # what the thread sends before `armed`: PREPARING
    dog.is_armed, dog.in_loop = True, True
    now = time.monotonic()
    zero.steps[1], zero.heard[1], dog.last = PREPARING, now, now - 5
    dog._check(now)
    assert fired == [] and dog.last == now
    zero.heard[1] = now - 3  # silent past the quiet time: the wait counts from the last hold
    dog._check(now + 1)
    assert fired == [] and dog.last == now
    dog._check(now + 2.5)
    assert fired == ["timeout"]
    assert re.search(r"rank 1 on host-b has been silent for \d+ s \(last heard before its loop\)",
                     dog.report("timeout", now + 2.5))
    fired.clear()
    now = time.monotonic()
    zero.steps[1], zero.heard[1], dog.last = 0, now, now - 5  # in its loop, answering: no hold
    dog._check(now)
    assert fired == ["timeout"] and dog.last == now - 5
    zero.steps[1], dog.step = PREPARING, 3
    assert "rank 1 on host-b is behind (before its loop)" in dog.report("timeout", time.monotonic())


def test_xla_statuses_name_the_lost_process():
    unhealthy = ("F1128 14:00:02.749709   14156 client.h:80] Terminating process because the JAX "
                 "distributed service detected fatal errors. This most likely indicates that another "
                 "task died. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped "
                 "sending heartbeats):\n1\nThe tasks have crashed. Check the task logs.\n")
    leader = ("F1128 14:14:58.247034   23068 client.h:80] Terminating process because the JAX "
              "distributed service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send "
              "RPC to coordination service. Either the leader task was preempted/died/restarted "
              "unexpectedly or this task is experiencing network issues.\n")
    assert abort_guard.lost_in("noise\n" + unhealthy).ranks == (1,)
    lost = abort_guard.lost_in(unhealthy + leader)  # the last status counts
    assert lost.ranks == () and lost.coordinator and lost.status.startswith("UNAVAILABLE: Failed to send RPC")
    assert abort_guard.lost_in("E1128 an error that ended nothing\n") is None


CHILD = """
import os, sys, time, socket
sys.path[:0] = [{tests!r}]
from runtime.test_watchdog import beacon_pair
from jaxpar.runtime import abort_guard, watchdog
case = sys.argv[1]
me, peer = beacon_pair()[::-1] if case == "abort" else beacon_pair()  # abort: rank 1 loses rank 0
log = notice = None
if case == "abort":
    log = __import__("pathlib").Path(sys.argv[2])
    abort_guard.divert_stderr(log)
    notice = abort_guard.guard_aborts(sys.stderr.fileno(), "fallback\\n", 75)
dog = watchdog.Watchdog(me, 2.0, log, notice, "dp-auto")
watchdog._dog = dog
dog.thread.start()
if case == "start":  # the peer silent while this process prepares: its loop never starts
    print("stuck", flush=True)
    time.sleep(30)
with watchdog.armed("dp-auto", lambda: "To go on, run the same command again."):
    for step in range(1, 6):  # a few healthy steps, the peer answering
        peer.send(step)
        watchdog.progress(step, 0.01)
        time.sleep(0.05)
    print("stuck", flush=True)
    if case == "timeout":
        time.sleep(30)  # a wait for the silent peer that never ends
    elif case == "error":
        raise RuntimeError("Gloo: Connection closed by peer [10.213.0.2]:4242")
    else:
        os.write(2, b"F1128 client.h:80] Terminating process because the JAX distributed service "
                    b"detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to "
                    b"coordination service. Either the leader task was preempted/died/restarted "
                    b"unexpectedly or this task is experiencing network issues.\\n")
        __import__("ctypes").CDLL(None).abort()  # as XLA's thread would: without the GIL
print("not ended", flush=True)
"""


def child(case: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run CHILD as one process of a 2-process world whose other falls silent (rank 1, host-b;
    for "abort" rank 0, host-a); returns the process and the seconds from its "stuck" line to
    its end."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(ROOT / "tests")), case, *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline() == "stuck\n", proc.communicate()
    stuck = time.monotonic()
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - stuck


def test_a_wait_past_the_bound_ends_the_process_with_75_naming_the_silent_one():
    proc, took = child("timeout")
    assert proc.returncode == PeerLost.exit_code and "not ended" not in proc.stdout
    assert 1.5 <= took < 2.0 + 3, took  # the bound (from the last step, just before "stuck"), a beacon interval, the report
    assert ("jaxpar: dp-auto stopped at step 6: no step finished for 2 s (--collective-timeout 2; "
            "before its step time was measured); rank 1 on host-b has been silent for") in proc.stderr
    assert proc.stderr.rstrip().endswith("Ending the job (exit status 75). To go on, run the same command again.")


def test_a_process_silent_past_the_bound_before_the_loop_ends_the_job_naming_it():
    """Before the loop (compiling, restoring) no wait is timed, but a process silent past the
    bound is gone, not slow: the job ends with 75 naming it."""
    proc, took = child("start")
    assert proc.returncode == PeerLost.exit_code and "not ended" not in proc.stdout
    assert 1.5 <= took < 2.0 + 3, took  # silent since the pair was made, just before "stuck"
    assert re.search(r"jaxpar: dp-auto stopped before its first step: rank 1 on host-b has been "
                     r"silent for \d+ s \(last heard at step 0\), past --collective-timeout 2 while "
                     r"the processes prepared \(compiling, restoring\)\. Ending the job \(exit status "
                     r"75\)\.", proc.stderr), proc.stderr


def test_only_before_the_loop_does_silence_alone_end_the_job(monkeypatch):
    """Quiet for less than the bound while preparing: a busy start, nothing happens; after the
    loop (its waits done) a process that ended and fell silent is not a lost one."""
    zero, one = beacon_pair()
    dog = watchdog.Watchdog(zero, 2.0, None, None)
    fired = []
    monkeypatch.setattr(dog, "_fire", fired.append)
    now = time.monotonic()
    zero.heard[1] = now - 1.5
    dog._check(now)
    assert fired == []
    zero.heard[1] = now - 2.5
    dog._check(now)
    assert fired == ["start"]
    fired.clear()
    dog.in_loop = True  # the loop ran and ended (disarmed)
    dog._check(now)
    assert fired == []


def test_a_wait_that_failed_is_reported_as_a_lost_process_not_a_crash():
    proc, took = child("error")
    assert proc.returncode == PeerLost.exit_code and took < 5
    assert ("dp-auto stopped at step 6: a wait for another process failed (RuntimeError: Gloo: "
            "Connection closed by peer [10.213.0.2]:4242); rank 1 on host-b has been silent") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_held_xla_abort_is_explained_and_its_message_kept_in_the_log(tmp_path):
    """XLA's coordination client aborting (the coordinator gone): on the terminal a sentence
    naming the coordinator, rank 0, and the log; XLA's own lines only in the log; status 75."""
    try:
        abort_guard._library()
    except native.Unavailable as e:
        pytest.skip(str(e))
    log = tmp_path / "logs" / "rank-1.log"
    proc, took = child("abort", str(log))
    assert proc.returncode == PeerLost.exit_code and took < 5, proc.stderr
    assert ("jaxpar (rank 1 on host-b): dp-auto stopped at step 6: jax.distributed ended rank 1 on "
            "host-b: it lost the coordinator, rank 0 on host-a (UNAVAILABLE: Failed to send RPC to "
            "coordination service") in proc.stderr
    assert f"XLA's messages: {log}. Ending the job (exit status 75)" in proc.stderr
    assert "Terminating process" not in proc.stderr and "Terminating process" in log.read_text()


def test_an_abort_nobody_explains_ends_with_the_prepared_sentence(tmp_path):
    """The guard alone (no watchdog to act): after its wait it writes the sentence prepared in
    advance and exits with the status given."""
    try:
        abort_guard._library()
    except native.Unavailable as e:
        pytest.skip(str(e))
    script = ("import os, sys\nfrom jaxpar.runtime import abort_guard\nabort_guard.WAIT_MS = 100\n"
              "abort_guard.guard_aborts(2, 'jaxpar: prepared sentence\\n', 75)\nos.abort()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 75 and proc.stderr == "jaxpar: prepared sentence\n"


def test_jax_distributeds_heartbeat_is_the_backstop(monkeypatch):
    """The heartbeat's timeout follows --collective-timeout (three times it plus 10 s), so the
    watchdog reports first and a flap it lets pass does not end the job."""
    import jax
    from jaxpar.runtime import distributed

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed, "_gloo_gives_way", lambda: None)
    distributed.set_collective_timeout(7)
    try:
        distributed.initialize("slurm")
    finally:
        distributed.set_collective_timeout(TrainConfig().parallel.collective_timeout)
    assert seen["heartbeat_timeout_seconds"] == 31 and seen["initialization_timeout"] == distributed.INIT_TIMEOUT_S


def test_no_watchdog_starts_none(monkeypatch):
    """--no-watchdog: no thread, no beacons, stderr left alone, in a multi-process run too."""
    from jaxpar import api
    from jaxpar.runtime import distributed

    monkeypatch.setattr(distributed, "world", lambda: (0, 2, lambda text: [text, text]))
    assert api._watch(with_options(TrainConfig(), watchdog=False), None) is None
    assert watchdog._dog is None


def test_the_thread_costs_next_to_nothing_and_says_so():
    """`usage()`: the watchdog thread's own CPU time over the seconds it ran (bench records
    it): a few beacons a second cost well under 1% of a core."""
    zero, one = beacon_pair()
    dog = watchdog.Watchdog(zero, 2.0, None, None)  # a beacon every 0.1 s: its busiest
    watchdog._dog = dog
    dog.thread.start()
    try:
        time.sleep(1.5)
        used = watchdog.usage()
    finally:
        watchdog.stop()
    assert watchdog.usage() is None
    assert 1.4 < used["running_s"] < 3 and 0 < used["thread_cpu_s"] < 0.05 * used["running_s"], used


def test_after_the_run_stderr_and_aborts_are_as_they_were(tmp_path):
    """`stop` undoes what `start` did with a log: descriptor 2 writes to the terminal again
    (not the log), and an abort is an abort (SIGABRT), not a held one."""
    try:
        abort_guard._library()
    except native.Unavailable as e:
        pytest.skip(str(e))
    log = tmp_path / "rank-0.log"
    script = (f"import os, sys\nsys.path[:0] = [{str(ROOT / 'tests')!r}]\n"
              "from runtime.test_watchdog import beacon_pair\nfrom jaxpar.runtime import watchdog\n"
              "zero, one = beacon_pair()\n"
              f"watchdog.start(0, 2, lambda text: [text, text], 5.0, __import__('pathlib').Path({str(log)!r}))\n"
              "os.write(2, b'during\\n')\nwatchdog.stop()\nos.write(2, b'after\\n')\n"
              "print('python after', file=sys.stderr, flush=True)\nos.abort()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -6, proc.stderr  # SIGABRT itself
    assert "after\npython after\n" in proc.stderr and "during" not in proc.stderr
    assert log.read_text() == "during\n"
