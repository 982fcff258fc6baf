"""Batch schedulers through dask-jobqueue: SLURMCluster and PBSCluster, walltime-aware."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Capability, Check, Requirement, StatusRow
from clusterkit.backends.jobqueue.batch import QUEUES, JobInfo, tail
from clusterkit.errors import ClusterStartError
from clusterkit.units import walltime_seconds

if TYPE_CHECKING:
    from distributed.deploy.cluster import Cluster

    from clusterkit.schema import JobQueueProfile
    from clusterkit.security import ClusterSecurity

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
CPU_WORKER = "distributed.cli.dask_worker"
GPU_WORKER = "dask_cuda.cli worker"
#: Scheduler address shown by ``render`` (the real one exists only once the scheduler runs).
ADDRESS_PLACEHOLDER = "<scheduler-address>"
WORKER_NAME_PLACEHOLDER = "<worker-name>"


# ------------------------------------------------------------------ walltime-aware lifetime


def lifetime_plan(profile: JobQueueProfile) -> tuple[float, float]:
    """(lifetime, stagger) in seconds: workers leave, staggered, before the walltime kills them.

    By default the margin is 10% of the walltime (at least 30s, at most 10 minutes, at most
    half the walltime); workers live ``walltime - margin`` give or take ``margin / 2``, so with
    ``adapt`` replacement jobs are queued while the old workers still hand their data over.
    """
    walltime = float(walltime_seconds(profile.walltime))
    margin = min(max(0.1 * walltime, 30.0), 600.0, walltime / 2)
    lifetime = profile.lifetime if profile.lifetime is not None else walltime - margin
    if profile.lifetime_stagger is not None:
        stagger = profile.lifetime_stagger
    else:
        stagger = min(margin, walltime - lifetime) / 2
    return lifetime, stagger


def _seconds(value: float) -> str:
    return f"{int(value)}s"


# ------------------------------------------------------------------ keyword arguments


def _scheduler_host(profile: JobQueueProfile) -> str | None:
    """Where the scheduler binds: its own host, else the interface, else loopback."""
    if profile.scheduler.host:
        return profile.scheduler.host
    if profile.scheduler.interface or profile.interface:
        return None
    return LOOPBACK


def scheduler_options(profile: JobQueueProfile) -> dict[str, Any]:
    """``scheduler_options`` of the cluster: bind address, port, dashboard, idle timeout."""
    scheduler = profile.scheduler
    host = _scheduler_host(profile)
    options: dict[str, Any] = {"port": scheduler.port}
    if host:
        options["host"] = host
    elif scheduler.interface:
        options["interface"] = scheduler.interface
    # the scheduler serves HTTP (health, metrics) even without a dashboard: never on 8787 by chance
    options["dashboard"] = scheduler.dashboard
    options["dashboard_address"] = f"{host or ''}:{scheduler.dashboard_port}"
    if profile.idle_timeout:
        options["idle_timeout"] = profile.idle_timeout
    return options


def _worker_args(profile: JobQueueProfile, security: ClusterSecurity) -> list[str]:
    args: list[str] = []
    if not profile.interface and _scheduler_host(profile) == LOOPBACK:
        args += ["--host", LOOPBACK]  # listen where the scheduler can reach, not on every NIC
    resources = profile.worker_resources()
    if resources:
        args += ["--resources", ",".join(f"{k}={v:g}" for k, v in sorted(resources.items()))]
    for module in profile.preload:
        args += ["--preload", module]
    gpus = profile.worker.gpus > 0
    if gpus and profile.protocol == "ucx":
        args.append("--enable-tcp-over-ucx")
        args += ["--enable-nvlink"] if profile.ucx.nvlink else []
        args += ["--enable-infiniband"] if profile.ucx.infiniband else []
        args += ["--enable-rdmacm"] if profile.ucx.rdmacm else []
    if not gpus:  # dask-cuda's worker has no lifetime flags: it reads them from the environment
        lifetime, stagger = lifetime_plan(profile)
        args += ["--lifetime", _seconds(lifetime), "--lifetime-stagger", _seconds(stagger)]
        if profile.lifetime_restart:
            args.append("--lifetime-restart")
    return args


def _prologue(profile: JobQueueProfile, security: ClusterSecurity) -> list[str]:
    env = {**security.env, **profile.env}
    if profile.worker.gpus:
        lifetime, stagger = lifetime_plan(profile)
        env["DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION"] = _seconds(lifetime)
        env["DASK_DISTRIBUTED__WORKER__LIFETIME__STAGGER"] = _seconds(stagger)
        if profile.lifetime_restart:
            env["DASK_DISTRIBUTED__WORKER__LIFETIME__RESTART"] = "True"
    exports = [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    return [*profile.prologue, *exports]


def job_kwargs(profile: JobQueueProfile, security: ClusterSecurity) -> dict[str, Any]:
    """Keyword arguments of dask-jobqueue's Job (and Cluster) for this profile."""
    kwargs: dict[str, Any] = {
        "cores": profile.cores,
        "memory": str(profile.memory),
        "processes": profile.processes,
        "queue": profile.queue,
        "account": profile.account,
        "walltime": profile.walltime,
        "job_name": profile.job_name,
        "job_extra_directives": [*_gpu_directives(profile), *profile.job_extra],
        "job_script_prologue": _prologue(profile, security),
        "worker_command": GPU_WORKER if profile.worker.gpus else CPU_WORKER,
        "worker_extra_args": _worker_args(profile, security),
        "interface": profile.interface,
        "protocol": f"{security.scheme}://",
        "security": security.distributed(),
        "local_directory": profile.local_directory,
        # batch directives do not expand ~, and dask-jobqueue creates the directory here
        "log_directory": os.path.expanduser(profile.log_directory)
        if profile.log_directory
        else None,
        "python": profile.python or sys.executable,
        "death_timeout": int(profile.death_timeout),
    }
    kwargs.update(_system_kwargs(profile))
    return kwargs


def _gpu_directives(profile: JobQueueProfile) -> list[str]:
    gpus = profile.worker.gpus * profile.processes
    if not gpus or profile.backend_name != "slurm":
        return []
    if getattr(profile, "gpu_directive", "gres") == "gpus-per-task":
        return [f"--gpus-per-task={gpus}"]  # jobqueue's jobs are one task
    return [f"--gres=gpu:{gpus}"]


def _system_kwargs(profile: JobQueueProfile) -> dict[str, Any]:
    if profile.backend_name != "pbs":
        return {}
    from dask_jobqueue.pbs import pbs_format_bytes_ceil

    hours, seconds = divmod(walltime_seconds(profile.walltime), 3600)
    walltime = f"{hours:02d}:{seconds // 60:02d}:{seconds % 60:02d}"  # PBS has no days field
    spec = getattr(profile, "resource_spec", None)
    if spec is None:
        spec = f"select=1:ncpus={profile.cores}:mem={pbs_format_bytes_ceil(profile.memory)}"
        gpus = profile.worker.gpus * profile.processes
        spec += f":ngpus={gpus}" if gpus else ""
    return {"resource_spec": spec, "walltime": walltime}


class _Unmade:
    """A log directory path for ``render``: printed as given, never created (Job makedirs it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __str__(self) -> str:
        return self.path

    def __fspath__(self) -> str:
        return "/"  # exists, so dask-jobqueue's Job skips os.makedirs


# ------------------------------------------------------------------ the backends


@dataclass(frozen=True)
class JobQueueBackend:
    """One batch system behind dask-jobqueue."""

    NAME: str
    CAPABILITIES: frozenset[Capability] = frozenset(
        {Capability.GPU, Capability.UCX, Capability.TLS, Capability.SCALE, Capability.ADAPT}
    )
    REQUIRES: tuple[Requirement, ...] = (Requirement("dask_jobqueue", "dask-jobqueue", "jobqueue"),)

    def job_class(self) -> type[Any]:
        from dask_jobqueue.pbs import PBSJob
        from dask_jobqueue.slurm import SLURMJob

        return {"slurm": SLURMJob, "pbs": PBSJob}[self.NAME]

    def render(self, profile: JobQueueProfile, security: ClusterSecurity) -> str:
        """The job script each job runs, with the scheduler address left as a placeholder."""
        kwargs = job_kwargs(profile, security)
        if kwargs["log_directory"] is not None:
            kwargs["log_directory"] = _Unmade(kwargs["log_directory"])
        port = profile.scheduler.port or 8786
        job = self.job_class()(
            f"{security.scheme}://{ADDRESS_PLACEHOLDER}:{port}",
            name=WORKER_NAME_PLACEHOLDER,
            **kwargs,
        )
        return str(job.job_script())

    def create_cluster(self, profile: JobQueueProfile, security: ClusterSecurity) -> Cluster:
        """Start the scheduler here and submit jobs for the profile's workers.

        A job script the batch system rejects raises ClusterStartError with its stderr; the
        scheduler is closed first.
        """
        from clusterkit.backends.jobqueue.cluster import CLUSTERS

        kwargs = job_kwargs(profile, security)
        interface, protocol, sec = (kwargs.pop(k) for k in ("interface", "protocol", "security"))
        try:
            cluster = CLUSTERS[self.NAME](
                n_workers=0,
                interface=interface,
                protocol=protocol,
                security=sec,
                scheduler_options=scheduler_options(profile),
                name=profile.name,
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

    def describe(self, cluster: Any, profile: JobQueueProfile) -> list[StatusRow]:
        """One row per job: the batch system's state and, for pending jobs, its reason."""
        from clusterkit.backends.jobqueue.cluster import job_ids

        ids = job_ids(cluster, current=True)  # not the jobs already replaced
        known = QUEUES[self.NAME].jobs(ids)
        rows = []
        for job_id in ids:
            info = known.get(job_id, JobInfo(job_id, "GONE"))
            detail = info.reason if info.reason else info.nodes
            rows.append(
                StatusRow(
                    kind="job",
                    name=job_id,
                    state=info.state,
                    detail=detail,
                    extra={"reason": info.reason, "nodes": info.nodes, "elapsed": info.elapsed},
                )
            )
        return rows

    def evidence(self, cluster: Any, profile: JobQueueProfile) -> list[str]:
        """Each job's state (and pending reason), then the tail of its stderr log."""
        from clusterkit.backends.jobqueue.cluster import job_ids

        queue = QUEUES[self.NAME]
        ids = job_ids(cluster)
        known = queue.jobs(ids)
        lines = []
        for job_id in ids:
            info = known.get(job_id)
            if info is None:
                lines.append(f"job {job_id}: no longer in the {self.NAME} queue")
            else:
                why = f" (reason: {info.reason})" if info.reason else ""
                lines.append(f"job {job_id}: {info.state}{why}")
            path = queue.stderr_path(job_id) or (info.stderr_path if info else None)
            for line in tail(path or self.log_guess(profile, job_id)):
                lines.append(f"  {line}")
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
        pattern = "*.err" if self.NAME == "slurm" else f"{profile.job_name}.e*"
        found = directory.glob(pattern) if directory.is_dir() else iter(())
        logs = [p for p in found if p.stat().st_size]
        return str(max(logs, key=lambda p: p.stat().st_mtime)) if logs else None

    def log_guess(self, profile: JobQueueProfile, job_id: str) -> str | None:
        """Where dask-jobqueue's directives put a job's stderr, once the queue forgot the job."""
        if not profile.log_directory:
            return None
        directory = os.path.expanduser(profile.log_directory)
        if self.NAME == "slurm":  # "#SBATCH -e {dir}/{job_name}-%J.err"
            return os.path.join(directory, f"{profile.job_name}-{job_id}.err")
        return os.path.join(directory, f"{profile.job_name}.e{job_id}")  # PBS's default name

    def doctor(self, profile: JobQueueProfile, security: ClusterSecurity) -> list[Check]:
        import shutil

        submit_command = self.job_class().submit_command
        checks = [
            Check(
                f"{submit_command} on PATH",
                ok=shutil.which(submit_command) is not None,
                detail=shutil.which(submit_command) or "not found",
                fix=f"run on a {self.NAME.upper()} login node (or load its module)",
            )
        ]
        if _scheduler_host(profile) == LOOPBACK:
            checks.append(
                Check(
                    "scheduler reachable from compute nodes",
                    ok=True,
                    detail="scheduler binds 127.0.0.1: only jobs on this host can reach it",
                    fix="set interface (e.g. ib0) or scheduler.host for a multi-node site",
                )
            )
        queue = QUEUES[self.NAME]
        if profile.queue and shutil.which(submit_command):
            known = queue.queue_exists(profile.queue)
            if known is not None:
                checks.append(
                    Check(
                        f"{self.NAME} queue '{profile.queue}'",
                        ok=known,
                        detail="exists" if known else "the batch system does not know it",
                        fix="set queue to one listed by `sinfo -s` (SLURM) or `qstat -Q` (PBS)",
                    )
                )
        return checks


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


SLURM = JobQueueBackend("slurm")
PBS = JobQueueBackend("pbs")
