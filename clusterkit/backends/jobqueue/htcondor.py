"""The htcondor backend: HTCondor pools via dask-jobqueue's HTCondorCluster.

The job is a submit description, not a shell script: ``job_extra`` lines are submit commands
(``key = value``), the cluster's job name is the ``batch_name``, GPUs are ``request_gpus``,
``account`` is the ``accounting_group``, and the walltime becomes a ``periodic_remove``
expression (HTCondor has no walltime of its own). Not run against a live pool here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from clusterkit.backends.jobqueue.cluster import drained
from clusterkit.backends.jobqueue.commands import JobInfo, run_command
from clusterkit.backends.jobqueue.core import JobQueueBackend
from clusterkit.schema import HTCondorProfile
from clusterkit.units import walltime_seconds

if TYPE_CHECKING:
    from clusterkit.schema import JobQueueProfile
    from clusterkit.security import ClusterSecurity

#: condor_q's JobStatus codes
STATES = {
    "1": "Idle",
    "2": "Running",
    "3": "Removed",
    "4": "Completed",
    "5": "Held",
    "6": "Transferring",
    "7": "Suspended",
}


def parse_condor_q(text: str) -> dict[str, JobInfo]:
    """``condor_q -af:j JobStatus RemoteHost HoldReason`` lines (``undefined`` when unset)."""
    found = {}
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3:
            continue
        job_id, status, host = parts[:3]
        reason = parts[3] if len(parts) > 3 and parts[3] != "undefined" else ""
        state = STATES.get(status, status)
        if state in {"Removed", "Completed"}:
            continue
        found[job_id] = JobInfo(job_id, state, reason, "" if host == "undefined" else host)
    return found


class HTCondorQueue:
    """condor_q / condor_rm."""

    system = "htcondor"
    cancel_command = "condor_rm"

    def named(self, job_name: str) -> list[str]:
        """Ids (cluster.proc) of this user's jobs with that batch name."""
        constraint = f'JobBatchName == "{job_name}"'
        done = run_command(["condor_q", "-constraint", constraint, "-af:j", "JobStatus"])
        return (
            [line.split()[0] for line in done.stdout.splitlines()] if done and done.stdout else []
        )

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        wanted = sorted({str(j) for j in job_ids if j})
        if not wanted:
            return {}
        done = run_command(["condor_q", *wanted, "-af:j", "JobStatus", "RemoteHost", "HoldReason"])
        if done is None or done.returncode != 0:
            return {}
        return {k: v for k, v in parse_condor_q(done.stdout).items() if k in wanted}

    def queue_exists(self, name: str) -> bool | None:
        return None  # HTCondor matches machines, it has no queues

    def stderr_path(self, job_id: str) -> str | None:
        done = run_command(["condor_q", str(job_id), "-af", "Err"])
        path = done.stdout.strip() if done is not None and done.returncode == 0 else ""
        return path if path and path not in {"undefined", "/dev/null"} else None

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            run_command(["condor_rm", *job_ids])

    def stranded(self, jobs: dict[str, JobInfo]) -> dict[str, str]:
        """Jobs held in the queue by a node that stopped answering: not known here."""
        return {}


class HTCondorBackend(JobQueueBackend):
    """Workers in HTCondor jobs (dask_jobqueue.HTCondorCluster)."""

    NAME = "htcondor"
    Profile = HTCondorProfile
    JOB_NAME_LIMIT = 64
    QUEUE = HTCondorQueue()
    LOG_PATTERN = "worker-*.err"

    def job_class(self) -> type[Any]:
        from dask_jobqueue.htcondor import HTCondorJob

        return HTCondorJob

    def cluster_class(self) -> type[Any]:
        from dask_jobqueue import HTCondorCluster

        return drained(HTCondorCluster, self.QUEUE)

    def job_options(
        self, profile: JobQueueProfile, security: ClusterSecurity, job_name: str
    ) -> dict[str, Any]:
        assert isinstance(profile, HTCondorProfile)
        kwargs = super().job_options(profile, security, job_name)
        del kwargs["queue"]
        account, walltime = kwargs.pop("account"), kwargs.pop("walltime")
        commands: dict[str, Any] = {"batch_name": job_name}
        gpus = profile.worker.gpus * profile.processes
        if gpus:
            commands["request_gpus"] = gpus
        if account:
            commands["accounting_group"] = account
        limit = walltime_seconds(walltime)
        commands["periodic_remove"] = (
            f"(JobStatus == 2) && (time() - EnteredCurrentStatus > {limit})"
        )
        for line in kwargs["job_extra_directives"]:
            key, _, value = line.partition("=")
            commands[key.strip()] = value.strip()
        kwargs["job_extra_directives"] = commands
        kwargs["disk"] = str(profile.disk)
        return kwargs

    def log_in(self, directory: str, job_name: str, job_id: str) -> str:
        return os.path.join(directory, f"worker-{job_id}.err")  # HTCondorJob's Error
