"""The queue-command plumbing every batch system shares: one job as the batch system reports
it (``JobInfo``), what the backends ask of a queue (``BatchQueue``, ``JobStarts``), running one
of its commands, cancelling jobs and waiting until they are gone, the start of the job this
process runs in, the tail of a job's log."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
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
    def stranded(self, jobs: dict[str, JobInfo]) -> dict[str, str]: ...


class JobStarts(Protocol):
    """A batch system that says when the job a process runs in started (SLURM, PBS, SGE)."""

    def job_here(self, environ: Mapping[str, str]) -> str | None: ...
    def start_command(self, job_id: str) -> list[str]: ...
    def parse_start(self, text: str) -> float | None: ...


def job_start(queue: JobStarts, environ: Mapping[str, str]) -> tuple[str, float] | None:
    """The id and start (seconds since the epoch) of the ``queue``'s job this process runs in,
    as the batch system reports it; None outside such a job, or when the system does not say."""
    job = queue.job_here(environ)
    if not job:
        return None
    done = run_command(queue.start_command(job))
    if done is None or done.returncode != 0:
        return None
    start = queue.parse_start(done.stdout)
    return None if start is None else (job, start)


def run_command(command: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
    """The command's result, or None when it could not run (missing, timed out)."""
    try:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("%s failed: %s", command[0], error)
        return None


def cancel_and_wait(queue: BatchQueue, job_ids: Sequence[str], timeout: float) -> list[str]:
    """Cancel jobs still queued and wait until the queue no longer lists them; the ones left.

    Jobs the queue keeps only because their node stopped answering (``queue.stranded``: a
    SLURM job COMPLETING on a node whose slurmd is gone) are not waited for: they leave when
    the node comes back, which no wait here can hasten. They are among the ones returned.
    """
    left = queue.jobs(job_ids)
    deadline = time.monotonic() + timeout
    cancelled = False
    while left:
        if not cancelled:
            queue.cancel(sorted(left))
            cancelled = True
        elif set(left) <= set(queue.stranded(left)):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        left = queue.jobs(left)
    return sorted(left)


def tail(path: str | None, lines: int = 10) -> list[str]:
    """The last non-blank lines of a job's log file (empty if it is not readable here)."""
    if not path:
        return []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]
