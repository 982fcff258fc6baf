"""A single-node SLURM on 127.0.0.1 for tests: munged, slurmctld and slurmd from a tmp config.

``start(directory)`` writes slurm.conf (infra.md §3a), starts the daemons and waits for the node
to be idle. The node has ``GPUS`` GRES GPUs: files standing in for device nodes, which slurmctld
schedules and ``sbatch --test-only`` checks requests against (nothing ever runs on them), so one
SLURM serves the whole session, GPU directives included. ``Slurm.stop()`` cancels every job,
waits for the queue to empty, and stops the daemons by the PIDs in their pid files; munged too,
if this process started it and no other SLURM of this process still uses it. Whether munged runs
is asked of munged itself (a stopped munged lingers as a zombie that ``pgrep`` still lists), so a
tier passes on its own, in any order, with or without a munged left from earlier.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel")
CPUS = 8
REAL_MEMORY_MB = 8000
GPUS = 4
PARTITION = "debug"


def missing() -> list[str]:
    """SLURM and munge programs not installed (scripts/setup/20-slurm.sh installs them)."""
    paths = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin"
    return [name for name in DAEMONS if shutil.which(name, path=paths) is None]


CONF = """\
ClusterName=ck
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
KillWait=2
MinJobAge=2
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} Gres=gpu:{gpus} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Slurm:
    directory: Path
    conf: Path
    pids: dict[str, int] = field(default_factory=dict)
    munged_pid: int | None = None  # set when this fixture started munged

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **self.env()},
            check=False,
        )

    def queue(self) -> list[str]:
        """Every job squeue lists: 'id state reason'."""
        done = self.run("squeue", "-h", "-o", "%i %T %r")
        return [line for line in done.stdout.splitlines() if line.strip()]

    def empty_queue(self, timeout: float = 30.0) -> list[str]:
        """Cancel all jobs and wait for squeue to list none; what is left."""
        left = self.queue()
        if left:
            self.run("scancel", "--full", *[line.split()[0] for line in left])
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.queue()
        return left

    def log(self, name: str = "slurmctld", lines: int = 30) -> str:
        path = self.directory / "log" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self.empty_queue()
        for name in ("slurmd", "slurmctld"):
            pid = self.pids.get(name) or _read_pid(self.directory / f"{name}.pid")
            if pid:
                _stop_pid(pid)
        if self.munged_pid:
            _release_munged(self.munged_pid)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _munged_running() -> bool:
    """munged answers: a credential encodes and decodes (a zombie munged does neither)."""
    done = subprocess.run(
        "munge -n | unmunge", shell=True, capture_output=True, timeout=30, check=False
    )
    return done.returncode == 0


MUNGED_PID = Path("/run/munge/munged.pid")
#: Harness SLURMs of this process using the munged it started (PID -> count).
_munged_users: dict[int, int] = {}


def _release_munged(pid: int) -> None:
    """One user fewer; the last one stops the munged this process started."""
    _munged_users[pid] = _munged_users.get(pid, 1) - 1
    if _munged_users[pid] <= 0:
        del _munged_users[pid]
        _stop_pid(pid)


def ensure_munged() -> int | None:
    """Start munged (SLURM's auth) unless it runs; the PID of the munged this process started
    (counted once more per caller, see ``_release_munged``), else None."""
    for ours in _munged_users:
        if _alive(ours):
            _munged_users[ours] += 1
            return ours
    if _munged_running():
        return None
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    os.chmod("/run/munge", 0o755)
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pid = _read_pid(MUNGED_PID)
        if pid and _alive(pid) and _munged_running():
            _munged_users[pid] = 1
            return pid
        time.sleep(0.1)
    raise RuntimeError("munged did not start")


def start(directory: Path, timeout: float = 30.0) -> Slurm:
    """Write the config into ``directory``, start slurmctld and slurmd, wait for an idle node."""
    directory = directory.resolve()
    for sub in ("state", "spool", "log"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    for index in range(GPUS):
        (directory / f"gpu{index}").touch()
    (directory / "gres.conf").write_text(f"Name=gpu File={directory}/gpu[0-{GPUS - 1}]\n")
    conf = directory / "slurm.conf"
    conf.write_text(
        CONF.format(
            host=host,
            d=directory,
            cpus=CPUS,
            memory=REAL_MEMORY_MB,
            gpus=GPUS,
            partition=PARTITION,
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
        )
    )
    slurm = Slurm(directory, conf, munged_pid=ensure_munged())
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", str(conf)], env=env, check=True, timeout=30)
        pid = _read_pid(directory / f"{daemon}.pid")
        if pid:
            slurm.pids[daemon] = pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = slurm.run("sinfo", "-h", "-o", "%T")
        if done.stdout.strip() == "idle":
            slurm.pids = {
                d: _read_pid(directory / f"{d}.pid") or 0 for d in ("slurmctld", "slurmd")
            }
            return slurm
        time.sleep(0.1)
    slurm.stop()
    raise RuntimeError(
        f"SLURM node not idle after {timeout}s:\n{slurm.log()}\n{slurm.log('slurmd')}"
    )
