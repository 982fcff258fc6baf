"""A multi-node SLURM on one machine for tests (infra.md §8): a login node and three compute nodes.

Each node is a network namespace joined to one bridge (in a "switch" namespace of its own) by a
veth pair whose node end is ``eth0``, with its own host name in a UTS namespace kept in a file
(``unshare --uts=FILE``, under ``RUN_DIR``), so ``nsenter --net=... --uts=...`` enters a node.
slurmctld runs on the login node (10.233.0.1), where the tests also run ``clusterkit`` and the
driver; one slurmd per
compute node (n1..n3 at 10.233.0.2-4), with ``%n`` in its spool, pid and log paths. The nodes
share the filesystem (one mount namespace) and a munged of the run's own (its socket under
``RUN_DIR``, so another test session's munged coming and going cannot break it; the key is the
machine's). None of the names resolve
anywhere, so nothing can reach a compute node through a host name or loopback.

``start(directory)`` brings it up and waits for every node to be idle; ``MultiNode.stop()``
cancels every job, stops the daemons by their PIDs, kills what is left in the namespaces and
deletes them. ``kill_node`` is a node dying (every process in it killed, slurmd included);
``revive_node`` starts its slurmd again; ``cut_node`` sets its link down (a partition) and
``reconnect_node`` up again. A run killed before its teardown leaves its namespaces;
the next ``start`` removes them (``remove_stale``: the UTS files are kept per run, by PID).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import slurm as single
from tests.sshd import netns_reason

NODES = ("n1", "n2", "n3")
LOGIN = "login"
SUBNET = "10.233.0"
INTERFACE = "eth0"
CPUS = 4
REAL_MEMORY_MB = 4000
PARTITION = "nodes"
#: The UTS namespace files, a folder per run (its PID): what a killed run left is found here
RUN_DIR = Path("/run/clusterkit-multinode")

#: conftest.TOKEN_VAR: marks a test's processes (the daemons are the session's)
TOKEN_VAR = "CLUSTERKIT_TEST_TOKEN"

CONF = """\
ClusterName=ckmn
SlurmctldHost={login}({subnet}.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
KillWait=2
MinJobAge=2
{nodes}
PartitionName={partition} Nodes={names} Default=YES LLN=YES MaxTime=INFINITE State=UP
"""


def missing_reason() -> str | None:
    """Why a multi-node SLURM cannot start here, else None."""
    absent = single.missing()
    if absent:
        return f"SLURM is not installed (missing {absent}): run scripts/setup/20-slurm.sh"
    return netns_reason()


def address(node: str) -> str:
    return f"{SUBNET}.{1 if node == LOGIN else NODES.index(node) + 2}"


def _run(*command: str) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def _daemon_env(conf: Path) -> dict[str, str]:
    """The daemons' environment: not the test token (they are the session's, not a test's)."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    return {**env, "SLURM_CONF": str(conf)}


@dataclass
class MultiNode:
    directory: Path
    conf: Path
    tag: str
    namespaces: list[str] = field(default_factory=list)
    uts_files: dict[str, Path] = field(default_factory=dict)
    munged_pid: int | None = None

    def netns(self, node: str) -> str:
        return f"ck{self.tag}{node}"

    def enter(self, node: str = LOGIN) -> list[str]:
        """The command prefix that runs a program on ``node`` (its network and host name)."""
        return ["nsenter", f"--net=/run/netns/{self.netns(node)}", f"--uts={self.uts_files[node]}"]

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """``command`` on the login node, with this SLURM's config."""
        return subprocess.run(
            [*self.enter(), *command],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env()},
            check=False,
        )

    def queue(self) -> list[str]:
        """Every job squeue lists: 'id state nodes name'."""
        done = self.run("squeue", "-h", "-o", "%i %T %N %j")
        return [line for line in done.stdout.splitlines() if line.strip()]

    def node_states(self) -> dict[str, str]:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def wait_idle(
        self, nodes: tuple[str, ...] = NODES, timeout: float = 60.0, busy: bool = False
    ) -> None:
        """Wait for ``nodes`` to be idle (or, with ``busy``, in service, jobs or not)."""
        ok = {"idle", "mixed", "allocated"} if busy else {"idle"}
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(node) in ok for node in nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout}s: {states}\n{self.log()}")
            time.sleep(0.1)

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

    def pids(self, node: str) -> list[int]:
        """Every process in the node's network namespace."""
        done = subprocess.run(
            ["ip", "netns", "pids", self.netns(node)], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in done.stdout.split() if single._alive(int(pid))]

    def processes(self, node: str) -> dict[int, str]:
        """What runs on ``node`` besides its slurmd: pid -> command line."""
        slurmd = single._read_pid(self.directory / f"slurmd-{node}.pid")
        found = {}
        for pid in self.pids(node):
            if pid == slurmd:
                continue
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found[pid] = cmdline.decode(errors="replace")[:200]
        return found

    def kill_node(self, node: str) -> list[int]:
        """The node dies: SIGKILL every process in its namespace, slurmd included."""
        killed = self.pids(node)
        for pid in killed:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def cut_node(self, node: str) -> None:
        """The node is cut off: its link goes down on its side (its processes live on)."""
        _run("ip", "-n", self.netns(node), "link", "set", INTERFACE, "down")

    def reconnect_node(self, node: str) -> None:
        """The cut is mended: the link comes back up with its address (and so its route), and
        the node back in service (as an admin would; SLURM set it down while it was cut)."""
        _run("ip", "-n", self.netns(node), "link", "set", INTERFACE, "up")
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")  # unless not down

    def set_slurmd_timeout(self, seconds: int) -> None:
        """SLURM's SlurmdTimeout (how long before a silent node is set DOWN), reconfigured
        live: 10 s for the tier, a site's 300 s where a test needs a node silent but not down."""
        text = re.sub(r"(?m)^SlurmdTimeout=\d+$", f"SlurmdTimeout={seconds}", self.conf.read_text())
        self.conf.write_text(text)
        done = self.run("scontrol", "reconfigure")
        if done.returncode != 0:
            raise RuntimeError(f"scontrol reconfigure: {done.stderr.strip()}")

    def start_slurmd(self, node: str) -> None:
        (self.directory / f"spool-{node}").mkdir(exist_ok=True)
        command = [*self.enter(node), "slurmd", "-f", str(self.conf), "-N", node]
        subprocess.run(command, env=_daemon_env(self.conf), check=True, timeout=30)

    def revive_node(self, node: str) -> None:
        """A dead node comes back: its slurmd starts again and the node returns to service."""
        self.start_slurmd(node)
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        self.wait_idle((node,), busy=True)

    def log(self, name: str = "slurmctld", lines: int = 30) -> str:
        path = self.directory / "log" / f"{name}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.conf.exists() and LOGIN in self.uts_files:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.empty_queue(timeout=15)
        for name in [f"slurmd-{node}" for node in NODES] + ["slurmctld"]:
            pid = single._read_pid(self.directory / f"{name}.pid")
            if pid:
                single._stop_pid(pid, timeout=5)
        _remove(self.tag)
        self.namespaces.clear()
        self.uts_files.clear()
        if self.munged_pid:
            single._stop_pid(self.munged_pid, timeout=5)
            self.munged_pid = None


def _remove(tag: str) -> None:
    """Kill what runs in the namespaces of ``tag``, delete them and unmount its UTS files."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = {f"ck{tag}{node}" for node in ("sw", LOGIN, *NODES)}
    ours = [line.split()[0] for line in listed.stdout.splitlines() if line.split()[0] in names]
    for ns in ours:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in ours:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    folder = RUN_DIR / tag
    munged = single._read_pid(folder / "munge" / "munged.pid")
    if munged:  # the run's own munged (stop() stops it; a killed run left it)
        single._stop_pid(munged, timeout=5)
    shutil.rmtree(folder / "munge", ignore_errors=True)
    for path in folder.glob("*") if folder.is_dir() else ():
        subprocess.run(["umount", str(path)], capture_output=True, check=False)
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
        RUN_DIR.rmdir()  # unless another run's folder is there


def remove_stale() -> None:
    """What a run killed before its teardown left: its namespaces, daemons and UTS files."""
    for folder in RUN_DIR.glob("*") if RUN_DIR.is_dir() else ():
        mine = folder.name == str(os.getpid())  # a dead run's PID, now this process's
        if folder.name.isdigit() and (mine or not single._alive(int(folder.name))):
            _remove(folder.name)


def _network(cluster: MultiNode) -> None:
    """The switch with its bridge, and each node joined to it as eth0 with its address."""
    switch = cluster.netns("sw")
    _run("ip", "netns", "add", switch)
    cluster.namespaces.append(switch)
    _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", switch, "link", "set", "br0", "up")
    for node in (LOGIN, *NODES):
        ns = cluster.netns(node)
        _run("ip", "netns", "add", ns)
        cluster.namespaces.append(ns)
        port = f"p-{node}"
        _run("ip", "-n", ns, "link", "add", INTERFACE, "type", "veth",
             "peer", "name", port, "netns", switch)  # fmt: skip
        _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{address(node)}/24", "dev", INTERFACE)
        _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        uts = RUN_DIR / cluster.tag / node
        uts.parent.mkdir(parents=True, exist_ok=True)
        uts.touch()
        _run("unshare", f"--uts={uts}", "hostname", node)
        cluster.uts_files[node] = uts


def munge_socket(tag: str) -> Path:
    return RUN_DIR / tag / "munge" / "munge.socket"


def _start_munged(tag: str) -> int:
    """A munged for this run alone, as user munge, its socket, PID and log under RUN_DIR."""
    folder = munge_socket(tag).parent
    folder.mkdir(parents=True, exist_ok=True)
    for path in (RUN_DIR, folder.parent):
        path.chmod(0o755)
    shutil.chown(folder, "munge", "munge")
    folder.chmod(0o755)  # munged wants its socket folder searchable by all
    names = {"socket": "munge.socket", "pid-file": "munged.pid", "log-file": "munged.log"}
    flags = [f"--{flag}={folder / name}" for flag, name in names.items()]
    flags.append(f"--seed-file={folder / 'munged.seed'}")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", *flags],
                   check=True, timeout=30)  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pid = single._read_pid(folder / "munged.pid")
        if pid and single._alive(pid) and munge_socket(tag).exists():
            return pid
        time.sleep(0.1)
    raise RuntimeError(f"munged did not start: {(folder / 'munged.log').read_text()[-500:]}")


def _write_conf(directory: Path, tag: str) -> Path:
    nodes = "\n".join(
        f"NodeName={node} NodeAddr={address(node)} CPUs={CPUS} RealMemory={REAL_MEMORY_MB} "
        "State=UNKNOWN"
        for node in NODES
    )
    conf = directory / "slurm.conf"
    conf.write_text(
        CONF.format(
            login=LOGIN,
            subnet=SUBNET,
            d=directory,
            nodes=nodes,
            partition=PARTITION,
            names=",".join(NODES),
            munge_socket=munge_socket(tag),
        )
    )
    return conf


def start(directory: Path, timeout: float = 60.0) -> MultiNode:
    """Network, munged, slurmctld on the login node, a slurmd per node; every node idle."""
    directory = directory.resolve()
    for sub in ("state", "log"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    remove_stale()
    tag = str(os.getpid())
    cluster = MultiNode(directory, _write_conf(directory, tag), tag=tag)
    try:
        _network(cluster)
        cluster.munged_pid = _start_munged(cluster.tag)
        env = _daemon_env(cluster.conf)
        subprocess.run([*cluster.enter(), "slurmctld", "-f", str(cluster.conf)],
                       env=env, check=True, timeout=30)  # fmt: skip
        for node in NODES:
            cluster.start_slurmd(node)
        cluster.wait_idle(timeout=timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# ------------------------------------------------ for the tests: a user on the login node

ROOT = Path(__file__).resolve().parent.parent


def profile(directory: Path, name: str, **fields: Any) -> Path:
    data: dict[str, Any] = {
        "backend": "slurm",
        "queue": PARTITION,
        "workers": 3,
        "cores": 1,
        "memory": "1GiB",
        "walltime": "00:10:00",
        "interface": INTERFACE,
        "log_directory": str(directory / "joblogs"),
        "start_timeout": 120,
        "scheduler": {"dashboard": False},
    }
    data.update(fields)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def on_login(
    nodes: MultiNode, *command: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``command`` on the login node, in the repository (``tests`` imports), this SLURM's."""
    return subprocess.run(
        [*nodes.enter(), *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **nodes.env(), **(env or {})},
        check=False,
    )


def clusterkit(nodes: MultiNode, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return on_login(nodes, sys.executable, "-m", "clusterkit", *args, **kwargs)


def python(nodes: MultiNode, code: str, *args: str, **kwargs: Any) -> Any:
    """Run ``code`` on the login node; what it printed last, as JSON."""
    done = on_login(nodes, sys.executable, "-c", textwrap.dedent(code), *args, **kwargs)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def nothing_left(nodes: MultiNode) -> None:
    """No job in the queue and no process but slurmd on any node (workers end with the jobs)."""
    deadline = time.monotonic() + 30
    while nodes.queue() or any(nodes.processes(n) for n in NODES):
        if time.monotonic() > deadline:
            left = {n: nodes.processes(n) for n in NODES}
            pytest.fail(f"left after down: queue {nodes.queue()}, processes {left}")
        time.sleep(0.2)


if __name__ == "__main__":  # bring it up and down once: `python -m tests.multinode DIR`
    started = time.monotonic()
    up = start(Path(sys.argv[1]))
    print(f"up in {time.monotonic() - started:.2f}s: {up.node_states()}")
    print(up.run("srun", "-N", "3", "hostname").stdout)
    started = time.monotonic()
    up.stop()
    print(f"down in {time.monotonic() - started:.2f}s")


#: A search's objective that notes the host each trial ran on (``objective.py`` of a project)
OBJECTIVE = """\
import socket
import time


def objective(trial):
    x = trial.suggest_float("x", -5, 5)
    trial.set_user_attr("host", socket.gethostname())
    time.sleep(1.0)
    return (x - 1) ** 2
"""


def trials(storage: str, name: str) -> list[Any]:
    """Study ``name``'s trials in ``storage`` as they stand; none before it is created."""
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    except KeyError:  # not created yet
        return []
