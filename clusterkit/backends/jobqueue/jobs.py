"""Job options for dask-jobqueue: walltime-aware worker lifetime, bind addresses, worker flags."""

from __future__ import annotations

import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from clusterkit import webauth
from clusterkit.backends import options
from clusterkit.backends.options import LOOPBACK
from clusterkit.schema import cuda
from clusterkit.units import walltime_seconds

if TYPE_CHECKING:
    from clusterkit.schema import JobQueueProfile
    from clusterkit.security import ClusterSecurity

CPU_WORKER = "distributed.cli.dask_worker"
GPU_WORKER = "dask_cuda.cli"  # `python -m dask_cuda.cli` is the worker command itself
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


def hms(walltime: str) -> str:
    """A walltime as HH:MM:SS, days folded into hours (PBS and Grid Engine have no days)."""
    hours, seconds = divmod(walltime_seconds(walltime), 3600)
    return f"{hours:02d}:{seconds // 60:02d}:{seconds % 60:02d}"


def _seconds(value: float) -> str:
    return f"{int(value)}s"


# ------------------------------------------------------------------ keyword arguments


def scheduler_host(profile: JobQueueProfile) -> str | None:
    """Where the scheduler binds: its own host, else the interface, else loopback."""
    if profile.scheduler.host:
        return profile.scheduler.host
    if profile.scheduler.interface or profile.interface:
        return None
    return LOOPBACK


def scheduler_options(profile: JobQueueProfile) -> dict[str, Any]:
    """``scheduler_options`` of the cluster: bind address, port, dashboard, idle timeout.

    Without a host or interface of its own the scheduler binds on the workers' ``interface``,
    as dask-jobqueue's cluster does; a ``--batch`` run's scheduler command needs it said."""
    found = options.scheduler_options(profile, scheduler_host(profile))
    if "host" not in found and "interface" not in found and profile.interface:
        found["interface"] = profile.interface
    return found


def worker_args(profile: JobQueueProfile, *, lifetime: bool = True) -> list[str]:
    """The worker command's flags; ``lifetime=False``: workers stay until their job ends (a
    batch run, whose driver leaves before the walltime itself)."""
    args: list[str] = []
    if not profile.interface and scheduler_host(profile) == LOOPBACK:
        args += ["--host", LOOPBACK]  # listen where the scheduler can reach, not on every NIC
    if profile.worker.threads != profile.cores_per_worker:  # after dask-jobqueue's: it wins
        args += ["--nthreads", str(profile.worker.threads)]
    resources = profile.worker_resources()
    if resources:
        args += ["--resources", options.resource_spec(resources)]
    for module in profile.preload:
        args += ["--preload", module]
    gpus = profile.worker.gpus > 0
    args += options.ucx_cli_flags(profile)
    if gpus:
        args += cuda.worker_flags(profile.cuda)
    if lifetime and not gpus:  # dask-cuda's worker reads lifetime flags from the environment
        duration, stagger = lifetime_plan(profile)
        args += ["--lifetime", _seconds(duration), "--lifetime-stagger", _seconds(stagger)]
        if profile.lifetime_restart:
            args.append("--lifetime-restart")
    return args


def gate_args(security: ClusterSecurity) -> list[str]:
    """The worker's preload of the web pages' gate (its secret's file comes by environment:
    the prologue exports it)."""
    return ["--preload", webauth.PRELOAD] if security.web_token_file else []


def _prologue(profile: JobQueueProfile, security: ClusterSecurity) -> list[str]:
    env = {**security.env, **webauth.token_env(security.web_token_file), **profile.env}
    if profile.worker.gpus:
        lifetime, stagger = lifetime_plan(profile)
        env["DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION"] = _seconds(lifetime)
        env["DASK_DISTRIBUTED__WORKER__LIFETIME__STAGGER"] = _seconds(stagger)
        if profile.lifetime_restart:
            env["DASK_DISTRIBUTED__WORKER__LIFETIME__RESTART"] = "True"
    exports = [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    return [*profile.prologue, *exports]


def job_kwargs(
    profile: JobQueueProfile, security: ClusterSecurity, directives: list[str], job_name: str
) -> dict[str, Any]:
    """Keyword arguments of dask-jobqueue's Job (and Cluster) for this profile."""
    kwargs: dict[str, Any] = {
        "cores": profile.cores,
        "memory": str(profile.memory),
        "processes": profile.processes,
        "queue": profile.queue,
        "account": profile.account,
        "walltime": profile.walltime,
        "job_name": job_name,
        "job_extra_directives": [*directives, *profile.job_extra],
        "job_script_prologue": _prologue(profile, security),
        "worker_command": GPU_WORKER if profile.worker.gpus else CPU_WORKER,
        "worker_extra_args": worker_args(profile) + gate_args(security),
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
    return kwargs


class UnmadeDirectory:
    """A log directory path for ``render``: printed as given, never created (Job makedirs it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __str__(self) -> str:
        return self.path

    def __fspath__(self) -> str:
        return "/"  # exists, so dask-jobqueue's Job skips os.makedirs
