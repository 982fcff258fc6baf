"""A single-node Grid Engine cell (qmaster + execd) on this host for tests (infra.md §3c).

scripts/setup/25-gridengine.sh installs Debian's gridengine packages, which create the cell
``$SGE_ROOT/default``. ``start()`` configures it (host aliases, exec host, queue ``all.q``,
root jobs, a 1 s scheduling interval, pending reasons kept, a parallel environment ``smp``, a
``gpu`` consumable of 4 that no device backs), starts whichever daemon is not
running and waits for the queue to take jobs. ``SGE.stop()`` deletes every job, waits for the
queue to empty and stops, by PID, only the daemons it started: a cell left running by an
earlier session is used and left as it was.

The qmaster runs in a mount namespace of its own whose ``/etc/hosts`` also names an execution
host in a network namespace (``tests/sge_node.py``): Grid Engine resolves every host by name
and address, and this keeps the machine's ``/etc/hosts`` as it is. A qmaster left running
without that name is restarted.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.slurm import _alive, _read_pid, _stop_pid

PROGRAMS = ("sge_qmaster", "sge_execd", "qsub", "qstat", "qdel", "qconf")
SGE_ROOT = Path(os.environ.get("SGE_ROOT", "/var/lib/gridengine"))
CELL = "default"
SPOOL = Path("/var/spool/gridengine")
QUEUE = "all.q"
SLOTS = 8
GPUS = 4  # a consumable the exec host offers; nothing runs on it (qsub -w v checks requests)
GPU_COMPLEX = "gpu gpu INT <= YES JOB 0 0\n"  # name shortcut type relop requestable consumable
PE = "smp"  # all of a job's slots on one host
PE_CONF = f"""pe_name {PE}
slots {SLOTS}
user_lists NONE
xuser_lists NONE
start_proc_args NONE
stop_proc_args NONE
allocation_rule $pe_slots
control_slaves FALSE
job_is_first_task TRUE
urgency_slots min
accounting_summary FALSE
qsort_args NONE
"""
ENV = {"SGE_ROOT": str(SGE_ROOT), "SGE_CELL": CELL}

#: The execution host in a network namespace (tests/sge_node.py): its name and address, and
#: this host's address on the link to it
NODE = "gx1"
NODE_ADDRESS = "10.234.0.2"
HOST_ADDRESS = "10.234.0.1"
#: The qmaster's /etc/hosts: the machine's, and the node's name
HOSTS = Path("/run/clusterkit-sge/hosts")


def missing() -> list[str]:
    """Grid Engine programs not installed (scripts/setup/25-gridengine.sh installs them)."""
    paths = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin"
    absent = [name for name in PROGRAMS if shutil.which(name, path=paths) is None]
    return absent + ([] if (SGE_ROOT / CELL / "common").is_dir() else [f"{SGE_ROOT}/{CELL}"])


def run(*command: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **ENV},
        check=False,
    )


def _daemon_pid(pidfiles: list[Path], comm: str) -> int | None:
    """The PID of a running daemon named ``comm`` from one of its pid files."""
    for path in pidfiles:
        pid = _read_pid(path)
        if pid and _alive(pid) and Path(f"/proc/{pid}/comm").read_text().strip() == comm:
            return pid
    return None


def qmaster_pid() -> int | None:
    return _daemon_pid([SPOOL / "qmaster" / "qmaster.pid"], "sge_qmaster")


def execd_pid(host: str | None = None) -> int | None:
    """This host's execd (any spool folder but the namespaced node's), or ``host``'s."""
    if host is not None:
        return _daemon_pid([SPOOL / "execd" / host / "execd.pid"], "sge_execd")
    local = [p for p in sorted((SPOOL / "execd").glob("*/execd.pid")) if p.parent.name != NODE]
    return _daemon_pid(local, "sge_execd")


def with_node_hosts(*command: str) -> list[str]:
    """``command`` in a mount namespace whose /etc/hosts (:data:`HOSTS`) names the node."""
    if not HOSTS.exists():
        HOSTS.parent.mkdir(parents=True, exist_ok=True)
        HOSTS.write_text(Path("/etc/hosts").read_text() + f"{NODE_ADDRESS} {NODE}\n")
    mount = 'mount --bind "$0" /etc/hosts && exec "$@"'
    unshare = ["unshare", "--mount", "--propagation", "private"]
    return [*unshare, "sh", "-c", mount, str(HOSTS), *command]


def _qmaster_knows_node(pid: int) -> bool:
    try:
        return NODE in Path(f"/proc/{pid}/root/etc/hosts").read_text().split()
    except OSError:
        return False


@dataclass
class SGE:
    host: str
    started: dict[str, int] = field(default_factory=dict)  # daemons this harness started

    def env(self) -> dict[str, str]:
        return dict(ENV)

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return run(*command)

    def queue(self) -> list[str]:
        """Every job qstat lists, of any user: 'id state name'."""
        from clusterkit.backends.jobqueue.sge import parse_qstat_xml

        done = run("qstat", "-u", "*", "-xml")
        return [f"{job.job_id} {job.state} {name}" for name, job in parse_qstat_xml(done.stdout)]

    def empty_queue(self, timeout: float = 30.0) -> list[str]:
        """Delete all jobs and wait for qstat to list none; what is left."""
        left = self.queue()
        if left:
            run("qdel", "-f", *[line.split()[0] for line in left])
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.queue()
        return left

    def log(self, lines: int = 30) -> str:
        path = SPOOL / "qmaster" / "messages"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self.empty_queue()
        for name in ("execd", "qmaster"):
            if name in self.started:
                _stop_pid(self.started[name], timeout=20.0)


def _configure(host: str) -> None:
    """Exec host, queue, root jobs, fast scheduling: added when absent, else left (idempotent)."""
    run("qconf", "-as", host)  # submit host ("already exists" the second time)
    with tempfile.TemporaryDirectory(prefix="ck-sge-") as name:
        tmp = Path(name)
        if run("qconf", "-se", host).returncode != 0:
            (tmp / "exec_host").write_text(
                f"hostname {host}\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\n"
                "xuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\n"
                "report_variables NONE\n"
            )
            _check(run("qconf", "-Ae", str(tmp / "exec_host")))
        if run("qconf", "-sq", QUEUE).returncode != 0:
            template = run("qconf", "-sq").stdout
            # the template names PEs that do not exist; the loop below sets the real values
            for key, value in {
                "qname": QUEUE,
                "hostlist": host,
                "shell": "/bin/bash",
                "pe_list": "NONE",
            }.items():
                template = re.sub(rf"(?m)^{key}\s.*$", f"{key} {value}", template)
            (tmp / "queue").write_text(template)
            _check(run("qconf", "-Aq", str(tmp / "queue")))
        if run("qconf", "-sp", PE).returncode != 0:
            (tmp / "pe").write_text(PE_CONF)
            _check(run("qconf", "-Ap", str(tmp / "pe")))
        # a busy machine (2 shared cores in CI) must not put the queue into alarm
        for key, value in (("pe_list", PE), ("load_thresholds", "NONE"), ("slots", str(SLOTS))):
            _check(run("qconf", "-rattr", "queue", key, value, QUEUE))
        complexes = run("qconf", "-sc").stdout
        if not re.search(r"(?m)^gpu\s", complexes):
            (tmp / "complexes").write_text(complexes + GPU_COMPLEX)
            _check(run("qconf", "-Mc", str(tmp / "complexes")))
        _check(run("qconf", "-rattr", "exechost", "complex_values", f"gpu={GPUS}", host))
        conf = run("qconf", "-sconf", "global").stdout
        if not re.search(r"(?m)^min_uid\s+0$", conf):
            conf = re.sub(r"(?m)^(min_[ug]id)\s.*$", r"\1 0", conf)
            (tmp / "global").write_text(conf)
            done = subprocess.run(
                ["qconf", "-Mconf", "global"], cwd=tmp, env={**os.environ, **ENV},
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            _check(done)
        sched = run("qconf", "-ssconf").stdout
        wanted = re.sub(r"(?m)^schedule_interval\s.*$", "schedule_interval 0:0:1", sched)
        wanted = re.sub(r"(?m)^schedd_job_info\s.*$", "schedd_job_info true", wanted)
        wanted = re.sub(r"(?m)^job_load_adjustments\s.*$", "job_load_adjustments NONE", wanted)
        if wanted != sched:
            (tmp / "sched").write_text(wanted)
            _check(run("qconf", "-Msconf", str(tmp / "sched")))


def _check(done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{done.args}: {done.stdout}{done.stderr}")


def _wait(what: str, ready: Callable[[], bool], timeout: float, sge: SGE) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    sge.stop()
    raise RuntimeError(f"Grid Engine: {what} after {timeout}s\n{sge.log()}")


def _queue_open(host: str) -> bool:
    """all.q on this host takes jobs: its execd reports and it is in no error state."""
    done = run("qstat", "-f", "-q", f"{QUEUE}@{host}")
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(QUEUE)]
    if not rows:
        return False
    states = rows[0][5] if len(rows[0]) > 5 else ""
    if "E" in states:
        run("qmod", "-c", QUEUE)  # execd ran before root was allowed: clear, next poll sees it
    if "d" in states:
        run("qmod", "-e", QUEUE)  # disabled by hand earlier
    return done.returncode == 0 and not states and rows[0][3] not in {"-NA-", ""}


def start(timeout: float = 60.0) -> SGE:
    """Configure the cell, start what is not running, wait until all.q takes jobs."""
    host = socket.gethostname().split(".")[0]
    aliases = SGE_ROOT / CELL / "common" / "host_aliases"
    known = aliases.read_text() if aliases.exists() else ""
    if f"{host} localhost" not in known:
        aliases.write_text(f"{host} localhost\n")  # here the host name resolves to loopback
    sge = SGE(host)
    running = qmaster_pid()
    if running is not None and not _qmaster_knows_node(running):
        _stop_pid(running, timeout=20.0)  # started without the node's name: start it anew
    if qmaster_pid() is None:
        _check(run(*with_node_hosts("/usr/sbin/sge_qmaster")))
        _wait("qmaster pid file", lambda: qmaster_pid() is not None, timeout, sge)
        sge.started["qmaster"] = qmaster_pid() or 0
    _wait("qmaster answers", lambda: run("qconf", "-sh").returncode == 0, timeout, sge)
    _configure(host)
    if execd_pid() is None:
        _check(run("/usr/sbin/sge_execd"))
        _wait("execd pid file", lambda: execd_pid() is not None, timeout, sge)
        sge.started["execd"] = execd_pid() or 0
    _wait(f"{QUEUE}@{host} open", lambda: _queue_open(host), timeout, sge)
    return sge
