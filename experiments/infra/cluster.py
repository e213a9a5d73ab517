"""An emulated cluster on one machine: hosts as network namespaces joined by rate-limited links.

Host i is the network namespace `jaxpar-h<i>` with address 10.213.0.<i+1>/24 on its `eth0`, a
veth pair into one bridge (in the root namespace, without an address: the subnet exists only
inside the hosts). Each link is rate-limited with `tc` (tbf) at both ends, so what a host
sends and what it receives each go at most at the link's rate, as through a switch. A command
runs on host i under its own hostname (a UTS namespace, `unshare --uts`), the name resolving
to the host's address in every host (`ip netns exec` mounts /etc/netns/<host>/hosts over
/etc/hosts), so MPICH and jax.distributed see different hosts on a real network stack.
Needs root. Bandwidth can be emulated here, latency cannot (this kernel has no netem).

    python -m experiments cluster up --hosts 2 --bandwidth 1gbit
    python -m experiments cluster exec --host 1 -- hostname
    python -m experiments cluster mpiexec -n 2 -- python -m mpi4py -m experiments train --strategy mpi-allreduce
    python -m experiments cluster down      # also after a run that failed or was killed
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from experiments.cli import Parser, cluster_arguments
from jaxpar.errors import ConfigError, UserError

PREFIX = "jaxpar-h"        # namespace i and its hostname: jaxpar-h<i>
LINK_PREFIX = "jxp-h"      # the root end of host i's veth (interface names: at most 15 chars)
BRIDGE = "jxp-br0"
SUBNET = "10.213.0"        # host i: 10.213.0.<i+1>/24, a private test subnet inside the hosts only
STATE = Path("/run/jaxpar-cluster")   # state.json and the launcher script; removed by `down`
ETC_NETNS = Path("/etc/netns")
MAX_HOSTS = 32
# Between hosts MPICH uses UCX, whose shared-memory transports would find the other "host" on
# this same machine: TCP over each host's eth0 only, so messages cross the emulated links.
MPI_OVER_TCP = ("-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0")
NETWORK_TOOLS = ("ip", "tc", "unshare")  # iproute2 and util-linux
# hydra's ssh launcher calls `<launcher-exec> [options] HOST COMMAND...`; ours runs COMMAND in
# host HOST's namespace under its hostname, through a shell as ssh would.
LAUNCHER = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


def host_name(i: int) -> str:
    return f"{PREFIX}{i}"


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def rate_bits(bandwidth: str) -> int | None:
    """Bits per second of a link ('100mbit', '1gbit', '10gbit'); None for 'unlimited'."""
    if bandwidth == "unlimited":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", bandwidth)
    if not match or float(match[1]) <= 0:
        raise ConfigError(f"--bandwidth {bandwidth!r}: give a rate like 100mbit, 1gbit, 10gbit, "
                          "or unlimited")
    return int(float(match[1]) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match[2]])


def missing() -> str | None:
    """What this machine lacks to make the cluster (root, a tool), or None."""
    if os.geteuid() != 0:
        return ("the emulated cluster needs root (network namespaces, veth links and tc need "
                "CAP_SYS_ADMIN and CAP_NET_ADMIN): run it as root, e.g. with sudo")
    absent = [tool for tool in NETWORK_TOOLS if shutil.which(tool) is None]
    if absent:
        return (f"the emulated cluster needs {', '.join(absent)} (Debian: apt-get install "
                "iproute2 util-linux)")
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise UserError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def burst_bytes(bits: int) -> int:
    """The token bucket's size on a link of `bits`/s: at least two 64 KiB (GSO) packets and
    4 ms at the rate (smaller, and a fast link cannot reach its rate). A full bucket lets that
    many bytes through at memory speed (the cost model prices it, experiments/cost/check.py)."""
    return max(128 * 1024, bits // 8 // 250)


def _shape(link: str, namespace: str | None, bits: int) -> None:
    """A token bucket of `bits`/s on `link`'s egress (`burst_bytes`)."""
    burst = burst_bytes(bits)
    where = ("ip", "netns", "exec", namespace) if namespace else ()
    _run(*where, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", str(bits),
         "burst", str(burst), "latency", "100ms")


def up(hosts: int, bandwidth: str) -> dict:
    """Make `hosts` emulated hosts joined at `bandwidth` (after removing any earlier cluster).

    Returns:
      the cluster's description (also written to /run/jaxpar-cluster/state.json).
    """
    if not 1 <= hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts {hosts}: give 1 to {MAX_HOSTS}")
    bits = rate_bits(bandwidth)
    if (why := missing()) is not None:
        raise UserError(why)
    down()  # leftovers of a cluster whose owner was killed
    try:
        STATE.mkdir(parents=True)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "link", "set", BRIDGE, "up")
        names = {host_name(i): address(i) for i in range(hosts)}
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in names.items())
        for i, name in enumerate(names):
            _add_host(i, name, hosts_file, bits)
        state = {"hosts": list(names), "addresses": list(names.values()), "bandwidth": bandwidth,
                 "rate_bits": bits, "bridge": BRIDGE,
                 "netns_inodes": [os.stat(f"/run/netns/{n}").st_ino for n in names]}
        (STATE / "ssh").write_text(LAUNCHER)
        (STATE / "ssh").chmod(0o755)
        (STATE / "state.json").write_text(json.dumps(state, indent=1))
        return state
    except BaseException:
        down()
        raise


def _add_host(i: int, name: str, hosts_file: str, bits: int | None) -> None:
    link = f"{LINK_PREFIX}{i}"
    (ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
    (ETC_NETNS / name / "hosts").write_text(hosts_file)
    _run("ip", "netns", "add", name)
    _run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
    _run("ip", "link", "set", link, "master", BRIDGE, "up")
    inside = ("ip", "-n", name)
    _run(*inside, "addr", "add", f"{address(i)}/24", "dev", "eth0")
    _run(*inside, "link", "set", "eth0", "up")
    _run(*inside, "link", "set", "lo", "up")
    if bits is not None:
        _shape(link, None, bits)       # what the host receives
        _shape("eth0", name, bits)     # what the host sends


def state() -> dict:
    """The running cluster's description; UserError naming `cluster up` when there is none."""
    try:
        return json.loads((STATE / "state.json").read_text())
    except FileNotFoundError:
        raise UserError("no emulated cluster is up: run `python -m experiments cluster up "
                        "--hosts 2 --bandwidth 1gbit` first (as root)") from None


def _namespaces() -> list[str]:
    listing = _run("ip", "netns", "list", check=False).stdout.split()
    return [n for n in listing if n.startswith(PREFIX)]


def _links() -> list[str]:
    listing = _run("ip", "-o", "link", "show", check=False).stdout
    names = re.findall(r"^\d+: ([^:@\s]+)", listing, re.M)
    return [n for n in names if n.startswith(LINK_PREFIX) or n == BRIDGE]


def _processes(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of `inodes` (named or already deleted)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.stat(entry / "ns/net").st_ino in inodes:
                pids.append(int(entry.name))
        except OSError:
            continue  # gone, or a kernel thread
    return pids


def _inodes() -> set[int]:
    inodes = set()
    for name in _namespaces():
        try:
            inodes.add(os.stat(f"/run/netns/{name}").st_ino)
        except OSError:
            pass
    try:
        inodes.update(json.loads((STATE / "state.json").read_text())["netns_inodes"])
    except (OSError, ValueError, KeyError):
        pass
    return inodes


def leftovers() -> list[str]:
    """Everything of an emulated cluster still on this machine: namespaces, links, files,
    processes inside the hosts. Empty after `down`."""
    left = [f"namespace {n}" for n in _namespaces()] + [f"link {n}" for n in _links()]
    left += [f"file {p}" for p in [STATE, *ETC_NETNS.glob(f"{PREFIX}*")] if p.exists()]
    return left + [f"process {pid}" for pid in _processes(_inodes())]


def down() -> list[str]:
    """Remove every emulated host, link and file, killing the processes inside the hosts
    first (whatever their owner left: a launch that failed or was killed). Idempotent.

    Returns:
      what was removed.
    """
    removed = leftovers()
    inodes = _inodes()
    deadline = time.monotonic() + 10
    while (pids := _processes(inodes)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for name in _namespaces():
        _run("ip", "netns", "del", name, check=False)
    for link in _links():
        _run("ip", "link", "del", link, check=False)
    for path in ETC_NETNS.glob(f"{PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(STATE, ignore_errors=True)
    if ETC_NETNS.exists() and not any(ETC_NETNS.iterdir()):
        ETC_NETNS.rmdir()
    return removed


@contextmanager
def running(hosts: int, bandwidth: str):
    """`up`, then `down` however the block ends (tests, studies)."""
    try:
        yield up(hosts, bandwidth)
    finally:
        down()


def on_host(i: int, argv: list[str]) -> list[str]:
    """The command line that runs `argv` on host i (its namespace and hostname), keeping this
    process's environment and working directory."""
    hosts = state()["hosts"]
    if not 0 <= i < len(hosts):
        raise ConfigError(f"--host {i}: the cluster has hosts 0 to {len(hosts) - 1}")
    return ["ip", "netns", "exec", hosts[i], "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', hosts[i], *argv]


def mpiexec_on_hosts(ranks: int, argv: list[str]) -> list[str]:
    """The command line that launches `ranks` MPI ranks of `argv` over the hosts, in blocks
    of ceil(ranks / hosts) (ranks 0.. on host 0, the next block on host 1, ...): this venv's
    MPICH mpiexec on host 0, each host's hydra proxy started through LAUNCHER."""
    hosts = state()["hosts"]
    exe = str(Path(sys.executable).parent / "mpiexec")
    per_host = -(-ranks // len(hosts))
    return on_host(0, [exe, "-launcher", "ssh", "-launcher-exec", str(STATE / "ssh"),
                       "-hosts", ",".join(f"{h}:{per_host}" for h in hosts), *MPI_OVER_TCP,
                       "-n", str(ranks), *argv])




def _launch(argv: list[str]) -> int:
    """Run a launch to its end; if this process is interrupted, end the launch's processes."""
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def main(argv: list[str]) -> int:
    """`python -m experiments cluster ACTION [options] [-- COMMAND...]`; the exit status.
    Parsed here, not by the top-level parser: the command after -- passes through untouched."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = Parser(prog="python -m experiments cluster")
    cluster_arguments(parser)
    args = parser.parse_args(argv[:split])
    argv = argv[split + 1:]
    if args.action in ("exec", "mpiexec") and not argv:
        raise ConfigError(f"cluster {args.action}: give the command after --, e.g. "
                          f"`cluster {args.action} -- hostname`")
    if args.action not in ("exec", "mpiexec") and argv:
        raise ConfigError(f"cluster {args.action} takes no command (got {' '.join(argv)!r})")
    if args.action == "up":
        made = up(args.hosts, args.bandwidth)
        print(f"{len(made['hosts'])} hosts up at {made['bandwidth']}: "
              + ", ".join(f"{h} {a}" for h, a in zip(made["hosts"], made["addresses"])))
    elif args.action == "down":
        removed = down()
        print(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to remove")
    elif args.action == "status":
        print(json.dumps(state(), indent=1))
    elif args.action == "exec":
        return _launch(on_host(args.host, argv))
    else:
        return _launch(mpiexec_on_hosts(args.ranks, argv))
    return 0
