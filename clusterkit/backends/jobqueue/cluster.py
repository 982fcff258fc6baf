"""The job/cluster base of every batch system: submitting a cluster's jobs, replacing jobs that
ended, and a close that waits until the batch queue holds none of the cluster's jobs.

A batch system's cluster class is dask-jobqueue's with ``DrainOnClose`` mixed in
(``drained(SLURMCluster, queue)``); made on first use, so importing a backend imports no
dask-jobqueue.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from clusterkit.backends.jobqueue.commands import BatchQueue, cancel_and_wait
from clusterkit.errors import ClusterStartError

logger = logging.getLogger(__name__)

#: Seconds close() waits for cancelled jobs to leave the queue.
DRAIN_TIMEOUT = 30.0
#: Seconds between checks for jobs that ended (walltime, lifetime) and need a replacement.
REPLACE_INTERVAL = 2.0


def job_ids(cluster: Any, *, current: bool = False) -> list[str]:
    """Ids of the jobs the cluster tracks now, or (default) of every job it ever submitted."""
    seen: set[str] = getattr(cluster, "_clusterkit_job_ids", set())
    now = {
        str(job.job_id)
        for job in list(getattr(cluster, "workers", {}).values())
        if getattr(job, "job_id", None)
    }
    seen |= now
    cluster._clusterkit_job_ids = seen
    return sorted(now if current else seen, key=lambda j: (len(j), j))


class DrainOnClose:
    """Mixin: replace jobs that ended; record workers lost (``losses``); on close, wait until
    the queue no longer lists any job.

    SpecCluster forgets a job whose worker left (``lost-worker-timeout`` later) but keeps its
    spec; only a later ``_correct_state`` submits the replacement, and neither a fixed size nor
    a steady ``adapt`` target calls it. A periodic check does, so workers that reach their
    lifetime before the walltime are replaced while the others keep working.
    """

    system: str
    queue: BatchQueue

    async def _start(self) -> None:
        from tornado.ioloop import PeriodicCallback

        from clusterkit.backends.jobqueue.losses import LostWorkers

        await super()._start()  # type: ignore[misc]
        scheduler = self.scheduler  # type: ignore[attr-defined]
        scheduler.add_plugin(LostWorkers(self, self.queue), name=LostWorkers.name)
        self._replacer = PeriodicCallback(self._replace_ended_jobs, REPLACE_INTERVAL * 1000)
        self._replacer.start()

    def _replace_ended_jobs(self) -> None:
        spec, workers = self.worker_spec, self.workers  # type: ignore[attr-defined]
        if self.status.name == "running" and set(spec) - set(workers):  # type: ignore[attr-defined]
            self._correct_state()  # type: ignore[attr-defined]

    async def _correct_state_internal(self) -> None:
        await super()._correct_state_internal()  # type: ignore[misc]
        job_ids(self)  # remember ids before jobs that ended are dropped from `workers`

    async def _close(self) -> None:
        replacer = getattr(self, "_replacer", None)
        if replacer is not None:
            replacer.stop()
        ids = job_ids(self)
        await super()._close()  # type: ignore[misc]
        if not ids:
            return
        import asyncio

        left = await asyncio.get_running_loop().run_in_executor(
            None, cancel_and_wait, self.queue, ids, DRAIN_TIMEOUT
        )
        stranded = self.queue.stranded(self.queue.jobs(left)) if left else {}
        for job_id, why in sorted(stranded.items()):
            text = "job %s stays in the %s queue as COMPLETING: %s; it leaves when the node is back"
            logger.warning(text, job_id, self.system, why)
        left = [job for job in left if job not in stranded]
        if left:
            logger.error("jobs still in the %s queue after close: %s", self.system, left)
            self.jobs_left = left


@functools.cache
def drained(base: type[Any], queue: BatchQueue) -> type[Any]:
    """``Clusterkit<base>``: a dask-jobqueue cluster class with DrainOnClose mixed in, made on
    first use (a batch system's module then imports dask-jobqueue only when a cluster is made)
    and named after the module of the batch system's queue commands."""
    namespace = {"system": queue.system, "queue": queue, "__module__": type(queue).__module__}
    return type(f"Clusterkit{base.__name__}", (DrainOnClose, base), namespace)


def submit(cluster: Any, workers: int) -> None:
    """Submit jobs for ``workers`` workers now; a rejected submission raises ClusterStartError."""
    try:
        cluster.sync(_submit_now, cluster, workers)
    except RuntimeError as error:
        text = str(error)
        stderr = text.split("stderr:", 1)[1] if "stderr:" in text else text
        lines = [line for line in stderr.splitlines() if line.strip()]
        first = lines[0] if lines else text.strip()
        raise ClusterStartError(
            f"the batch system rejected the job: {first}",
            component=f"{getattr(cluster, 'system', 'batch')} job submission",
            evidence=lines[-12:],
            hint="check queue/partition, account, walltime, cores and memory in the profile",
        ) from error


async def _submit_now(cluster: Any, workers: int) -> None:
    # scale() only schedules the submission; awaiting it here (in the loop, before that
    # callback runs) makes this call the one that submits, so a Job's failure reaches us
    from distributed.core import Status

    cluster.scale(workers)
    try:
        await cluster._correct_state()
    except Exception:
        for job in cluster._created:  # never submitted: let SpecCluster's close accept them
            if job.status == Status.created:
                job.status = Status.failed
        raise
