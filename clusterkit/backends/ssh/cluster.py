"""distributed's SSH scheduler/worker processes in a SpecCluster that keeps evidence and cleans up.

``distributed.deploy.ssh.SSHCluster`` is a function that builds a ``SpecCluster`` from its
``Scheduler`` and ``Worker`` process classes with one option set for every host. This module
builds the same spec with per-host worker options (so each worker binds its own address), a
start deadline, per-host stderr kept as evidence, and a close that also removes the cluster's
remote files and any process of it that outlived the SSH channel.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from distributed.deploy import ssh
from distributed.deploy.spec import SpecCluster

from clusterkit.backends.ssh import remote as ssh_remote
from clusterkit.backends.ssh.spec import Plan

logger = logging.getLogger(__name__)

_HOST: contextvars.ContextVar[str | None] = contextvars.ContextVar("ssh_host", default=None)


@dataclass
class StartLog:
    """Remote stderr lines per host, and the failures met while starting."""

    deadline: float
    lines: dict[str, collections.deque[str]] = field(
        default_factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=40))
    )
    failures: list[tuple[str, str, str]] = field(default_factory=list)  # host, role, reason

    def remaining(self) -> float:
        return max(0.1, self.deadline - time.monotonic())


class _StderrCapture(logging.Filter):
    """distributed logs each remote stderr line it reads at start (INFO): keep them per host.

    A filter on distributed's ssh logger, so that lowering that logger to INFO (needed to see
    the lines) shows nothing more to the user than their own logging settings would.
    """

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, StartLog] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        tag = _HOST.get()
        if tag is not None:
            log_id, _, host = tag.partition("|")
            log = self.logs.get(log_id)
            if log is not None:
                log.lines[host].append(record.getMessage())
        parent = _ssh_logger.parent
        return parent is None or record.levelno >= parent.getEffectiveLevel()


_CAPTURE = _StderrCapture()
_ssh_logger = logging.getLogger(ssh.__name__)
_ssh_logger.addFilter(_CAPTURE)
_ssh_logger.setLevel(logging.INFO)


async def _start_with_evidence(process: Any, role: str, log_id: str) -> None:
    log = _CAPTURE.logs[log_id]
    _HOST.set(f"{log_id}|{process.address}")
    try:
        await asyncio.wait_for(super(type(process), process).start(), log.remaining())
    except Exception as error:
        if isinstance(error, asyncio.TimeoutError):
            reason = "no answer before the start timeout"
        elif "failed to start" in str(error):
            reason = f"the remote {role} exited"
        else:
            reason = ssh_remote.describe_error(error)
        log.failures.append((process.address, role, reason))
        raise


class Scheduler(ssh.Scheduler):
    def __init__(self, *, log_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log_id = log_id

    async def start(self) -> None:
        await _start_with_evidence(self, "scheduler", self.log_id)


class Worker(ssh.Worker):
    def __init__(self, scheduler: str, *, log_id: str, **kwargs: Any) -> None:
        super().__init__(scheduler, **kwargs)
        self.log_id = log_id
        if self.n_workers == 1 and self.name is not None:
            # lets SpecCluster match dask workers to its spec (retire the right one on scale)
            self.kwargs.setdefault("name", self.name)

    async def start(self) -> None:
        await _start_with_evidence(self, "worker", self.log_id)


class ClusterkitSSHCluster(SpecCluster):
    """A SpecCluster of distributed's SSH processes: evidence on failure, nothing left behind."""

    def __init__(self, plan: Plan, cluster_id: str, start_log: StartLog, **kwargs: Any) -> None:
        self.ssh_plan = plan
        self.cluster_id = cluster_id
        self.start_log = start_log
        _CAPTURE.logs[cluster_id] = start_log
        self._cleaned = False
        self._next_host = itertools.cycle(plan.worker_hosts)
        scheduler = {
            "cls": Scheduler,
            "options": {
                "address": plan.scheduler_host,
                "connect_options": plan.connect_options,
                "kwargs": plan.scheduler_options,
                "remote_python": plan.python_command(plan.scheduler_host),
                "log_id": cluster_id,
            },
        }
        hosts = range(len(plan.worker_hosts))
        workers = {i: self._worker_spec(next(self._next_host)) for i in hosts}
        super().__init__(workers, scheduler, name="SSHCluster", **kwargs)

    def _worker_spec(self, host: str) -> dict[str, Any]:
        return {
            "cls": Worker,
            "options": {
                "address": host,
                "connect_options": self.ssh_plan.connect_options,
                "kwargs": self.ssh_plan.worker_options[host],
                "worker_class": self.ssh_plan.worker_class,
                "remote_python": self.ssh_plan.python_command(host),
                "log_id": self.cluster_id,
            },
        }

    def new_worker_spec(self) -> dict[Any, dict[str, Any]]:
        """Scaling up adds one spec entry on the next host, round robin."""
        name = self._new_worker_name(self._i)
        while name in self.worker_spec:
            self._i += 1
            name = self._new_worker_name(self._i)
        return {name: self._worker_spec(next(self._next_host))}

    @property  # SpecCluster declares it as a plain attribute
    def _supports_scaling(self) -> bool:  # type: ignore[override]
        return True

    async def _close(self) -> None:
        try:
            await super()._close()
        finally:
            if not self._cleaned:
                self._cleaned = True
                # stragglers that outlived their SSH channel, and the TLS directory
                options = dict(self.ssh_plan.connect_options)
                results = await ssh_remote.cleanup(self.ssh_plan.hosts, options, self.cluster_id)
                for result in results:
                    if not result.ok:
                        logger.warning("cleanup on %s failed: %s", result.host, result.reason)
                _CAPTURE.logs.pop(self.cluster_id, None)

    def evidence(self) -> list[str]:
        """Remote stderr tails, host by host."""
        out: list[str] = []
        for host, lines in self.start_log.lines.items():
            out.extend(f"[{host}] {line}" for line in list(lines)[-ssh_remote.TAIL :])
        return out
