"""Starting the detached supervisor, hearing whether it is ready, and stopping process groups.

``up`` forks the supervisor once the imports it needs are paid (no second interpreter start),
as a daemon: a double fork into its own session, so it outlives ``up`` and is nobody's zombie.
Where forking is unsafe (threads already running, or no ``fork``), it starts
``python -m clusterkit.lifecycle.supervisor`` instead. Process handling goes through psutil
and signals only: nothing reads ``/proc``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import psutil

from clusterkit.errors import ClusterkitError, ClusterStartError
from clusterkit.state import ClusterRecord, pid_alive

if TYPE_CHECKING:
    from clusterkit.backends.base import Backend
    from clusterkit.lifecycle.warm import WarmSupervisor
    from clusterkit.schema import ProfileCommon

#: Seconds `up` waits beyond the profile's start timeout for the supervisor's own start.
SUPERVISOR_GRACE = 30.0


def can_fork() -> bool:
    """Forking is safe only from a process that runs no other thread yet."""
    return hasattr(os, "fork") and threading.active_count() == 1


def preimport(backend: Backend) -> None:
    """Pay, in ``up``, the imports the supervisor needs, so the forked child does not."""
    import distributed  # noqa: F401

    import clusterkit.lifecycle.supervisor  # noqa: F401

    for requirement in backend.REQUIRES:
        with contextlib.suppress(ImportError):
            importlib.import_module(requirement.module)


def supervise(
    profile: ProfileCommon,
    name: str,
    directory: Path,
    waiting: contextlib.AbstractContextManager[Any],
    warm: WarmSupervisor | None = None,
) -> ClusterRecord:
    """Start a supervisor for ``profile`` (or hand it to ``warm``, forked earlier) and return
    its record once the cluster is ready.

    ``waiting`` is entered after the fork (a spinner's thread must not exist at fork time).
    Raises ClusterStartError with the supervisor's evidence if it fails or never answers;
    then its whole process group is gone.
    """
    if warm is not None:
        read_fd = warm.hand_over(name, profile, directory)
    else:  # `up` found forking unsafe (threads running): a fresh interpreter
        read_fd = _start_fresh_supervisor(profile, name, directory)
    limit = profile.start_timeout + SUPERVISOR_GRACE
    began = time.monotonic()
    try:
        with waiting:
            pid, reply = _read_reply(read_fd, limit)
    finally:
        os.close(read_fd)
    if reply is not None and reply.get("ok"):
        return ClusterRecord(**reply["record"])
    if pid is not None:
        kill_group(pid, grace=5.0)
    timed_out = time.monotonic() - began >= limit
    raise _start_failure(reply, directory, limit if timed_out else None)


def double_fork(grandchild: Callable[[], int]) -> None:
    """Run ``grandchild`` in a grandchild of this process, in its own session (so no terminal
    hangup reaches it), and return once the intermediate child is reaped. The grandchild exits
    with what ``grandchild`` returns (1 if it raised)."""
    # what is alive now goes to the collector's permanent generation: the supervisor's
    # collections then never walk (and so copy, page by page) the heap it shares with `up`,
    # which slowed its start by 0.2-0.3 s on a 2-core machine
    gc.freeze()
    child = os.fork()
    if child:
        gc.unfreeze()
        os.waitpid(child, 0)  # the intermediate child exits at once
        return
    code = 1
    try:
        if os.fork():
            os._exit(0)
        os.setsid()  # session and group leader: its group can be ended by its pid
        code = grandchild()
    finally:
        import logging

        logging.shutdown()
        os._exit(code)


def redirect_stdio(log: Path | None, keep: int | tuple[int, ...]) -> None:
    """stdin from /dev/null, stdout and stderr to the log (None: /dev/null); every other
    inherited fd but ``keep`` closed."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    # locks held by `up` (the per-name flock) must not live on in the supervisor
    start = 3
    for fd in sorted({keep} if isinstance(keep, int) else set(keep)):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
    _forget_resource_tracker()
    # the parent's sys.std* may wrap other fds (a test runner's capture): use the new ones
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _forget_resource_tracker() -> None:
    """The parent's multiprocessing resource tracker is reached through an fd just closed:
    a child that kept its number would write its semaphores' registrations into whatever
    file reuses the fd (a queue's pipe, seen as "semaphore released too many times" in a
    nanny). Forget it, so the first semaphore starts this process's own tracker."""
    module = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(module, "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_fd", None) is not None:
        tracker._fd = tracker._pid = None


def start_fresh(command: list[str], log: IO[bytes], write_fd: int) -> None:
    """``command --ready-fd FD`` in a new interpreter and session (where forking is unsafe),
    output to ``log``; it reports on ``write_fd`` as a forked child would."""
    subprocess.Popen(
        [*command, "--ready-fd", str(write_fd)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        pass_fds=(write_fd,),
        start_new_session=True,
        close_fds=True,
    )


def _start_fresh_supervisor(profile: ProfileCommon, name: str, directory: Path) -> int:
    """A supervisor in a new interpreter, reading the saved profile; the read end of its
    readiness pipe."""
    from clusterkit.lifecycle.supervisor import LOG_NAME, save_profile

    save_profile(directory, profile)
    command = [sys.executable, "-m", "clusterkit.lifecycle.supervisor", "--name", name]
    read_fd, write_fd = os.pipe()
    try:
        with open(directory / LOG_NAME, "ab") as log:
            start_fresh(command, log, write_fd)
    finally:
        os.close(write_fd)
    return read_fd


def _read_reply(fd: int, timeout: float) -> tuple[int | None, dict[str, Any] | None]:
    """(supervisor pid, its final reply); the reply is None on silence or death."""
    deadline = time.monotonic() + timeout
    buffer, pid = b"", None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # every writer is gone: the supervisor exited
            break
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            if "ok" in message:
                return pid, message
            pid = int(message["pid"])
    return pid, None


def _start_failure(
    reply: dict[str, Any] | None, directory: Path, waited: float | None
) -> Exception:
    """The supervisor's own account of its failure; ``waited``: the limit it ran past, or None
    when it exited without one."""
    from clusterkit import errors
    from clusterkit.lifecycle.supervisor import log_tail

    evidence = (reply or {}).get("evidence") or log_tail(directory)
    if reply is None:
        return ClusterStartError(
            "exited before the cluster was ready"
            if waited is None
            else f"gave no answer within {waited:.0f}s",
            component="supervisor",
            evidence=evidence,
        )
    kind = getattr(errors, str(reply.get("type")), None)
    message = str(reply.get("message"))
    if isinstance(kind, type) and issubclass(kind, errors.BadInput):
        error: ClusterkitError = errors.BadInput(message, hint=reply.get("hint"))
        error.exit_code = kind.exit_code
        return error
    component = str(reply.get("component") or "supervisor")
    message = message.removeprefix(f"{component}: ")
    return ClusterStartError(
        message, component=component, evidence=evidence, hint=reply.get("hint")
    )


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    for process in psutil.process_iter(["status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(process.pid) == pgid:
                return True
    return False


def kill_group(pgid: int, grace: float) -> None:
    """SIGTERM a process group, then SIGKILL what is left after ``grace`` seconds."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def stop_supervisor(pid: int, timeout: float) -> None:
    """SIGTERM the supervisor, wait for its graceful close, then end its process group."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
    # workers the supervisor started share its process group; none may outlive it
    kill_group(pid, grace=2.0 if pid_alive(pid) else 3.0)
