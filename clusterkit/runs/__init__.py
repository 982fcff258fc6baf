"""Runs: searches and trainings as library objects, and detached ones that outlive the
terminal that started them.

A run is a :class:`RunSpec` (:mod:`.spec`): kind, target and options, checked once.
:func:`execute` runs one in this process (``clusterkit hpo|train``); :func:`launch` (or
``clusterkit hpo|train ... --detach``) checks it against what it names, records it in
``<state dir>/runs/ID.json`` and starts a monitor in its own session that runs the driver (the
spec, executed) and restarts it after a death by signal. :func:`list_runs`, :func:`show`,
:func:`logs`, :func:`wait` and :func:`stop` are what ``clusterkit runs`` calls.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from clusterkit import state
from clusterkit.errors import BadInput, ClusterkitError
from clusterkit.runs.launching import launch, submit
from clusterkit.runs.records import (
    RunRecord,
    UnreadableRun,
    all_runs,
    get,
    new_id,
    progress,
    request_stop,
)
from clusterkit.runs.status import shown_state

if TYPE_CHECKING:
    from clusterkit.runs.execution import execute
    from clusterkit.runs.spec import RunSpec

__all__ = [
    "RunRecord",
    "RunSpec",
    "execute",
    "launch",
    "list_runs",
    "logs",
    "new_id",
    "resume",
    "show",
    "stop",
    "stop_on_cluster",
    "submit",
    "wait",
]


def __getattr__(name: str) -> Any:
    """``RunSpec`` and ``execute``, imported when first used (pydantic is not cheap)."""
    if name == "RunSpec":
        from clusterkit.runs.spec import RunSpec

        return RunSpec
    if name == "execute":
        from clusterkit.runs.execution import execute

        return execute
    raise AttributeError(f"module 'clusterkit.runs' has no attribute {name!r}")


#: Seconds ``stop`` waits for the driver's graceful end before ending its process group.
STOP_TIMEOUT = 60.0


def row(entry: RunRecord | UnreadableRun) -> dict[str, Any]:
    """One run as ``runs`` lists it."""
    if isinstance(entry, UnreadableRun):
        return {
            "id": entry.id,
            "kind": None,
            "target": str(entry.path),
            "state": f"unreadable: {entry.reason}",
            "progress": None,
            "best": None,
            "started": None,
            "restarts": None,
        }
    shown = progress(entry)
    done = f"{shown['done']}/{shown['total']}" if "done" in shown else None
    if "epoch" in shown or "step" in shown:
        done = f"epoch {shown['epoch']}" if "epoch" in shown else f"step {shown['step']}"
    return {
        "id": entry.id,
        "kind": entry.kind,
        "target": _target(entry),
        "state": shown_state(entry),
        "progress": done,
        "best": shown.get("best"),
        "started": entry.started_at,
        "restarts": entry.restarts,
        "restart_reasons": list(entry.reasons),
    }


def _target(record: RunRecord) -> str:
    from clusterkit.runs import batch as batch_job

    if record.batch is not None:
        job = batch_job.job_id(record) or "(submitting)"
        return f"{record.batch['system']} job {job} ({record.profile})"
    return f"cluster {record.cluster}" if record.cluster else f"profile {record.profile}"


def list_runs() -> list[dict[str, Any]]:
    """Every run, oldest first; unreadable records are listed with their path."""
    return [row(entry) for entry in all_runs()]


def show(run_id: str) -> dict[str, Any]:
    """Everything about one run: results folder, driver host and pid, restarts and why."""
    record = get(run_id)
    info = row(record)
    info.update(
        command=f"clusterkit {record.kind} {' '.join(record.argv)}",
        cwd=record.cwd,
        results=record.results,
        log=str(record.log),
        host=record.host,
        driver_pid=record.driver_pid,
        monitor_pid=record.monitor_pid,
        max_restarts=record.max_restarts,
        exit_code=record.exit_code,
        reason=record.reason,
        ended=record.ended_at,
    )
    return info


def _local(record: RunRecord, verb: str) -> None:
    if record.elsewhere:
        raise BadInput(
            f"run '{record.id}' runs on host {record.host}: only there can it be {verb}",
            hint=f"ssh {record.host} clusterkit runs {verb.split()[0]} {record.id}",
        )


def stop(run_id: str, *, timeout: float = STOP_TIMEOUT) -> RunRecord:
    """Stop the driver gracefully (the study keeps every finished trial; the cluster stays).

    SIGTERM, as Ctrl-C would; after ``timeout`` the driver's process group is killed."""
    from clusterkit.lifecycle.spawn import kill_group

    record = get(run_id)
    if record.final:
        return record
    if record.batch is not None:
        from clusterkit.runs import batch as batch_job

        return batch_job.stop(record, timeout)
    _local(record, "stopped")
    request_stop(run_id)
    signalled: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        record = get(run_id)
        if record.final:
            return record
        pid = record.driver_pid
        alive = state.pid_alive(pid)
        if pid and alive and pid not in signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            signalled.add(pid)
        gone = record.monitor_pid is not None and not state.pid_alive(record.monitor_pid)
        never = record.monitor_pid is None and time.monotonic() > deadline
        if gone or never:  # nobody left to record the end
            if pid and alive:
                kill_group(pid, grace=5.0)
            record.state, record.reason, record.ended_at = "stopped", "stopped", time.time()
            record.exit_code = 130
            record.save()
            return record
        if time.monotonic() > deadline and pid and alive:
            kill_group(pid, grace=5.0)
        time.sleep(0.1)


def wait(run_id: str, *, timeout: float | None = None) -> int:
    """Block until the run ends; its exit status (0: succeeded)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        record = get(run_id)
        if record.final:
            if record.state == "succeeded":
                return 0
            return record.exit_code or 1
        if _gone(record):
            raise ClusterkitError(f"run '{run_id}': {shown_state(record)}")
        if deadline is not None and time.monotonic() > deadline:
            raise ClusterkitError(f"run '{run_id}' is still {record.state} after {timeout:g}s")
        time.sleep(0.2)


def logs(run_id: str, *, follow: bool = False, lines: int | None = None) -> Iterator[str]:
    """The driver's output (every attempt, with the monitor's notes); ``follow`` goes on
    until the run ends, as ``tail -f``."""
    record = get(run_id)
    path = record.log
    position = 0
    if lines is not None and path.exists():
        text = path.read_text(errors="replace")
        kept = "".join(text.splitlines(keepends=True)[-lines:])
        position = len(text.encode()) - len(kept.encode())
    while True:
        try:
            with open(path, "rb") as handle:
                handle.seek(position)
                chunk = handle.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            position += len(chunk)
            yield chunk.decode(errors="replace")
        if not follow:
            return
        record = get(run_id)
        if record.final or _gone(record):
            with open(path, "rb") as handle:  # what the last moment wrote
                handle.seek(position)
                rest = handle.read()
            if rest:
                yield rest.decode(errors="replace")
            return
        time.sleep(0.2)


def _lost(record: RunRecord) -> bool:
    """Whether nothing runs the run any more: its monitor died here, or its batch job left
    the queue (a job being requeued has no monitor for a while, and is not lost)."""
    if record.batch is not None:
        from clusterkit.runs.batch import job_gone

        return job_gone(record) and not get(record.id).final
    if record.elsewhere:  # its host's monitor records the end on the shared state directory
        return False
    return record.monitor_pid is not None and not state.pid_alive(record.monitor_pid)


def _gone(record: RunRecord) -> bool:
    """Lost, with nobody to resume it: not a run on a cluster whose supervisor will."""
    return _lost(record) and not _supervised(record)


def _supervised(record: RunRecord) -> bool:
    """Whether the run's cluster is up here: its supervisor resumes a run that lost its
    monitor within seconds (:func:`resume_lost_on_cluster`)."""
    cluster = state.read_record(record.cluster) if record.cluster else None
    return cluster is not None and state.is_live(cluster) and not cluster.elsewhere


def resume(run_id: str, *, why: str = "resumed by `clusterkit runs resume`") -> RunRecord:
    """Start a lost run again: its monitor died (its host rebooted, it was killed) or its
    batch job left the queue. What the old driver may still run is ended first; the search
    resumes from its storage, the training from its last checkpoint; counted as a restart."""
    from clusterkit.lifecycle.spawn import group_alive, kill_group
    from clusterkit.runs import batch as batch_job
    from clusterkit.runs.process import detach, fresh_interpreter

    record = get(run_id)
    if record.final:
        raise BadInput(f"run '{run_id}' has ended ({record.state}): start it again instead")
    if not _lost(record):
        raise BadInput(f"run '{run_id}' is not lost: {shown_state(record)}")
    if record.batch is None:
        _local(record, "resumed")
        if record.driver_pid and group_alive(record.driver_pid):
            kill_group(record.driver_pid, grace=10.0)
    record.restarts += 1
    record.reasons.append(why)
    record.monitor_pid = record.driver_pid = None
    if record.batch is None:
        record.state = "restarting"
        record.save()
        with fresh_interpreter():  # the caller may be long-lived (a supervisor, a notebook)
            detach(record)
    else:
        record.batch.update(job_id=None, starts=0)  # the new job counts no second restart
        record.state = "queued"
        record.save()
        batch_job.resubmit(record)
    return get(run_id)


def resume_lost_on_cluster(name: str) -> list[str]:
    """What the supervisor of cluster ``name`` runs every few seconds: its runs on this host
    whose monitor died are started again (within their restarts; else they fail)."""
    from clusterkit.runs.process import end

    resumed = []
    for entry in all_runs():
        if not isinstance(entry, RunRecord) or entry.cluster != name or entry.final:
            continue
        if entry.batch is not None or not _lost(entry):
            continue
        why = f"monitor pid {entry.monitor_pid} gone"
        if entry.restarts >= entry.max_restarts:
            end(entry, "failed", 1, f"{why}, no restart left ({entry.restarts})")
            continue
        resume(entry.id, why=f"{why}: resumed by the supervisor of cluster '{name}'")
        resumed.append(entry.id)
    return resumed


def stop_on_cluster(name: str) -> list[str]:
    """Stop every unfinished run attached to cluster ``name`` on this host; their IDs."""
    stopped = []
    for entry in all_runs():
        if isinstance(entry, RunRecord) and entry.cluster == name and not entry.final:
            if entry.elsewhere:
                continue
            stop(entry.id)
            stopped.append(entry.id)
    return stopped
