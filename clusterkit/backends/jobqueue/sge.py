"""The sge backend: Grid Engine (SGE, Son of Grid Engine, Univa/Altair) via dask-jobqueue.

Grid Engine has no standard name for GPUs or memory, and a job gets one slot unless it asks a
parallel environment for more; the profile names the site's resources (``gpu_resource``,
``memory_resource``, ``parallel_environment``). Jobs merge stderr into stdout (``-j y``).
"""

from __future__ import annotations

import getpass
import math
import os
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clusterkit.backends.base import Check
from clusterkit.backends.jobqueue.cluster import drained
from clusterkit.backends.jobqueue.commands import JobInfo, run_command
from clusterkit.backends.jobqueue.core import JobQueueBackend
from clusterkit.backends.jobqueue.jobs import hms
from clusterkit.schema import SGEProfile

if TYPE_CHECKING:
    from clusterkit.schema import JobQueueProfile
    from clusterkit.security import ClusterSecurity


def parse_qstat_xml(text: str) -> list[tuple[str, JobInfo]]:
    """(job name, job) of ``qstat -xml`` (running under queue_info, pending under job_info)."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return []
    jobs = []
    for item in root.iter("job_list"):
        info = JobInfo(
            job_id=item.findtext("JB_job_number", ""),
            state=item.findtext("state", "?"),
            nodes=item.findtext("queue_name") or "",
            elapsed=item.findtext("JAT_start_time") or "",
        )
        jobs.append((item.findtext("JB_name", ""), info))
    return jobs


def task_start(text: str) -> float | None:
    """The start of a job's (first started) task in ``qstat -j ID -xml``: ``JAT_start_time``
    under ``JB_ja_tasks``, seconds since the epoch (milliseconds in Univa/Altair Grid Engine);
    None before it started."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return None
    for tasks in root.iter("JB_ja_tasks"):
        for stamp in tasks.iter("JAT_start_time"):
            value = float(stamp.text or 0)
            if value > 0:
                return value / 1000 if value > 1e11 else value
    return None


def parse_qstat_j(text: str) -> dict[str, str]:
    """``qstat -j ID``: ``key: value`` lines; indented lines continue the previous value (each
    on a line of its own: the scheduler's messages, one per queue)."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line[:1].isspace() and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line and not line.startswith("="):
            key, _, value = line.partition(":")
            key = re.sub(r"\s+\d+$", "", key.strip())  # "error reason    1" -> "error reason"
            fields[key] = value.strip()
    return fields


def pending_reason(fields: dict[str, str]) -> str:
    """Why Grid Engine does not run the job: its error, else the scheduler's first message."""
    if fields.get("error reason"):
        return fields["error reason"]
    info = fields.get("scheduling info", "")
    return "" if info.startswith("There are no messages") else info.split("\n")[0]


def output_path(fields: dict[str, str], job_id: str) -> str | None:
    """The file a job writes (stdout, where ``-j y`` also puts stderr)."""
    where = fields.get("stdout_path_list", "")
    path = where.rsplit(":", 1)[-1] if where else ""
    name = f"{fields.get('job_name', '')}.o{job_id}"
    if not path or path == "NONE":
        workdir = fields.get("sge_o_workdir") or fields.get("cwd")
        return os.path.join(workdir, name) if workdir else None
    if path.endswith("/") or os.path.isdir(path):
        return os.path.join(path, name)
    return path


class SGEQueue:
    """qstat / qdel / qconf."""

    system = "sge"
    cancel_command = "qdel"

    def job_here(self, environ: Mapping[str, str]) -> str | None:
        """The id of the Grid Engine job this process runs in (``JOB_ID``, with ``SGE_ROOT``)."""
        return environ.get("JOB_ID") if environ.get("SGE_ROOT") else None

    def start_command(self, job_id: str) -> list[str]:
        return ["qstat", "-j", job_id, "-xml"]

    def parse_start(self, text: str) -> float | None:
        """:func:`task_start` of ``qstat -j ID -xml``."""
        return task_start(text)

    def _all(self, user: str) -> list[tuple[str, JobInfo]]:
        done = run_command(["qstat", "-u", user, "-xml"])
        if done is None or done.returncode != 0:
            return []
        return parse_qstat_xml(done.stdout)

    def named(self, job_name: str) -> list[str]:
        """Ids of this user's jobs with that name."""
        return [job.job_id for name, job in self._all(getpass.getuser()) if name == job_name]

    def _details(self, job_id: str) -> dict[str, str]:
        done = run_command(["qstat", "-j", job_id])
        return parse_qstat_j(done.stdout) if done is not None and done.returncode == 0 else {}

    def jobs(self, job_ids: Iterable[str]) -> dict[str, JobInfo]:
        wanted = {str(j) for j in job_ids if j}
        if not wanted:
            return {}
        found = {}
        for _, job in self._all("*"):
            if job.job_id not in wanted:
                continue
            waiting = "q" in job.state or "E" in job.state or "h" in job.state
            reason = pending_reason(self._details(job.job_id)) if waiting else ""
            found[job.job_id] = JobInfo(job.job_id, job.state, reason, job.nodes, job.elapsed)
        return found

    def queue_exists(self, name: str) -> bool | None:
        done = run_command(["qconf", "-sq", name])
        return None if done is None else done.returncode == 0

    def stderr_path(self, job_id: str) -> str | None:
        fields = self._details(str(job_id))
        return output_path(fields, str(job_id)) if fields else None

    def cancel(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            run_command(["qdel", *job_ids])

    def stranded(self, jobs: dict[str, JobInfo]) -> dict[str, str]:
        """Jobs held in the queue by a node that stopped answering: not known here."""
        return {}


def memory_per_slot(profile: JobQueueProfile) -> str:
    """The job's memory divided over its slots, in Grid Engine's units (M = MiB), rounded up."""
    slots = profile.cores if getattr(profile, "parallel_environment", None) else 1
    return f"{math.ceil(int(profile.memory) / slots / 2**20)}M"


class SGEBackend(JobQueueBackend):
    """Workers in Grid Engine jobs (dask_jobqueue.SGECluster)."""

    NAME = "sge"
    Profile = SGEProfile
    JOB_NAME_LIMIT = 64
    QUEUE = SGEQueue()
    LOG_PATTERN = "{job_name}.o*"
    QUEUE_HINT = "`qconf -sql`"

    def job_class(self) -> type[Any]:
        from dask_jobqueue.sge import SGEJob

        return SGEJob

    def cluster_class(self) -> type[Any]:
        from dask_jobqueue import SGECluster

        return drained(SGECluster, self.QUEUE)

    def gpu_directives(self, profile: JobQueueProfile) -> list[str]:
        gpus = profile.worker.gpus * profile.processes
        return [f"-l {profile.gpu_resource}={gpus}"] if gpus else []  # type: ignore[attr-defined]

    def job_options(
        self, profile: JobQueueProfile, security: ClusterSecurity, job_name: str
    ) -> dict[str, Any]:
        assert isinstance(profile, SGEProfile)
        kwargs = super().job_options(profile, security, job_name)
        kwargs["project"] = kwargs.pop("account")  # -P
        kwargs["walltime"] = hms(profile.walltime)  # -l h_rt=
        spec = profile.resource_spec
        if spec is None and profile.memory_resource:
            spec = f"{profile.memory_resource}={memory_per_slot(profile)}"
        kwargs["resource_spec"] = spec
        if profile.parallel_environment and profile.cores > 1:
            pe = f"-pe {profile.parallel_environment} {profile.cores}"
            kwargs["job_extra_directives"] = [pe, *kwargs["job_extra_directives"]]
        return kwargs

    def log_in(self, directory: str, job_name: str, job_id: str) -> str:
        return os.path.join(directory, f"{job_name}.o{job_id}")  # "-o DIR/", "-j y"

    def site_checks(self, profile: JobQueueProfile) -> list[Check]:
        """The GPU and memory complexes and the parallel environment exist."""
        assert isinstance(profile, SGEProfile)
        if not shutil.which("qconf"):
            return []
        checks = []
        wanted = [profile.memory_resource] if profile.memory_resource else []
        wanted += [profile.gpu_resource] if profile.worker.gpus else []
        done = run_command(["qconf", "-sc"]) if wanted else None
        known = _complexes(done.stdout) if done and done.returncode == 0 else set()
        for name in wanted if known else []:
            checks.append(
                Check(
                    f"sge resource '{name}'",
                    ok=name in known,
                    detail="a complex of the cell" if name in known else "not in `qconf -sc`",
                    fix="set gpu_resource/memory_resource to your site's names (qconf -sc)",
                )
            )
        if profile.parallel_environment:
            done = run_command(["qconf", "-sp", profile.parallel_environment])
            if done is not None:
                checks.append(
                    Check(
                        f"sge parallel environment '{profile.parallel_environment}'",
                        ok=done.returncode == 0,
                        detail="exists" if done.returncode == 0 else "unknown to qconf -spl",
                        fix="set parallel_environment to one listed by `qconf -spl`",
                    )
                )
        return checks


def _complexes(text: str) -> set[str]:
    """Names and shortcuts of ``qconf -sc``."""
    rows = (line.split() for line in text.splitlines() if not line.startswith("#"))
    return {name for row in rows if len(row) > 1 for name in row[:2]}
