"""Whole runs inside one batch allocation: ``clusterkit hpo|train ... --batch``, the side of
the machine that submits them (the login node).

For sites that forbid jobs that submit jobs, or cap how many a user may queue: one job holds
the scheduler, the driver and the workers, as dask-jobqueue's ``SLURMRunner`` does, but with
the driver beside the scheduler on the job's first process, so no worker (GPU) task is given
to it. This module checks the profile, fixes the job's plan in the run's record, writes and
submits the job script, shows the job's state and stops it; what runs inside the job is
:mod:`clusterkit.runs.allocation`.

``runs stop`` asks the job to stop (the driver stops gracefully; the job then ends) and
cancels it if it does not. Near its walltime (SLURM: ``--signal``) or when the batch system
ends it (preemption), a job whose profile says ``requeue: true`` is requeued and its driver
resumes, counted as a restart.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from clusterkit import state, webauth
from clusterkit.errors import BadInput, ClusterkitError
from clusterkit.runs.records import RunRecord, get, request_stop

if TYPE_CHECKING:
    from clusterkit.schema import JobQueueProfile

SYSTEMS = ("slurm", "pbs")
SCHEDULER_FILE = "scheduler.json"
JOB_ID_NAME = "job_id"
JOB_SCRIPT = "job.sh"
TLS_DIR = "tls"


def checked_profile(ref: str | None) -> JobQueueProfile:
    """The profile of a ``--batch`` run: SLURM or PBS, else one line (exit 2)."""
    from clusterkit.profiles import load_profile

    if ref is None:
        raise BadInput("--batch needs --profile: a slurm or pbs profile")
    profile = load_profile(ref)
    if profile.backend_name not in SYSTEMS:
        raise BadInput(
            f"--batch runs inside one SLURM or PBS job; profile '{profile.name}' is "
            f"{profile.backend_name}",
            hint="use --detach to run it detached on its own cluster",
        )
    if getattr(profile, "adapt", None) is not None:
        raise BadInput(f"--batch holds a fixed allocation: profile '{profile.name}' adapts")
    return profile  # type: ignore[return-value]


def plan(profile: JobQueueProfile, record: RunRecord) -> dict[str, Any]:
    """What the job needs to know, fixed at submission (a profile edited later changes nothing
    of a queued run): the system, the worker count, the commands and the environment."""
    from clusterkit.backends.jobqueue.jobs import (
        CPU_WORKER,
        GPU_WORKER,
        lifetime_plan,
        scheduler_options,
        worker_args,
    )
    from clusterkit.units import walltime_seconds

    folder = state.run_dir(record.id)
    scheduler_file = str(folder / SCHEDULER_FILE)
    spec = scheduler_options(profile)
    scheduler = ["--scheduler-file", scheduler_file, "--protocol", profile.protocol]
    if "host" in spec:
        scheduler += ["--host", spec["host"]]
    if "interface" in spec:
        scheduler += ["--interface", spec["interface"]]
    scheduler += ["--port", str(spec["port"] or 0)]
    scheduler += ["--dashboard-address", spec["dashboard_address"]]
    if not spec["dashboard"]:
        scheduler.append("--no-dashboard")
    token_file = str(webauth.write_token(folder))  # the web pages' gate, in each process
    scheduler += ["--preload", webauth.PRELOAD]
    worker = ["--interface", profile.interface] if profile.interface else []
    worker += ["--scheduler-file", scheduler_file, "--nthreads", str(profile.worker.threads)]
    worker += ["--memory-limit", str(int(profile.memory) // profile.processes)]
    worker += ["--death-timeout", str(int(profile.death_timeout))]
    worker += [*worker_args(profile, lifetime=False), "--preload", webauth.PRELOAD]
    walltime = walltime_seconds(profile.walltime)
    margin = walltime - lifetime_plan(profile)[0]
    return {
        "system": profile.backend_name,
        "workers": profile.workers,
        "python": profile.python or sys.executable,
        "scheduler": scheduler,
        "worker_module": GPU_WORKER if profile.worker.gpus else CPU_WORKER,
        "worker": worker,
        "env": {**profile.env, **options_env(profile), **webauth.token_env(token_file)},
        "requeue": bool(getattr(profile, "requeue", False)),
        "signal_margin": int(margin),
        "job_id": None,
        "starts": 0,
    }


def options_env(profile: JobQueueProfile) -> dict[str, str]:
    """The protocol's environment (UCX settings; TLS files come from the run's folder)."""
    from clusterkit.security import ucx_env

    return ucx_env(profile) if profile.protocol == "ucx" else {}


def job_script(profile: JobQueueProfile, record: RunRecord) -> str:
    """The job script: the batch system's directives (dask-jobqueue's header for the
    profile's queue, account, walltime and memory, resized to one task per worker), the
    profile's prologue, and the run."""
    from clusterkit.backends.base import get_backend
    from clusterkit.backends.jobqueue.jobs import hms

    backend = get_backend(profile.backend_name)
    batch = record.batch or {}
    workers, cores = profile.workers, profile.cores_per_worker
    per_worker = int(profile.memory) // profile.processes
    folder = state.run_dir(record.id)
    common: dict[str, Any] = {
        "cores": cores,
        "memory": str(per_worker),
        "processes": 1,
        "queue": profile.queue,
        "account": profile.account,
        "job_name": job_name(record.id, backend.JOB_NAME_LIMIT),  # type: ignore[attr-defined]
        "python": batch["python"],
    }
    if profile.backend_name == "slurm":
        gpus = ["--gpus-per-task=1"] if profile.worker.gpus else []
        directives = [f"--ntasks={workers}", f"--cpus-per-task={cores}"]
        directives += [f"--mem-per-cpu={max(1, per_worker // cores // 2**20)}M", *gpus]
        if batch["requeue"]:  # the walltime's warning: the driver stops, the job requeues
            directives += ["--requeue", f"--signal=B:USR1@{batch['signal_margin']}"]
        else:
            directives.append("--no-requeue")
        log = folder / "job-%j.log"  # sbatch puts the job's id in the name
        directives += [f"-o {log}", f"-e {log}"]
        skip = ["-n 1", "--cpus-per-task", "--mem="]
        header_args = {"walltime": profile.walltime}
    else:
        chunk = getattr(profile, "resource_spec", None) or (
            f"select={workers}:ncpus={cores}:mem={max(1, per_worker // 2**20)}mb"
            + (":ngpus=1" if profile.worker.gpus else "")
        )
        requeue = "y" if batch["requeue"] else "n"
        directives = [f"-r {requeue}", "-j oe", f"-o {folder / 'job.log'}"]
        skip = []
        header_args = {"walltime": hms(profile.walltime), "resource_spec": chunk}
    job = backend.job_class()(  # type: ignore[attr-defined]
        "tls://placeholder:0",  # not used: the header is all that is taken
        job_extra_directives=[*directives, *profile.job_extra],
        job_directives_skip=skip,
        **common,
        **header_args,
    )
    python = batch["python"]
    lines = ["#!/usr/bin/env bash", job.job_header, *profile.prologue]
    lines.append(f"exec {python} -m clusterkit.runs.allocation {record.id}")
    return "\n".join(lines) + "\n"


def job_name(run_id: str, limit: int) -> str:
    """The job's name in the queue: the run's identity (``ck-hpo-1125-a1b2c3``; the run ID
    alone where names are short, as PBS's 15 characters)."""
    name = f"ck-{run_id}"
    return name if len(name) <= limit else run_id[-limit:]


def submit_job(record: RunRecord, profile: JobQueueProfile) -> str:
    """Write the job script to the run's folder, submit it; the job id."""
    state.write_private(state.run_dir(record.id) / JOB_SCRIPT, job_script(profile, record))
    return resubmit(record)


def resubmit(record: RunRecord) -> str:
    """Submit the run's job script (again: ``runs resume`` of a job that left the queue); the
    job id, also written beside the record (not in it: the job may be writing it already)."""
    from clusterkit.backends.base import get_backend

    script = state.run_dir(record.id) / JOB_SCRIPT
    system = (record.batch or {})["system"]
    job_class = get_backend(system).job_class()  # type: ignore[attr-defined]
    command = [job_class.submit_command, str(script)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=60, cwd=record.cwd, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ClusterkitError(f"{command[0]} failed: {error}") from error
    found = re.search(job_class.job_id_regexp, done.stdout)
    if done.returncode != 0 or not found:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise ClusterkitError(
            f"{command[0]} refused the run's job: {why[-1] if why else done.returncode}"
        )
    state.write_private(state.run_dir(record.id) / JOB_ID_NAME, found.group("job_id"))
    return found.group("job_id")


def queue_for(record: RunRecord) -> Any:
    from clusterkit.backends.jobqueue.pbs import PBSQueue
    from clusterkit.backends.jobqueue.slurm import SlurmQueue

    return SlurmQueue() if (record.batch or {}).get("system") == "slurm" else PBSQueue()


def job_id(record: RunRecord) -> str | None:
    """The run's job: as the job recorded it, else as the submission wrote it beside."""
    found = (record.batch or {}).get("job_id")
    if found:
        return str(found)
    try:
        return (state.run_dir(record.id) / JOB_ID_NAME).read_text().strip() or None
    except OSError:
        return None


def job_state(record: RunRecord) -> str:
    """A batch run's state as ``runs`` shows it: queued (with why) while its job waits,
    lost once the job left the queue without an end recorded."""
    job = job_id(record)
    if job is None:
        return record.state
    info = queue_for(record).jobs([job]).get(job)
    if info is None:
        return f"lost: job {job} left the queue"
    if info.state in ("PENDING", "Q", "H"):
        return f"queued (job {job}: {info.reason or info.state.lower()})"
    return record.state


def job_gone(record: RunRecord) -> bool:
    """Whether the run's job left the queue (a run not final whose job is gone is lost)."""
    found = job_id(record)
    return bool(found) and not queue_for(record).jobs([found])


def stop(record: RunRecord, timeout: float) -> RunRecord:
    """Ask the job to stop its run gracefully; cancel the job if it has not within
    ``timeout`` (or at once, while it is still queued)."""
    request_stop(record.id)
    job = job_id(record)
    queue = queue_for(record)
    deadline = time.monotonic() + timeout
    while True:
        record = get(record.id)
        if record.final:
            return record
        pending = record.state == "queued"
        if pending or time.monotonic() > deadline or not queue.jobs([job]):
            if job:
                from clusterkit.backends.jobqueue.commands import cancel_and_wait

                cancel_and_wait(queue, [job], timeout=30.0)
            record = get(record.id)
            if not record.final:
                record.state, record.reason, record.ended_at = "stopped", "stopped", time.time()
                record.exit_code = 130
                record.reason = f"stopped: job {job} cancelled"
                record.save()
            return record
        time.sleep(0.2)
