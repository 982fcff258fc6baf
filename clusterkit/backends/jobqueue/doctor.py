"""Doctor checks of a batch-system (dask-jobqueue) profile."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from clusterkit.backends.base import Check
from clusterkit.backends.jobqueue.jobs import scheduler_host
from clusterkit.backends.options import LOOPBACK

if TYPE_CHECKING:
    from clusterkit.backends.jobqueue.backend import JobQueueBackend
    from clusterkit.schema import JobQueueProfile


def doctor(backend: JobQueueBackend, profile: JobQueueProfile) -> list[Check]:
    """The submit command on PATH, where the scheduler binds, and the queue exists."""
    submit_command = backend.job_class().submit_command
    checks = [
        Check(
            f"{submit_command} on PATH",
            ok=shutil.which(submit_command) is not None,
            detail=shutil.which(submit_command) or "not found",
            fix=f"run on a {backend.NAME.upper()} login node (or load its module)",
        )
    ]
    if scheduler_host(profile) == LOOPBACK:
        checks.append(
            Check(
                "scheduler reachable from compute nodes",
                ok=True,
                detail="scheduler binds 127.0.0.1: only jobs on this host can reach it",
                fix="set interface (e.g. ib0) or scheduler.host for a multi-node site",
            )
        )
    queue = backend.QUEUE
    if profile.queue and shutil.which(submit_command):
        known = queue.queue_exists(profile.queue)
        if known is not None:
            checks.append(
                Check(
                    f"{backend.NAME} queue '{profile.queue}'",
                    ok=known,
                    detail="exists" if known else "the batch system does not know it",
                    fix=f"set queue to one listed by {backend.QUEUE_HINT}",
                )
            )
    return checks
