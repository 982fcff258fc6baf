"""The pbs backend: PBS Pro, OpenPBS and Torque via dask-jobqueue's PBSCluster, walltime-aware;
its queue commands (qselect, qstat, qdel), its backend (GPUs in the select statement) and its
cluster class."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterkit.backends.jobqueue.cluster import drained
from clusterkit.backends.jobqueue.commands import JobInfo, run_command
from clusterkit.backends.jobqueue.core import JobQueueBackend
from clusterkit.backends.jobqueue.jobs import hms
from clusterkit.schema import PBSProfile

if TYPE_CHECKING:
    from clusterkit.schema import JobQueueProfile
    from clusterkit.security import ClusterSecurity


class PBSQueue:
    """qstat / qdel (PBS Pro, OpenPBS, Torque: `qstat -f` blocks of `key = value`)."""

    system = "pbs"
    cancel_command = "qdel"

    def job_here(self, environ: Mapping[str, str]) -> str | None:
        """The id of the job this process runs in (``PBS_JOBID``: ``1234.server``)."""
        return environ.get("PBS_JOBID") or None

    def start_command(self, job_id: str) -> list[str]:
        return ["qstat", "-f", job_id]

    def parse_start(self, text: str) -> float | None:
        """``qstat -f``'s ``stime`` (PBS Pro, OpenPBS) or ``start_time`` (Torque), local time
        as ``Tue May  7 09:31:21 2019``; None before the job started."""
        from datetime import datetime

        fields = qstat_fields(text)
        value = fields.get("stime") or fields.get("start_time")
        if not value:
            return None
        if value.isdigit():  # Torque before 2.5: seconds since the epoch
            return float(value)
        try:
            return datetime.strptime(" ".join(value.split()), "%a %b %d %H:%M:%S %Y").timestamp()
        except ValueError:
            return None

    def named(self, job_name: str) -> list[str]:
        """Ids of this user's jobs with that name."""
        import getpass

        done = run_command(["qselect", "-N", job_name, "-u", getpass.getuser()])
        return done.stdout.split() if done is not None and done.returncode == 0 else []

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        found: dict[str, JobInfo] = {}
        for job_id in {str(j) for j in job_ids if j}:
            done = run_command(["qstat", "-f", job_id])
            if done is None or done.returncode != 0:
                continue  # finished jobs are unknown to qstat without -x
            info = parse_qstat_full(job_id, done.stdout)
            if info.state not in {"F", "C"}:  # finished (PBS Pro), completed (Torque)
                found[job_id] = info
        return found

    def queue_exists(self, name: str) -> bool | None:
        """Whether the queue exists (None when qstat cannot answer at all)."""
        done = run_command(["qstat", "-Q", name])
        if done is None:
            return None
        return done.returncode == 0

    def stderr_path(self, job_id: str) -> str | None:
        done = run_command(["qstat", "-f", str(job_id)])
        if done is None or done.returncode != 0:
            return None
        return parse_qstat_full(job_id, done.stdout).stderr_path

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            run_command(["qdel", *job_ids])

    def stranded(self, jobs: dict[str, JobInfo]) -> dict[str, str]:
        """Jobs held in the queue by a node that stopped answering: not known here."""
        return {}


def qstat_fields(text: str) -> dict[str, str]:
    """`qstat -f`'s ``key = value`` lines; continuation lines start with a tab."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("\t") and key:
            fields[key] += line.strip()
        elif " = " in line:
            key, _, value = line.strip().partition(" = ")
            fields[key] = value
    return fields


def parse_qstat_full(job_id: str, text: str) -> JobInfo:
    """A JobInfo from `qstat -f` output."""
    fields = qstat_fields(text)
    stderr = fields.get("Error_Path")
    if stderr and ":" in stderr:  # host:/path
        stderr = stderr.split(":", 1)[1]
    return JobInfo(
        job_id=job_id,
        state=fields.get("job_state", "?"),
        reason=fields.get("comment", ""),
        nodes=fields.get("exec_host", ""),
        elapsed=fields.get("resources_used.walltime", ""),
        stderr_path=stderr,
    )


class PBSBackend(JobQueueBackend):
    """Workers in PBS jobs (dask_jobqueue.PBSCluster); GPUs go into the select statement."""

    NAME = "pbs"
    Profile = PBSProfile
    JOB_NAME_LIMIT = 15  # Torque and older PBS; PBS Pro allows more
    QUEUE = PBSQueue()
    LOG_PATTERN = "{job_name}.e*"
    QUEUE_HINT = "`qstat -Q`"

    def job_class(self) -> type[Any]:
        from dask_jobqueue.pbs import PBSJob

        return PBSJob

    def cluster_class(self) -> type[Any]:
        from dask_jobqueue import PBSCluster

        return drained(PBSCluster, self.QUEUE)

    def job_options(
        self, profile: JobQueueProfile, security: ClusterSecurity, job_name: str
    ) -> dict[str, Any]:
        from dask_jobqueue.pbs import pbs_format_bytes_ceil

        kwargs = super().job_options(profile, security, job_name)
        kwargs["walltime"] = hms(profile.walltime)  # no days
        spec = getattr(profile, "resource_spec", None)
        if spec is None:
            spec = f"select=1:ncpus={profile.cores}:mem={pbs_format_bytes_ceil(profile.memory)}"
            gpus = profile.worker.gpus * profile.processes
            spec += f":ngpus={gpus}" if gpus else ""
        kwargs["resource_spec"] = spec
        return kwargs

    def log_in(self, directory: str, job_name: str, job_id: str) -> str:
        return os.path.join(directory, f"{job_name}.e{job_id}")  # PBS's default name
