"""A Grid Engine execution host in a network namespace of its own, beside the cell of tests/sge.py.

The node ``gx1`` (:data:`tests.sge.NODE`) is a network namespace joined to this host by a veth
pair named ``ckge0`` on both ends (10.234.0.1 here, 10.234.0.2 there), so a profile's
``interface: ckge0`` names the link on the scheduler's side and on the worker's. Its
``sge_execd`` runs there with the host name ``gx1`` (a UTS namespace) and an ``/etc/hosts`` of
its own (a mount namespace) in which the qmaster's host name is this host's address on the link;
the qmaster resolves ``gx1`` through its own (tests/sge.py). The node serves one queue,
``nodes.q``, so the other Grid Engine tests' jobs never land there.

``node(sge)`` adds the host and the queue, starts the execd, waits for ``nodes.q@gx1`` to take
jobs, and on leaving deletes its jobs, stops the execd by PID, removes the queue and the host and
deletes the namespace. A run killed before that leaves them; the next ``node`` removes them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import sge as G
from tests.slurm import _stop_pid

NETNS = "ckgx"
LINK = "ckge0"
QUEUE = "nodes.q"
#: The node's /etc/hosts: the qmaster's name (``act_qmaster``) is this host's address on the link
NODE_HOSTS = G.HOSTS.parent / "hosts.node"


@dataclass
class Node:
    sge: G.SGE
    execd: int

    name: str = G.NODE
    address: str = G.NODE_ADDRESS
    interface: str = LINK
    queue: str = QUEUE

    def enter(self) -> list[str]:
        """The command prefix that runs a program in the node's network namespace."""
        return ["nsenter", f"--net=/run/netns/{NETNS}"]

    def processes(self) -> list[str]:
        """'PID command' of every process in the node but its execd (what jobs left)."""
        pids = subprocess.run(
            ["ip", "netns", "pids", NETNS], capture_output=True, text=True, check=False
        ).stdout.split()
        found = []
        for pid in pids:
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                if int(pid) != self.execd and command.strip():
                    found.append(f"{pid} {command.decode(errors='replace').strip()}")
        return found


def _ip(*args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _qconf(*args: str) -> subprocess.CompletedProcess[str]:
    """qconf where the node's name resolves (qconf resolves host names itself, too)."""
    return G.run(*G.with_node_hosts("qconf", *args))


def _remove(sge: G.SGE) -> None:
    """What a node of an earlier run left: its jobs, execd, queue, host and namespace."""
    left = [line.split()[0] for line in sge.queue() if f"{QUEUE}@" in line]
    if left:
        G.run("qdel", "-f", *left)
    pid = G.execd_pid(G.NODE)
    if pid is not None:
        _stop_pid(pid, timeout=20.0)
    if G.run("qconf", "-sq", QUEUE).returncode == 0:
        G._check(_qconf("-dq", QUEUE))
    if _qconf("-se", G.NODE).returncode == 0:
        G._check(_qconf("-de", G.NODE))
    for pid_text in subprocess.run(
        ["ip", "netns", "pids", NETNS], capture_output=True, text=True, check=False
    ).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_text), signal.SIGKILL)
    _ip("netns", "del", NETNS, check=False)  # the veth pair goes with it


def _link() -> None:
    _ip("netns", "add", NETNS)
    _ip("link", "add", LINK, "type", "veth", "peer", "name", f"{LINK}p")
    _ip("link", "set", f"{LINK}p", "netns", NETNS)
    _ip("-n", NETNS, "link", "set", f"{LINK}p", "name", LINK)
    _ip("addr", "add", f"{G.HOST_ADDRESS}/24", "dev", LINK)
    _ip("-n", NETNS, "addr", "add", f"{G.NODE_ADDRESS}/24", "dev", LINK)
    for args in (("link", "set", LINK, "up"), ("-n", NETNS, "link", "set", LINK, "up")):
        _ip(*args)
    _ip("-n", NETNS, "link", "set", "lo", "up")


def _configure() -> None:
    """The exec host and ``nodes.q`` (all.q's settings, the node as its only host)."""
    with tempfile.TemporaryDirectory(prefix="ck-sge-node-") as name:
        tmp = Path(name)
        (tmp / "exec_host").write_text(
            f"hostname {G.NODE}\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\n"
            "xuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\n"
            "report_variables NONE\n"
        )
        G._check(_qconf("-Ae", str(tmp / "exec_host")))
        queue = G.run("qconf", "-sq", G.QUEUE).stdout
        lines = [
            f"qname {QUEUE}" if line.startswith("qname ")
            else f"hostlist {G.NODE}" if line.startswith("hostlist ")
            else line
            for line in queue.splitlines()
        ]  # fmt: skip
        (tmp / "queue").write_text("\n".join(lines) + "\n")
        G._check(_qconf("-Aq", str(tmp / "queue")))


def _start_execd() -> int:
    act_qmaster = (G.SGE_ROOT / G.CELL / "common" / "act_qmaster").read_text().split()[0]
    NODE_HOSTS.write_text(
        f"127.0.0.1 localhost\n{G.HOST_ADDRESS} {act_qmaster}\n{G.NODE_ADDRESS} {G.NODE}\n"
    )
    script = 'hostname "$0" && mount --bind "$1" /etc/hosts && exec /usr/sbin/sge_execd'
    command = [
        "nsenter", f"--net=/run/netns/{NETNS}", "unshare", "--uts", "--mount",
        "--propagation", "private", "sh", "-c", script, G.NODE, str(NODE_HOSTS),
    ]  # fmt: skip
    G._check(G.run(*command))
    deadline = time.monotonic() + 30
    while (pid := G.execd_pid(G.NODE)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"sge_execd on {G.NODE} wrote no pid file\n{G.SGE('').log()}")
        time.sleep(0.2)
    return pid


def _queue_open() -> bool:
    done = G.run("qstat", "-f", "-q", f"{QUEUE}@{G.NODE}")
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(QUEUE)]
    return bool(rows) and len(rows[0]) == 5 and rows[0][3] not in {"-NA-", ""}


@contextlib.contextmanager
def node(sge: G.SGE, timeout: float = 60.0) -> Iterator[Node]:
    """The execution host ``gx1`` in its namespace, serving ``nodes.q``, for the ``with``."""
    _remove(sge)
    execd = 0
    try:
        _link()
        _configure()
        execd = _start_execd()
        deadline = time.monotonic() + timeout
        while not _queue_open():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{QUEUE}@{G.NODE} did not open in {timeout}s\n{sge.log()}")
            time.sleep(0.3)
        yield Node(sge, execd)
    finally:
        _remove(sge)
