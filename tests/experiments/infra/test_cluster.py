"""The emulated cluster (`experiments/infra/cluster.py`): hosts as network namespaces joined by
rate-limited links, multi-process strategies across them equal `single`, a killed rank on
another host ends the job, and nothing is left behind however a run ends. Faults across the
hosts, one strategy of each family at once: a 3 s flap survived, a cut link or a lost host
ending every job within --collective-timeout (a cut one with exit 75, naming the silent host),
and the job a cut ended going on with the same command to an uninterrupted run's loss.

Needs root and network namespaces (skipped with the reason otherwise). The cross-host
launch runs every multi-process strategy's equivalence test of tests/mpi and the bytes on the
wire; JAXPAR_CLUSTER_TESTS=all runs all of tests/mpi across the hosts (minutes).

    python -m pytest -q tests/experiments/infra/test_cluster.py
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import equivalence as eq
from experiments.infra import cluster
from experiments.studies.faults import study as faults
from jaxpar.config import TrainConfig, with_options
from jaxpar.models import param_count
from jaxpar.train import build_model, fit
from jaxpar.errors import ConfigError, PeerLost, UserError
from cross_host import CROSS_HOST, needs_mpi, needs_root
from test_mpi_launch import RANK_PYTEST, ROOT, _rank_pid, mpi_env, wait_for_steps


@pytest.fixture(scope="module", autouse=True)
def _one_machine_wide_file_at_a_time(machine_wide):
    """One emulated cluster / SLURM at a time (`conftest.machine_wide`)."""


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", "cluster", *args], cwd=ROOT,
                          env=mpi_env(), capture_output=True, text=True, timeout=timeout)


def test_without_root_the_error_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="needs root.*CAP_NET_ADMIN"):
        cluster.up(2, "1gbit")


def test_bandwidths():
    assert cluster.rate_bits("100mbit") == 10**8 and cluster.rate_bits("10gbit") == 10**10
    assert cluster.rate_bits("unlimited") is None
    for bad in ("1gb", "fast", "0mbit"):
        with pytest.raises(ConfigError, match="--bandwidth"):
            cluster.rate_bits(bad)


# Before the tests that share one cluster (the `hosts` fixture): this one removes it.
@needs_root
def test_down_removes_everything_after_its_owner_was_killed():
    """`cluster up`, a process left running on host 1 by a launcher killed outright: `down`
    kills it and removes every namespace, link and file."""
    cluster.up(2, "100mbit")
    owner = subprocess.Popen([sys.executable, "-m", "experiments", "cluster", "exec", "--host",
                              "1", "--", "sleep", "600"], cwd=ROOT, env=mpi_env())
    deadline = time.monotonic() + 30
    while not any(left.startswith("process") for left in cluster.leftovers()):
        assert time.monotonic() < deadline, "the process on host 1 never started"
        time.sleep(0.1)
    owner.kill()  # SIGKILL: no clean-up of its own; `sleep` stays behind on host 1
    owner.wait()
    assert any(left.startswith("process") for left in cluster.leftovers())
    down = _cli("down")
    assert down.returncode == 0 and "process" in down.stdout, down.stdout + down.stderr
    assert cluster.leftovers() == []
    assert cluster.down() == []


@needs_root
@needs_mpi
def test_a_profile_times_the_collectives_across_emulated_hosts():
    """`profile --links`: mpi4jax's and jax.distributed's collectives between 2 emulated hosts
    (its own cluster, removed after), and a slow link's time at least its bytes at the rate."""
    from experiments.cost import profile as profile_cmd

    (found,) = profile_cmd.link_profile(("100mbit",), (4096, 1 << 20), 2).values()
    assert cluster.leftovers() == []
    assert set(found["mpi"]) == {"mpi_allreduce", "mpi_gather", "mpi_bcast", "mpi_sendrecv"}
    assert set(found["distributed"]) == {"all-reduce", "all-gather", "reduce-scatter", "collective-permute"}
    wire_s = (1 << 20) * 8 / 100e6  # 1 MiB at 100 Mbit/s: 84 ms (a reduce-scatter sends half)
    for kind in found.values():
        for op, fits in kind.items():
            (small, large), = ([p for p in fit["points"]] for fit in fits.values())
            # At least 60% of the wire time, where memory would take ~1 ms: the token bucket
            # (cluster.burst_bytes) and tbf's accounting let a little more through than the
            # nominal rate (a gather measured 68 ms for its 84 ms of bytes).
            share = 0.5 if op == "reduce-scatter" else 1.0
            assert large[1] > 0.6 * share * wire_s > small[1], (op, fits)


@pytest.fixture(scope="module")
def hosts():
    """2 emulated hosts joined at 1 Gbit/s, removed after this file's tests."""
    with cluster.running(2, "1gbit") as made:
        yield made
    assert cluster.leftovers() == []


def _counter(host: str, what: str) -> int:
    return int(subprocess.run(["ip", "netns", "exec", host, "cat",
                               f"/sys/class/net/eth0/statistics/{what}"],
                              capture_output=True, text=True, check=True).stdout)


SEND = """import socket, sys, time
if sys.argv[1] == "recv":
    with socket.create_server(("", 5201)) as server:
        conn, _ = server.accept()
        got = 0
        while chunk := conn.recv(1 << 16):
            got += len(chunk)
        conn.close()
        print(got)
else:
    for _ in range(100):
        try:
            conn = socket.create_connection(("jaxpar-h1", 5201)); break
        except OSError:
            time.sleep(0.05)
    start = time.monotonic()
    conn.sendall(bytes(int(sys.argv[2])))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # returns when the receiver, having read everything, closes
    print(time.monotonic() - start)
"""


@needs_root
def test_a_link_carries_its_rate(hosts):
    """12.5 MB from host 0 to host 1 over a 1 Gbit/s link take about 0.1 s, and cross host 0's
    interface (its transmit counter)."""
    size, rate = 12_500_000, cluster.rate_bits(hosts["bandwidth"])
    sent_before = _counter(hosts["hosts"][0], "tx_bytes")
    receiver = subprocess.Popen(cluster.on_host(1, [sys.executable, "-c", SEND, "recv"]),
                                stdout=subprocess.PIPE, text=True)
    sender = subprocess.run(cluster.on_host(0, [sys.executable, "-c", SEND, "send", str(size)]),
                            capture_output=True, text=True, timeout=60)
    assert int(receiver.communicate(timeout=60)[0]) == size, sender.stderr
    seconds = float(sender.stdout)
    assert 0.9 * size * 8 / rate < seconds < 10 * size * 8 / rate  # at the rate, headers aside
    assert _counter(hosts["hosts"][0], "tx_bytes") - sent_before >= size


@needs_root
@needs_mpi
def test_strategies_across_two_hosts_equal_single(hosts):
    """tests/mpi's equivalence tests, one rank per host: every check against `single` passes
    with the messages crossing the emulated link (host 1's counters), and each MPI strategy's
    bytes on the wire per step equal its theory (tests/mpi/test_wire_bytes.py)."""
    which = ["tests/mpi"] if os.environ.get("JAXPAR_CLUSTER_TESTS") == "all" else CROSS_HOST
    received_before = _counter(hosts["hosts"][1], "rx_bytes")
    proc = subprocess.run(
        ["timeout", "-s", "KILL", "500",
         *cluster.mpiexec_on_hosts(2, [*RANK_PYTEST, *which])],
        cwd=ROOT, env=mpi_env(JAXPAR_EXPECT_RANKS="2", JAXPAR_EXPECT_HOSTS="2"),
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " failed" not in proc.stdout and " passed" in proc.stdout
    # At least one model's worth of gradient or parameter bytes reaches host 1 in each of the 5
    # steps of mpi-allreduce, mpi-param-server, dp-auto and fsdp (2-rank all-reduces, all-gathers).
    model_bytes = 4 * param_count(build_model(eq.config()))
    assert _counter(hosts["hosts"][1], "rx_bytes") - received_before > 4 * 5 * model_bytes


TINY_RUN = ["--model", "mlp", "--width", "16", "--depth", "1", "--dataset", "synthetic",
            "--synthetic-size", "2000", "--val-size", "0", "--batch-size", "32", "--no-progress"]


@needs_root
@needs_mpi
def test_a_killed_rank_on_another_host_ends_the_job(hosts, tmp_path):
    """SIGKILL rank 1, on host 1, of a 2-host run mid-training: the job ends with an error
    within the single-host bound (tests/test_mpi_launch.py). mpi-allreduce on a small MLP: the
    cheapest to start; what ends the job is the launcher, whatever the strategy."""
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        cluster.mpiexec_on_hosts(2, [sys.executable, "-m", "mpi4py", "-m", "experiments", "train",
                            "--strategy", "mpi-allreduce", *TINY_RUN, "--steps", "100000",
                            "--events", str(events), "--out", str(tmp_path / "out")]),
        cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        wait_for_steps(proc, events, 3)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        assert os.stat(f"/proc/{victim}/ns/net").st_ino == hosts["netns_inodes"][1]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed < 30
        assert proc.returncode != 0, err[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


# --- faults: a flap, a cut link, a lost host (jaxpar/runtime/watchdog.py, docs/faults.md) ---
BOUND_S = 12  # --collective-timeout in these tests: above a 3 s flap and TCP's retransmissions


@pytest.fixture
def families(hosts, tmp_path):
    """A job of every family at once (experiments.faults.FAMILIES: one strategy each, the
    mechanism being shared within a family), training; the link up again and every job ended
    after."""
    launches = [faults.Launch(s, tmp_path / s, BOUND_S, "--steps", "100000", env=mpi_env())
                for s in faults.FAMILIES]
    try:
        faults.until(launches, lambda l: l.steps() >= 10, "every family training", 420)
        yield launches
    finally:
        faults.link(hosts["hosts"][1], "up")
        for launch in launches:
            launch.kill()


@needs_root
@needs_mpi
def test_a_flap_is_survived_and_a_cut_link_ends_every_family_within_the_bound(hosts, families):
    """Host 1's link down for 3 s and up again (a flap: no reset sent): every family trains
    on. Then down for good (a cut link): every job ends within the bound (plus a beacon
    interval and the report), exit 75, rank 0 naming rank 1 on host 1 as silent."""
    host = hosts["hosts"][1]
    flapped = faults.flap(families, host, 3)
    assert all(f["survived"] for f in flapped.values()), flapped
    for strategy, row in faults.cut(families, host, BOUND_S).items():
        assert row["exit"] == PeerLost.exit_code and BOUND_S - 1 < row["end_s"] < BOUND_S + 6, (strategy, row)
        assert row["names_host"] and re.match(
            rf"jaxpar: {strategy} stopped at step \d+: no step finished for \d+ s "
            rf"\(--collective-timeout {BOUND_S};.*rank 1 on {host} has been silent for", row["report"]), row


@needs_root
@needs_mpi
def test_a_lost_host_ends_every_family_within_the_bound(hosts, families):
    """Every process in host 1's namespace killed at once (kill -9: ranks, MPI's proxy): every
    job ends within the bound, none left running on either host."""
    for strategy, row in faults.lose(families, hosts["netns_inodes"][1], BOUND_S).items():
        assert row["exit"] != 0 and row["end_s"] < BOUND_S + 6, (strategy, row)
    deadline = time.monotonic() + 10
    while cluster._processes(set(hosts["netns_inodes"])):
        assert time.monotonic() < deadline, "processes left in the hosts after the jobs ended"
        time.sleep(0.2)


@needs_root
@needs_mpi
def test_a_job_a_cut_link_ended_goes_on_with_the_same_command(hosts, tmp_path):
    """`mpi-allreduce` with checkpoints and --resume auto, its link cut after the first
    checkpoint: it ends (75) saying to run the same command again; run again once the link is
    back, it continues from the checkpoint and ends with the loss of an uninterrupted run."""
    run = ["--steps", "300", "--optimizer", "sgd", "--lr-schedule", "constant",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "50", "--resume", "auto"]
    first = faults.Launch("mpi-allreduce", tmp_path / "run", BOUND_S, *run, env=mpi_env())
    try:
        faults.until([first], lambda l: any(p.name.isdigit() for p in (tmp_path / "ckpt").glob("*")),
                     "a first checkpoint", 300)
        (row,) = faults.cut([first], hosts["hosts"][1], BOUND_S).values()
    finally:
        faults.link(hosts["hosts"][1], "up")
        first.kill()
    assert row["exit"] == PeerLost.exit_code
    assert "To go on, run the same command again: --resume auto continues" in row["report"]
    again = faults.Launch("mpi-allreduce", tmp_path / "run", BOUND_S, *run, env=mpi_env())  # the same command
    try:
        faults.until([again], lambda l: not l.alive(), "the same command to its end", 300)
    finally:
        again.kill()
    assert again.proc.returncode == 0, again.stderr()[-2000:]
    result = json.loads((tmp_path / "run/out/result.json").read_text())
    assert result["metrics"]["resumed_from_step"] >= 50 and result["metrics"]["steps"] == 300
    options = dict(model="mlp", width=16, depth=1, dataset="synthetic", synthetic_size=2000,
                   val_size=0, batch_size=32, steps=300, optimizer="sgd", lr_schedule="constant",
                   progress=False)
    uninterrupted = fit(with_options(TrainConfig(), **options)).result.metrics["final_loss"]
    assert result["metrics"]["final_loss"] == pytest.approx(uninterrupted, rel=1e-5)
