"""A single-node SLURM cluster from Debian's packages, for tests and for trying job scripts.

munged, slurmctld and slurmd run as root from a private folder (their own key, socket, ports,
state and logs: nothing of the system's SLURM or munge is used or changed); `srun`, `sbatch`
and `scontrol` reach it through the environment `up` returns (SLURM_CONF). One node, CPUs=2,
OverSubscribe=YES (jobs share the cores), select/cons_tres, proctrack/linuxproc, task/none
(no cgroups needed), jobs may be requeued.

    python -m experiments.infra.slurm install      # apt-get install slurm-wlm munge (root)
    python -m experiments.infra.slurm up           # prints the `export SLURM_CONF=...` to use
    python -m experiments.infra.slurm down         # stops every daemon, removes the folder
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jaxpar.errors import UserError

HOME = Path("/tmp/jaxpar-slurm")   # conf, key, socket, state, logs; removed by `down`
PORTS = (16817, 16818)             # slurmctld, slurmd: away from SLURM's usual 6817/6818
DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")
START_TIMEOUT_S = 30

CONF = """ClusterName=jaxpar
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={home}/munge.sock
CredType=cred/munge
StateSaveLocation={home}/state
SlurmdSpoolDir={home}/spool
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd.pid
SlurmctldLogFile={home}/slurmctld.log
SlurmdLogFile={home}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing() -> str | None:
    """What this machine lacks to run the cluster, or None."""
    absent = [d for d in (*DAEMONS, "srun", "sbatch") if shutil.which(d) is None]
    if absent:
        return (f"SLURM's tests need {', '.join(absent)}: `make test` installs them as root, or "
                f"`apt-get install {' '.join(PACKAGES)}` (Debian)")
    if os.geteuid() != 0:
        return "the single-node SLURM cluster runs its daemons as root: run it as root"
    return None


def install() -> None:
    """apt-get install slurm-wlm munge (apt-get update first when the lists are stale)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise UserError(f"installing needs root and apt-get: apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "install", "-y", "-q", *PACKAGES]
    if subprocess.run(apt, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(apt, env=env, capture_output=True, check=True)


def environment() -> dict[str, str]:
    """This process's environment plus what SLURM's commands need to reach the cluster."""
    return {**os.environ, "SLURM_CONF": str(HOME / "slurm.conf")}


def _wait(what: str, ready, log: Path | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            down()
            raise UserError(f"{what} did not start within {START_TIMEOUT_S} s: {tail}")
        time.sleep(0.2)


def up() -> dict[str, str]:
    """Start munged, slurmctld and slurmd (after stopping any left from before).

    Returns:
      the environment for srun/sbatch/scontrol.
    """
    if (why := missing()) is not None:
        raise UserError(why)
    down()
    for sub in ("state", "spool"):
        (HOME / sub).mkdir(parents=True)
    key = HOME / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    (HOME / "slurm.conf").write_text(CONF.format(host=host, home=HOME, ctld_port=PORTS[0],
                                                 slurmd_port=PORTS[1]))
    subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={HOME}/munge.sock",
                    f"--pid-file={HOME}/munged.pid", f"--log-file={HOME}/munged.log",
                    f"--seed-file={HOME}/munged.seed"], check=True, capture_output=True)
    conf = ["-f", str(HOME / "slurm.conf")]
    subprocess.run(["slurmctld", *conf], check=True, capture_output=True)
    subprocess.run(["slurmd", *conf], check=True, capture_output=True)
    env = environment()

    def node_idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        return out.stdout.strip() in ("idle", "mix", "alloc")

    _wait("slurmd", node_idle, HOME / "slurmd.log")
    return env


def _pids() -> list[int]:
    """The daemons this module started (from their pid files, which they remove on exit:
    read them before stopping the daemons)."""
    pids = []
    for daemon in DAEMONS:
        try:
            pids.append(int((HOME / f"{daemon}.pid").read_text()))
        except (OSError, ValueError):
            continue
    return pids


def _steps() -> list[int]:
    """Our daemons' job-step helpers (slurmstepd, started with our SLURM_CONF): one whose
    slurmd is gone waits for it forever."""
    mine, pids = f"SLURM_CONF={HOME / 'slurm.conf'}".encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and (entry / "comm").read_text().strip() == "slurmstepd"
                    and mine in (entry / "environ").read_bytes().split(b"\0")):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def alive(pid: int) -> bool:
    """Whether `pid` is alive (a zombie nobody reaps has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def down() -> None:
    """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), remove the folder."""
    if (HOME / "slurm.conf").exists() and shutil.which("scancel"):
        subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=environment(),
                       capture_output=True, timeout=30)
    pids = _pids() + _steps()
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        for pid in filter(alive, pids):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
    shutil.rmtree(HOME, ignore_errors=True)


def main(argv: list[str]) -> int:
    action = argv[0] if argv else ""
    try:
        if action == "install":
            install()
        elif action == "up":
            print(f"export SLURM_CONF={up()['SLURM_CONF']}")
        elif action == "down":
            down()
        else:
            print("usage: python -m experiments.infra.slurm install|up|down", file=sys.stderr)
            return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
