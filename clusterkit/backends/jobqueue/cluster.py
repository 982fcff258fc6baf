"""dask-jobqueue clusters whose close also makes sure the batch queue holds none of their jobs.

Imported only inside the backend's ``create`` (it imports dask_jobqueue).
"""

from __future__ import annotations

import logging
from typing import Any

from dask_jobqueue import HTCondorCluster, PBSCluster, SGECluster, SLURMCluster

from clusterkit.backends.jobqueue.batch import BatchQueue, PBSQueue, SlurmQueue, cancel_and_wait
from clusterkit.backends.jobqueue.htcondor import HTCondorQueue
from clusterkit.backends.jobqueue.sge import SGEQueue

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


class _DrainOnClose:
    """Mixin: replace jobs that ended; on close, wait until the queue no longer lists any job.

    SpecCluster forgets a job whose worker left (``lost-worker-timeout`` later) but keeps its
    spec; only a later ``_correct_state`` submits the replacement, and neither a fixed size nor
    a steady ``adapt`` target calls it. A periodic check does, so workers that reach their
    lifetime before the walltime are replaced while the others keep working.
    """

    system: str
    queue: BatchQueue

    async def _start(self) -> None:
        from tornado.ioloop import PeriodicCallback

        await super()._start()  # type: ignore[misc]
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
        if left:
            logger.error("jobs still in the %s queue after close: %s", self.system, left)
            self.jobs_left = left


class ClusterkitSLURMCluster(_DrainOnClose, SLURMCluster):
    system = "slurm"
    queue = SlurmQueue()


class ClusterkitPBSCluster(_DrainOnClose, PBSCluster):
    system = "pbs"
    queue = PBSQueue()


class ClusterkitSGECluster(_DrainOnClose, SGECluster):
    system = "sge"
    queue = SGEQueue()


class ClusterkitHTCondorCluster(_DrainOnClose, HTCondorCluster):
    system = "htcondor"
    queue = HTCondorQueue()
