"""A supervisor forked at the start of ``up``, before the profile is read.

``up`` spends its first few hundred milliseconds on work the supervisor does not need done
first: the CLI, the profile's schema and validation, the name's lock. The supervisor's own
first cost is independent of all that: importing distributed. Forked before the profile is
loaded, the daemon pays its imports on the second core while ``up`` validates and makes the
cluster's certificates, then gets the profile and certificates through a pipe. If ``up`` fails
or dies before sending them, the pipe closes empty and the daemon exits having started nothing.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.lifecycle import spawn

if TYPE_CHECKING:
    from clusterkit.schema import ProfileCommon
    from clusterkit.state import ClusterRecord


def _preimport() -> None:
    """What every supervisor imports, whatever the profile: paid before the profile arrives."""
    import distributed  # noqa: F401

    import clusterkit.backends.local  # the default backend
    import clusterkit.lifecycle.supervisor
    import clusterkit.schema  # noqa: F401 - to unpickle the profile


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


class EarlySupervisor:
    """A daemon that waits, imports paid, for the profile it will supervise."""

    def __init__(self) -> None:
        self._go_read, self._go_write = os.pipe()
        self._ready_read, self._ready_write = os.pipe()
        spawn.double_fork(self._daemon)
        os.close(self._go_read)
        os.close(self._ready_write)
        self._sent = False

    def _daemon(self) -> int:
        os.close(self._go_write)
        os.close(self._ready_read)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # quiet until the cluster's log is known: `up` owns the terminal
            os.dup2(null, fd)
        _preimport()
        message = _read_all(self._go_read)
        os.close(self._go_read)
        if not message:
            return 0  # `up` stopped before a profile was ready: nothing was started
        name, directory, profile, security = pickle.loads(message)
        from clusterkit.backends.base import backend_for

        spawn.preimport(backend_for(profile))
        # what the imports made goes to the collector's permanent generation, as `up` does
        # before its own fork: the supervisor's collections then never walk it
        gc.freeze()
        return spawn.serve(name, profile, directory, self._ready_write, security)

    def launch(
        self,
        profile: ProfileCommon,
        name: str,
        directory: Path,
        waiting: contextlib.AbstractContextManager[Any],
    ) -> ClusterRecord:
        """Hand the daemon its cluster; its record once the cluster is ready (else
        ClusterStartError, with the daemon's process group ended). The cluster's certificates
        are made here, while the daemon still imports."""
        from clusterkit.lifecycle.start import security_hostnames
        from clusterkit.security import prepare

        security = prepare(profile, directory, security_hostnames(profile))
        message = pickle.dumps((name, directory, profile, security))
        with os.fdopen(self._go_write, "wb") as pipe:
            self._sent = True
            pipe.write(message)
        return spawn.await_ready(profile, directory, self._ready_read, waiting)

    def cancel(self) -> None:
        """No cluster for the daemon: it exits once its imports are done."""
        if not self._sent:
            self._sent = True
            os.close(self._go_write)
            os.close(self._ready_read)


_pending: list[EarlySupervisor] = []


def prefork() -> None:
    """Fork the daemon now, if forking is safe: the CLI's ``up`` calls this before its own
    imports, so that they too overlap with the daemon's."""
    if not _pending and spawn.can_fork():
        _pending.append(EarlySupervisor())


def take() -> EarlySupervisor | None:
    """The daemon forked by :func:`prefork`, or one forked now; None where forking is unsafe."""
    prefork()
    return _pending.pop() if _pending else None
