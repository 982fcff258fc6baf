"""The backend every batch system shares, in dask-jobqueue's shape (its ``core.py``):
``JobQueueBackend`` renders, creates, describes, explains, tears down and checks a cluster of
batch jobs through the hooks each batch system's module (``slurm``, ``pbs``, ``sge``,
``htcondor``) fills: its queue commands, its dask-jobqueue Job and its cluster class.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from clusterkit import webauth
from clusterkit.backends.base import Backend, Capability, Check, Requirement, StatusRow
from clusterkit.backends.jobqueue.cluster import job_ids, submit
from clusterkit.backends.jobqueue.commands import BatchQueue, JobInfo, cancel_and_wait, tail
from clusterkit.backends.jobqueue.jobs import (
    ADDRESS_PLACEHOLDER,
    WORKER_NAME_PLACEHOLDER,
    UnmadeDirectory,
    job_kwargs,
    scheduler_host,
    scheduler_options,
)
from clusterkit.backends.options import LOOPBACK
from clusterkit.errors import BadInput, ClusterkitError, ClusterStartError

if TYPE_CHECKING:
    from distributed.deploy.cluster import Cluster

    from clusterkit.schema import JobQueueProfile
    from clusterkit.security import ClusterSecurity
    from clusterkit.state import ClusterRecord


def _log_places(profile: JobQueueProfile) -> dict[str, Any]:
    """Where the jobs' logs go: the profile's log directory or, without one, the directory
    they were submitted from."""
    directory = profile.log_directory
    return {
        "log_directory": os.path.expanduser(directory) if directory else None,
        "submit_directory": os.getcwd(),
    }


def _unique() -> str:
    """A short id that tells two clusters of the same name apart in the queue."""
    import uuid

    return uuid.uuid4().hex[:4]


def _connected_names(cluster: Any) -> set[str]:
    """Names of the jobs whose workers are connected to the scheduler (a job of several
    processes runs workers NAME-0, NAME-1, ...)."""
    info = getattr(cluster, "scheduler_info", None) or {}
    names = {str(worker.get("name")) for worker in info.get("workers", {}).values()}
    return names | {name.rsplit("-", 1)[0] for name in names}


def _loss_rows(cluster: Any) -> list[StatusRow]:
    """A row per worker the cluster lost (``losses``): its one line is the detail."""
    return [
        StatusRow(kind="lost", name=loss.worker, state=loss.job, detail=loss.line())
        for loss in getattr(cluster, "losses", ())
    ]


class JobQueueBackend(Backend):
    """One batch system behind dask-jobqueue; SLURM and PBS differ by subclass."""

    CAPABILITIES = frozenset(
        {Capability.GPU, Capability.UCX, Capability.TLS, Capability.SCALE, Capability.ADAPT}
        | {Capability.REMOTE}
    )
    REQUIRES = (Requirement("dask_jobqueue", "dask-jobqueue", "jobqueue"),)
    QUEUE: ClassVar[BatchQueue]
    JOB_NAME_LIMIT: ClassVar[int]
    #: glob of a job's stderr log in the log directory
    LOG_PATTERN: ClassVar[str]
    #: how to list the batch system's queues (doctor's hint)
    QUEUE_HINT: ClassVar[str] = ""

    def job_class(self) -> type[Any]:
        """dask-jobqueue's Job class of this batch system."""
        raise NotImplementedError

    def cluster_class(self) -> type[Any]:
        """The cluster class (imports dask-jobqueue)."""
        raise NotImplementedError

    def gpu_directives(self, profile: JobQueueProfile) -> list[str]:
        """Batch directives that ask for the workers' GPUs."""
        return []

    def job_options(
        self, profile: JobQueueProfile, security: ClusterSecurity, job_name: str
    ) -> dict[str, Any]:
        """Keyword arguments of dask-jobqueue's Job (and Cluster) for this profile."""
        return job_kwargs(profile, security, self.gpu_directives(profile), job_name)

    def job_name(self, profile: JobQueueProfile, name: str, unique: str) -> str:
        """``ck-NAME-ID`` (the profile's own name if it sets one), within the system's limit."""
        if profile.job_name:
            return profile.job_name
        room = self.JOB_NAME_LIMIT - len("ck--") - len(unique)
        return f"ck-{name[:room]}-{unique}"

    def log_guess(self, profile: JobQueueProfile, job_name: str, job_id: str) -> str | None:
        """Where a job's stderr goes, once the queue forgot the job."""
        if not profile.log_directory:
            return None
        return self.log_in(os.path.expanduser(profile.log_directory), job_name, job_id)

    def log_in(self, directory: str, job_name: str, job_id: str) -> str:
        """The stderr file of job ``job_id`` in the profile's log directory."""
        raise NotImplementedError

    def default_log_in(self, directory: str, job_name: str, job_id: str) -> str:
        """The stderr file of a job submitted from ``directory`` with no log directory set."""
        return self.log_in(directory, job_name, job_id)

    def render(self, profile: JobQueueProfile, security: ClusterSecurity) -> str:
        """The job script each job runs, with the scheduler address left as a placeholder."""
        kwargs = self.job_options(profile, security, self.job_name(profile, profile.name, "<id>"))
        if kwargs["log_directory"] is not None:
            kwargs["log_directory"] = UnmadeDirectory(kwargs["log_directory"])
        port = profile.scheduler.port or 8786
        job = self.job_class()(
            f"{security.scheme}://{ADDRESS_PLACEHOLDER}:{port}",
            name=WORKER_NAME_PLACEHOLDER,
            **kwargs,
        )
        return str(job.job_script())

    def identity(self, profile: JobQueueProfile, name: str) -> dict[str, Any]:
        """The name every job of the cluster carries, chosen before any is submitted."""
        return {"job_name": self.job_name(profile, name, _unique()), **_log_places(profile)}

    def create(
        self,
        profile: JobQueueProfile,
        security: ClusterSecurity,
        *,
        name: str,
        identity: dict[str, Any] | None = None,
    ) -> Cluster:
        """Start the scheduler here and submit jobs for the profile's workers.

        A job script the batch system rejects raises ClusterStartError with its stderr; the
        scheduler is closed first.
        """
        job_name = (identity or self.identity(profile, name))["job_name"]
        kwargs = self.job_options(profile, security, job_name)
        interface, protocol, sec = (kwargs.pop(k) for k in ("interface", "protocol", "security"))
        try:
            cluster = self.cluster_class()(
                n_workers=0,
                interface=interface,
                protocol=protocol,
                security=sec,
                scheduler_options={
                    **scheduler_options(profile),
                    **webauth.preloads(security.web_token_file, []),
                },
                name=name,
                **kwargs,
            )
        except Exception as error:
            raise ClusterStartError(
                f"could not start the scheduler ({type(error).__name__}: {error})",
                component=f"{self.NAME} scheduler",
            ) from error
        try:
            submit(cluster, profile.workers)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def record_extra(self, cluster: Any, profile: JobQueueProfile) -> dict[str, Any]:
        return {"job_name": cluster.job_name, **_log_places(profile)}

    def component_logs(
        self, record: ClusterRecord, component: str | None, lines: int
    ) -> dict[str, list[str]]:
        """``job ID``: the tail of a batch job's own log (its stderr, where the prologue, the
        shell and the worker write), for jobs still in the queue or whose log is on disk."""
        if component is not None and component.split()[0] != "job":
            return {}
        extra = record.extra or {}
        job_name = extra.get("job_name")
        if not job_name:
            return {}
        ids = self.QUEUE.named(job_name)
        wanted = component.split()[1:] if component else []
        if wanted:
            path = self._log_path(extra, wanted[0])
            if wanted[0] not in ids and not (path and os.path.exists(path)):
                raise BadInput(
                    f"no job {wanted[0]!r} of cluster '{record.name}'",
                    hint=f"its jobs in the queue: {', '.join(ids) or 'none'}",
                )
            ids = wanted[:1]
        found = {}
        for job_id in ids:
            path = self._log_path(extra, job_id)
            if path and os.path.exists(path):
                found[f"job {job_id}"] = tail(path, lines)
            else:
                found[f"job {job_id}"] = [f"(no log file yet at {path or 'an unknown path'})"]
        return found

    def _log_path(self, extra: dict[str, Any], job_id: str) -> str | None:
        """Where the batch system says (while it knows the job), else where it writes."""
        directory, submitted = extra.get("log_directory"), extra.get("submit_directory")
        guess = None
        if directory:
            guess = self.log_in(directory, extra["job_name"], job_id)
        elif submitted:
            guess = self.default_log_in(submitted, extra["job_name"], job_id)
        return self.QUEUE.stderr_path(job_id) or guess

    def teardown(self, record: ClusterRecord) -> None:
        """Cancel every job carrying the cluster's job name (a dead supervisor's jobs)."""
        from clusterkit import console

        job_name = (record.extra or {}).get("job_name")
        if not job_name:
            return
        left = cancel_and_wait(self.QUEUE, self.QUEUE.named(job_name), timeout=30)
        stranded = self.QUEUE.stranded(self.QUEUE.jobs(left)) if left else {}
        for job_id, why in sorted(stranded.items()):
            console.warn(
                f"job {job_id} of '{record.name}' stays in the {self.NAME} queue as "
                f"COMPLETING: {why}; it leaves when the node is back (nothing of it runs here)"
            )
        left = [job for job in left if job not in stranded]
        if left:
            raise ClusterkitError(
                f"jobs {', '.join(left)} of '{record.name}' are still in the queue",
                hint=f"cancel them by hand ({self.QUEUE.cancel_command} ...)",
            )

    def describe(self, cluster: Any, profile: JobQueueProfile) -> list[StatusRow]:
        """One row per job: the batch system's state and, for pending jobs, its reason; for a
        running one, its node(s) and the worker it runs (which node each worker is on); then a
        row per worker lost (``kind="lost"``, its one line the detail)."""
        ids = job_ids(cluster, current=True)  # not the jobs already replaced
        known = self.QUEUE.jobs(ids)
        seen = getattr(cluster, "job_nodes", {})  # the lost-worker record's: job -> node
        seen.update({job: info.nodes for job, info in known.items() if info.nodes})
        workers = {
            str(job.job_id): str(name)
            for name, job in list(getattr(cluster, "workers", {}).items())
            if getattr(job, "job_id", None)
        }
        connected = _connected_names(cluster)
        rows = []
        for job_id in ids:
            info = known.get(job_id, JobInfo(job_id, "GONE"))
            worker = workers.get(job_id, "")
            if worker and worker not in connected:
                worker += ", not connected"  # not joined yet, or lost (its node died?)
            where = f"{info.nodes} (worker {worker})" if info.nodes and worker else info.nodes
            rows.append(
                StatusRow(
                    kind="job",
                    name=job_id,
                    state=info.state,
                    detail=info.reason if info.reason else where,
                    extra={
                        "reason": info.reason,
                        "nodes": info.nodes,
                        "elapsed": info.elapsed,
                        "worker": worker,
                    },
                )
            )
        return rows + _loss_rows(cluster)

    def evidence(self, cluster: Any, profile: JobQueueProfile) -> list[str]:
        """Each job's state (and pending reason), then the tail of its stderr log."""
        ids = job_ids(cluster)
        known = self.QUEUE.jobs(ids)
        lines = []
        for job_id in ids:
            info = known.get(job_id)
            if info is None:
                lines.append(f"job {job_id}: no longer in the {self.NAME} queue")
            else:
                why = f" (reason: {info.reason})" if info.reason else ""
                lines.append(f"job {job_id}: {info.state}{why}")
            path = self.QUEUE.stderr_path(job_id) or (info.stderr_path if info else None)
            guess = self.log_guess(profile, cluster.job_name, job_id)
            lines.extend(f"  {line}" for line in tail(path or guess))
        if not any(line.startswith("  ") for line in lines):
            # jobs that died are replaced: the newest log of an earlier job says why
            newest = self.newest_log(profile)
            if newest:
                lines.append(f"{newest}:")
                lines.extend(f"  {line}" for line in tail(newest))
        return lines

    def newest_log(self, profile: JobQueueProfile) -> str | None:
        """The most recently written job stderr log in the profile's log directory."""
        if not profile.log_directory:
            return None
        directory = Path(os.path.expanduser(profile.log_directory))
        pattern = self.LOG_PATTERN.format(job_name=profile.job_name or "ck-*")
        found = directory.glob(pattern) if directory.is_dir() else iter(())
        logs = [p for p in found if p.stat().st_size]
        return str(max(logs, key=lambda p: p.stat().st_mtime)) if logs else None

    def doctor(self, profile: JobQueueProfile, security: ClusterSecurity) -> list[Check]:
        return self.queue_checks(profile) + self.site_checks(profile)

    def queue_checks(self, profile: JobQueueProfile) -> list[Check]:
        """The submit command on PATH, where the scheduler binds, and the queue exists."""
        submit_command = self.job_class().submit_command
        found = shutil.which(submit_command)
        checks = [
            Check(
                f"{submit_command} on PATH",
                ok=found is not None,
                detail=found or "not found",
                fix=f"run on a {self.NAME.upper()} login node (or load its module)",
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
        known = self.QUEUE.queue_exists(profile.queue) if profile.queue and found else None
        if known is not None:
            checks.append(
                Check(
                    f"{self.NAME} queue '{profile.queue}'",
                    ok=known,
                    detail="exists" if known else "the batch system does not know it",
                    fix=f"set queue to one listed by {self.QUEUE_HINT}",
                )
            )
        return checks

    def site_checks(self, profile: JobQueueProfile) -> list[Check]:
        """Checks only this batch system has (its resources, parallel environments)."""
        return []
