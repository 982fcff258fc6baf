"""What the batch system says about a cluster's jobs: state, pending reason, log files, queue."""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT = 30.0


@dataclass(frozen=True)
class JobInfo:
    """One batch job as the batch system reports it."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    elapsed: str = ""
    stderr_path: str | None = None


class BatchQueue(Protocol):
    """What the backends ask of a batch system's command-line tools."""

    system: str
    cancel_command: str

    def named(self, job_name: str) -> list[str]: ...
    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]: ...
    def queue_exists(self, name: str) -> bool | None: ...
    def stderr_path(self, job_id: str) -> str | None: ...
    def cancel(self, job_ids: Sequence[str]) -> None: ...


def _run(command: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("%s failed: %s", command[0], error)
        return None


class SlurmQueue:
    """squeue / scontrol / scancel."""

    system = "slurm"
    cancel_command = "scancel"

    def named(self, job_name: str) -> list[str]:
        """Ids of this user's jobs with that name."""
        done = _run(["squeue", "-h", "--me", "--name", job_name, "-o", "%i"])
        return done.stdout.split() if done is not None and done.returncode == 0 else []

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        """Jobs still known to squeue (pending, running, completing), by id."""
        wanted = {str(j) for j in job_ids if j}
        if not wanted:
            return {}
        # all jobs, filtered here: `squeue -j` fails outright when one id is already gone
        done = _run(["squeue", "-h", "-o", "%i|%T|%r|%N|%M"])
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
        done = _run(["sinfo", "-h", "-o", "%R"])
        if done is None or done.returncode != 0:
            return None
        return name in done.stdout.split()

    def stderr_path(self, job_id: str) -> str | None:
        done = _run(["scontrol", "show", "job", str(job_id)])
        if done is None or done.returncode != 0:
            return None
        match = re.search(r"\bStdErr=(\S+)", done.stdout)
        if not match:
            return None
        name = re.search(r"\bJobName=(\S+)", done.stdout)
        return expand_slurm_pattern(match.group(1), str(job_id), name.group(1) if name else "")

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            _run(["scancel", *job_ids])


class PBSQueue:
    """qstat / qdel (PBS Pro, OpenPBS, Torque: `qstat -f` blocks of `key = value`)."""

    system = "pbs"
    cancel_command = "qdel"

    def named(self, job_name: str) -> list[str]:
        """Ids of this user's jobs with that name."""
        import getpass

        done = _run(["qselect", "-N", job_name, "-u", getpass.getuser()])
        return done.stdout.split() if done is not None and done.returncode == 0 else []

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        found: dict[str, JobInfo] = {}
        for job_id in {str(j) for j in job_ids if j}:
            done = _run(["qstat", "-f", job_id])
            if done is None or done.returncode != 0:
                continue  # finished jobs are unknown to qstat without -x
            info = parse_qstat_full(job_id, done.stdout)
            if info.state not in {"F", "C"}:  # finished (PBS Pro), completed (Torque)
                found[job_id] = info
        return found

    def queue_exists(self, name: str) -> bool | None:
        """Whether the queue exists (None when qstat cannot answer at all)."""
        done = _run(["qstat", "-Q", name])
        if done is None:
            return None
        return done.returncode == 0

    def stderr_path(self, job_id: str) -> str | None:
        done = _run(["qstat", "-f", str(job_id)])
        if done is None or done.returncode != 0:
            return None
        return parse_qstat_full(job_id, done.stdout).stderr_path

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            _run(["qdel", *job_ids])


def expand_slurm_pattern(pattern: str, job_id: str, job_name: str) -> str:
    """A file name pattern as sbatch expands it for the batch step (``%j``, ``%J``, ``%A``:
    the job id; ``%x``: the job name; ``%u``: the user; ``%%``: ``%``)."""
    import getpass

    values = {"j": job_id, "J": job_id, "A": job_id, "x": job_name, "u": getpass.getuser()}
    return re.sub(r"%(%|[jJAxu])", lambda m: "%" if m[1] == "%" else values[m[1]], pattern)


def parse_qstat_full(job_id: str, text: str) -> JobInfo:
    """A JobInfo from `qstat -f` output; continuation lines start with a tab."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("\t") and key:
            fields[key] += line.strip()
        elif " = " in line:
            key, _, value = line.strip().partition(" = ")
            fields[key] = value
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


def cancel_and_wait(queue: BatchQueue, job_ids: Sequence[str], timeout: float) -> list[str]:
    """Cancel jobs still queued and wait until the queue no longer lists them; the ones left."""
    left = sorted(queue.jobs(job_ids))
    deadline = time.monotonic() + timeout
    cancelled = False
    while left:
        if not cancelled:
            queue.cancel(left)
            cancelled = True
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        left = sorted(queue.jobs(left))
    return left


def tail(path: str | None, lines: int = 10) -> list[str]:
    """The last non-blank lines of a job's log file (empty if it is not readable here)."""
    if not path:
        return []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]
