"""``start_cluster``: the one way a profile becomes a running cluster.

The supervisor (``up``), a DETACHED ``up`` (Kubernetes) and an embedded ``get_client()`` all
call it, so the deadline, the evidence in the message and the cleanup after a failed start are
the same on every path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit import state
from clusterkit.backends.base import Backend, backend_for
from clusterkit.errors import ClusterkitError, ClusterStartError
from clusterkit.security import ClusterSecurity, prepare
from clusterkit.state import ClusterRecord

if TYPE_CHECKING:
    from distributed.deploy.adaptive import Adaptive

    from clusterkit.schema import ProfileCommon

logger = logging.getLogger(__name__)

POLL = 0.1


@dataclass
class Started:
    """A cluster that reached its minimum workers, with what is needed to run and stop it."""

    name: str
    profile: ProfileCommon
    backend: Backend
    security: ClusterSecurity
    cluster: Any
    adaptive: Adaptive | None = None
    bounds: tuple[int, int] = (0, 0)

    @property
    def address(self) -> str:
        return str(self.cluster.scheduler_address)

    def record(self, *, pid: int | None, control: str | None = None) -> ClusterRecord:
        """The record that lets any process find and reach this cluster."""
        scheduler = getattr(self.profile, "scheduler", None)
        dashboard = None
        if scheduler is None or scheduler.dashboard:
            dashboard = getattr(self.cluster, "dashboard_link", None)
        return ClusterRecord(
            name=self.name,
            backend=self.profile.backend_name,
            profile=self.profile.name,
            profile_source=self.profile.source,
            digest=self.profile.digest(),
            address=self.address,
            dashboard=dashboard,
            pid=pid,
            security=self.security.to_dict(),
            min_workers=self.profile.min_workers,
            control=control,
            extra=self.backend.record_extra(self.cluster, self.profile),
        )

    def scale(self, n: int) -> None:
        """A fixed size; it ends adaptive scaling, as dask's own widget does."""
        self.stop_adapting()
        self.cluster.scale(n)

    def adapt(self, minimum: int, maximum: int) -> None:
        self.adaptive = self.cluster.adapt(minimum=minimum, maximum=maximum)
        self.bounds = (minimum, maximum)

    @property
    def mode(self) -> str:
        """``adaptive MIN..MAX`` or ``fixed``."""
        return f"adaptive {self.bounds[0]}..{self.bounds[1]}" if self.adaptive else "fixed"

    def stop_adapting(self) -> bool:
        """End adaptive scaling; whether it was on."""
        if self.adaptive is None:
            return False
        self.adaptive.stop()
        self.adaptive = None
        return True

    def close(self) -> None:
        """Stop everything this cluster started."""
        self.stop_adapting()
        self.backend.destroy(self.cluster, self.profile)

    def release(self) -> None:
        """Let go of a DETACHED cluster that keeps running without us."""
        self.backend.release(self.cluster, self.profile)


class Claim:
    """The record of a cluster this process starts outside itself (Kubernetes, other machines,
    a batch system), written before anything is created there and owned by this process (a
    supervisor's claim names it as the supervisor). If the process dies mid-start, ``ls`` lists
    the cluster as dead and ``down`` tears down what was made, by the identity it was made
    under."""

    def __init__(self, profile: ProfileCommon, name: str, *, supervisor: bool = False) -> None:
        self.profile = profile
        self.record = ClusterRecord(
            name=name,
            backend=profile.backend_name,
            profile=profile.name,
            profile_source=profile.source,
            digest=profile.digest(),
            address="",
            dashboard=None,
            pid=os.getpid() if supervisor else None,
            security={},
            min_workers=profile.min_workers,
            owner=None if supervisor else os.getpid(),
        )
        state.write_record(self.record)

    def identified(self, identity: dict[str, Any]) -> None:
        """The backend's identity of the cluster, chosen before anything is created."""
        if identity:
            self.record.extra = dict(identity)
            state.write_record(self.record)

    def created(self, cluster: Any) -> None:
        """Add the backend's identity of the cluster (job name, tags) as soon as it exists."""
        backend = backend_for(self.profile)
        self.record.extra = backend.record_extra(cluster, self.profile)
        state.write_record(self.record)

    def withdraw(self) -> None:
        """After a start that failed and tore down what it made: drop the claim (only the
        record: the cluster's directory holds the log that explains the failure)."""
        current = state.read_record(self.record.name)
        if current is not None and current.starting:
            state.record_path(self.record.name).unlink(missing_ok=True)


def wait_for_workers(
    cluster: Any, minimum: int, deadline: float, stopping: threading.Event | None = None
) -> None:
    """Block until ``minimum`` workers joined, or raise ClusterStartError at the deadline
    (ClusterkitError once ``stopping`` is set: a `down` of a cluster still starting)."""
    while True:
        joined = len(cluster.scheduler_info.get("workers", {}))
        if joined >= minimum:
            return
        if stopping is not None and stopping.is_set():
            raise ClusterkitError(f"stopped while starting ({joined} of {minimum} workers)")
        if time.monotonic() > deadline:
            raise ClusterStartError(
                f"{joined} of {minimum} workers joined before the start timeout",
                component="workers",
            )
        time.sleep(POLL)


def security_hostnames(profile: ProfileCommon) -> list[str]:
    """Names the cluster's TLS certificate must cover."""
    hosts = [getattr(profile, "scheduler_host", None), *getattr(profile, "hosts", [])]
    scheduler = getattr(profile, "scheduler", None)
    if scheduler is not None and scheduler.host:
        hosts.append(scheduler.host)
    return [h for h in hosts if h]


def start_cluster(
    profile: ProfileCommon,
    *,
    name: str,
    security_dir: Path | None,
    claim: Claim | None = None,
    prepared: ClusterSecurity | None = None,
    stopping: threading.Event | None = None,
) -> Started:
    """Prepare security (unless ``prepared``), create the cluster, wait for its minimum
    workers (or until ``stopping`` is set), start adapting.

    On any failure, the backend's evidence is collected (its first line joins the message),
    everything that started is torn down, and ClusterStartError is raised. A ``claim`` gets
    the backend's identity of the cluster before it is created and once it exists.
    """
    backend = backend_for(profile)
    security = prepared or prepare(profile, security_dir, security_hostnames(profile))
    security.apply_env()
    deadline = time.monotonic() + profile.start_timeout
    identity = backend.identity(profile, name)
    if claim is not None:
        claim.identified(identity)
    chosen = {"identity": identity} if identity else {}  # backends without one take no such arg
    cluster = backend.create(profile, security, name=name, **chosen)
    started = Started(name, profile, backend, security, cluster)
    try:
        if claim is not None:
            claim.created(cluster)
        wait_for_workers(cluster, profile.min_workers, deadline, stopping)
        adapt = profile.adapt_spec
        if adapt is not None:
            started.adapt(adapt.minimum, adapt.maximum)
    except BaseException as error:
        failure = _with_evidence(error, started) if isinstance(error, ClusterStartError) else None
        _close_quietly(started)
        if failure is not None:
            raise failure from None
        raise
    return started


def _with_evidence(error: ClusterStartError, started: Started) -> ClusterStartError:
    """The same error, with the backend's account of why (its first line in the message)."""
    try:
        evidence = started.backend.evidence(started.cluster, started.profile)
    except Exception as failure:  # evidence is best effort: never hide the start error
        logger.warning("collecting evidence failed: %s", failure)
        evidence = []
    reason = f"; {evidence[0].strip()}" if evidence else ""
    return ClusterStartError(
        f"{error.message.removeprefix(error.component + ': ')}{reason}",
        component=error.component,
        evidence=evidence or error.evidence,
        hint=error.hint,
    )


def _close_quietly(started: Started) -> None:
    try:
        started.close()
    except Exception:
        logger.exception("closing the cluster after a failed start")
