"""The slurm backend: SLURM sites via dask-jobqueue's SLURMCluster, walltime-aware; its queue
commands (squeue, scontrol, scancel), its backend and its cluster class."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterkit.backends.jobqueue.cluster import drained
from clusterkit.backends.jobqueue.commands import JobInfo, run_command
from clusterkit.backends.jobqueue.core import JobQueueBackend
from clusterkit.schema import SLURMProfile

if TYPE_CHECKING:
    from clusterkit.schema import JobQueueProfile


class SlurmQueue:
    """squeue / scontrol / scancel."""

    system = "slurm"
    cancel_command = "scancel"

    def job_here(self, environ: Mapping[str, str]) -> str | None:
        """The id of the job this process runs in (``SLURM_JOB_ID``)."""
        return environ.get("SLURM_JOB_ID") or None

    def start_command(self, job_id: str) -> list[str]:
        return ["squeue", "-h", "-j", job_id, "-o", "%S"]

    def parse_start(self, text: str) -> float | None:
        """``squeue -o %S``: the job's StartTime, local time (``2026-11-27T06:10:15``)."""
        from datetime import datetime

        try:
            return datetime.fromisoformat(text.strip()).timestamp()
        except ValueError:  # N/A: not started
            return None

    def named(self, job_name: str) -> list[str]:
        """Ids of this user's jobs with that name."""
        done = run_command(["squeue", "-h", "--me", "--name", job_name, "-o", "%i"])
        return done.stdout.split() if done is not None and done.returncode == 0 else []

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        """Jobs still known to squeue (pending, running, completing), by id."""
        wanted = {str(j) for j in job_ids if j}
        if not wanted:
            return {}
        # all jobs, filtered here: `squeue -j` fails outright when one id is already gone
        done = run_command(["squeue", "-h", "-o", "%i|%T|%r|%N|%M"])
        if done is None or done.returncode != 0:
            return {}
        found: dict[str, JobInfo] = {}
        for line in done.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 5 and parts[0] in wanted:
                reason = "" if parts[2] == "None" else parts[2]
                found[parts[0]] = JobInfo(parts[0], parts[1], reason, parts[3], parts[4])
        return found

    def queue_exists(self, name: str) -> bool | None:
        """Whether the partition exists (None when sinfo cannot answer)."""
        done = run_command(["sinfo", "-h", "-o", "%R"])
        if done is None or done.returncode != 0:
            return None
        return name in done.stdout.split()

    def stderr_path(self, job_id: str) -> str | None:
        done = run_command(["scontrol", "show", "job", str(job_id)])
        if done is None or done.returncode != 0:
            return None
        match = re.search(r"\bStdErr=(\S+)", done.stdout)
        if not match:
            return None
        name = re.search(r"\bJobName=(\S+)", done.stdout)
        return expand_slurm_pattern(match.group(1), str(job_id), name.group(1) if name else "")

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            run_command(["scancel", *job_ids])

    def stranded(self, jobs: dict[str, JobInfo]) -> dict[str, str]:
        """Jobs SLURM keeps COMPLETING because every node of theirs stopped answering (its
        slurmd is gone: state ``*``, or down): they leave the queue only once their node
        registers again. Job id -> 'node n3 is not responding (down*)'."""
        found = {}
        for job_id, info in jobs.items():
            if info.state != "COMPLETING" or not info.nodes:
                continue
            done = run_command(["sinfo", "-h", "-N", "-n", info.nodes, "-o", "%N %T"])
            if done is None or done.returncode != 0:
                continue
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            if states and all(s.endswith("*") or s.startswith("down") for s in states.values()):
                where = ", ".join(f"{node} ({state})" for node, state in sorted(states.items()))
                found[job_id] = f"node {where} is not responding"
        return found


def expand_slurm_pattern(pattern: str, job_id: str, job_name: str) -> str:
    """A file name pattern as sbatch expands it for the batch step (``%j``, ``%J``, ``%A``:
    the job id; ``%x``: the job name; ``%u``: the user; ``%%``: ``%``)."""
    import getpass

    values = {"j": job_id, "J": job_id, "A": job_id, "x": job_name, "u": getpass.getuser()}
    return re.sub(r"%(%|[jJAxu])", lambda m: "%" if m[1] == "%" else values[m[1]], pattern)


class SLURMBackend(JobQueueBackend):
    """Workers in SLURM jobs (dask_jobqueue.SLURMCluster)."""

    NAME = "slurm"
    Profile = SLURMProfile
    JOB_NAME_LIMIT = 64
    QUEUE = SlurmQueue()
    LOG_PATTERN = "*.err"
    QUEUE_HINT = "`sinfo -s`"

    def job_class(self) -> type[Any]:
        from dask_jobqueue.slurm import SLURMJob

        return SLURMJob

    def cluster_class(self) -> type[Any]:
        from dask_jobqueue import SLURMCluster

        return drained(SLURMCluster, self.QUEUE)

    def gpu_directives(self, profile: JobQueueProfile) -> list[str]:
        gpus = profile.worker.gpus * profile.processes
        if not gpus:
            return []
        if getattr(profile, "gpu_directive", "gres") == "gpus-per-task":
            return [f"--gpus-per-task={gpus}"]  # jobqueue's jobs are one task
        return [f"--gres=gpu:{gpus}"]

    def log_in(self, directory: str, job_name: str, job_id: str) -> str:
        return os.path.join(directory, f"{job_name}-{job_id}.err")  # "#SBATCH -e {dir}/...-%J.err"

    def default_log_in(self, directory: str, job_name: str, job_id: str) -> str:
        return os.path.join(directory, f"slurm-{job_id}.out")  # sbatch's default, both streams
