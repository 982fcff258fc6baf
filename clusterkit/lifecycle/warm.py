"""A supervisor forked before ``up`` reads the profile, to pay its imports meanwhile.

``up`` spends its first tenth of a second or more on the profile (the schema, validation, the
lock, the certificates) and the supervisor a quarter of a second on importing distributed.
Forked first, the supervisor imports on another core while ``up`` does its part, then takes
the job from a pipe: the name, the profile and the certificates ``up`` made. If no job comes
(a bad profile, a cluster already up), it exits without having touched anything; ``up`` also
kills it, so nothing it started outlives the command that failed.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import sys
import types
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clusterkit.lifecycle.spawn import can_fork, double_fork, redirect_stdio

if TYPE_CHECKING:
    from pathlib import Path

    from clusterkit.schema import ProfileCommon


@dataclass
class WarmSupervisor:
    """The parent's side: the job pipe to write, the readiness pipe to read."""

    job_fd: int
    reply_fd: int
    handed: bool = False

    @classmethod
    def fork(cls) -> WarmSupervisor | None:
        """A supervisor importing in the background, or None where forking is unsafe."""
        if not can_fork():
            return None
        job_read, job_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            double_fork(lambda: _warm_child(job_read, reply_write))
        finally:
            os.close(job_read)
            os.close(reply_write)
        return cls(job_write, reply_read)

    def hand_over(self, name: str, profile: ProfileCommon, directory: Path) -> int:
        """Make the cluster's certificates here, send the job; the readiness pipe's fd."""
        from clusterkit.lifecycle.start import security_hostnames
        from clusterkit.security import prepare

        security = prepare(profile, directory, security_hostnames(profile))
        payload = pickle.dumps((name, profile, security))
        self.handed = True  # from here the child has the job (or, cut short, fails on it)
        with os.fdopen(self.job_fd, "wb") as job:
            job.write(payload)
        return self.reply_fd

    def cancel(self) -> None:
        """No job after all: close the pipe and end the child now (it has started nothing)."""
        if self.handed:
            return
        self.handed = True
        with suppress(OSError):
            os.close(self.job_fd)
        pid = _first_pid(self.reply_fd, timeout=5.0)
        os.close(self.reply_fd)
        if pid is not None:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _first_pid(fd: int, timeout: float) -> int | None:
    """The pid the child reports first thing on the readiness pipe (None if it never does)."""
    ready, _, _ = select.select([fd], [], [], timeout)
    line = os.read(fd, 4096).split(b"\n", 1)[0] if ready else b""
    try:
        return int(json.loads(line)["pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _warm_child(job_fd: int, reply_fd: int) -> int:
    """The supervisor's life when forked early: import, wait for the job, run it."""
    os.write(reply_fd, json.dumps({"pid": os.getpid()}).encode() + b"\n")
    redirect_stdio(None, keep=(job_fd, reply_fd))
    sys.modules["__main__"] = types.ModuleType("__main__")  # spawned workers re-import it
    try:
        import distributed  # noqa: F401
    except BaseException as error:  # reported once there is a job to report it on
        failed: BaseException | None = error
    else:
        failed = None
    with os.fdopen(job_fd, "rb") as job:
        payload = job.read()
    if not payload:
        return 0
    name, profile, security = pickle.loads(payload)  # imports the schema
    from clusterkit import state
    from clusterkit.lifecycle import supervisor

    directory = state.cluster_dir(name)
    _log_to(directory / supervisor.LOG_NAME)
    if failed is not None:
        supervisor.report(reply_fd, {"ok": False, **supervisor.failure(failed, directory)})
        return 1
    from clusterkit.backends.base import backend_for
    from clusterkit.lifecycle.spawn import preimport

    preimport(backend_for(profile))
    return supervisor.run(name, profile, reply_fd, security=security)


def _log_to(log: Path) -> None:
    """stdout and stderr (until now /dev/null) to the supervisor's log."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
