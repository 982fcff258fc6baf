"""The lifecycle verbs over any backend: render, up, down, ls, status, scale, adapt, logs.

How a cluster starts lives in ``lifecycle``; how processes are spawned and stopped in
``lifecycle.spawn``; this module only decides which of them a verb needs.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from clusterkit import monitor, state
from clusterkit.backends.base import check_capabilities, get_backend
from clusterkit.client import connect
from clusterkit.errors import BadInput, ClusterNotFound, ClusterStartError
from clusterkit.lifecycle import reap
from clusterkit.lifecycle.up import up as up  # re-exported: the verbs' one entry point
from clusterkit.monitor import scheduler_identity
from clusterkit.searchpath import check_name
from clusterkit.security import WEB_TOKEN_NAME, ClusterSecurity, prepare
from clusterkit.state import ClusterRecord

if TYPE_CHECKING:
    from clusterkit.schema import ProfileCommon

DOWN_TIMEOUT = 30.0
DEAD = "dead: its supervisor or owner is gone (`clusterkit down NAME` removes what is left)"


def render(profile_ref: str | os.PathLike[str] | ProfileCommon) -> str:
    """What the backend would run for this profile (job script, commands, manifest)."""
    from clusterkit.profiles import load_profile

    profile = load_profile(profile_ref)
    backend = get_backend(profile.backend_name)
    check_capabilities(backend, profile)
    token = f"<cluster-dir>/{WEB_TOKEN_NAME}"  # every cluster's web pages need their secret
    security = ClusterSecurity(protocol=profile.protocol, web_token_file=token)
    if profile.protocol == "tls":
        security = ClusterSecurity.in_directory("<cluster-dir>")
    elif profile.protocol == "ucx":
        security = prepare(profile, None)
        security.web_token_file = token
    return backend.render(profile, security)


def get_record(name: str) -> ClusterRecord:
    """The live record of ``name``, or ClusterNotFound naming the clusters that are up.

    A record file that became unreadable is rewritten from what its supervisor knows.
    """
    check_name(name)
    loaded = state.load_record(name)
    record = reap.recovered(loaded) if isinstance(loaded, state.Unreadable) else loaded
    if record is None:
        known = ", ".join(r.name for r in state.records() if state.is_live(r)) or "none"
        raise ClusterNotFound(f"no cluster named '{name}' is up", hint=f"up: {known}")
    if not state.is_live(record):
        who = f"supervisor (pid {record.pid})" if record.pid else f"owner (pid {record.owner})"
        raise ClusterNotFound(
            f"cluster '{name}' is dead: its {who} is gone",
            hint=f"`clusterkit down {name}` removes what is left of it",
        )
    if record.starting:
        raise ClusterNotFound(
            f"cluster '{name}' is still starting (pid {record.pid or record.owner})",
            hint=f"wait for it, or `clusterkit down {name}` to stop it",
        )
    return record


def down(name: str, *, timeout: float = DOWN_TIMEOUT) -> None:
    """Close gracefully, kill the process group after ``timeout``, drop the record.

    A cluster whose record is unreadable (and whose supervisor cannot answer) is still
    stopped, through the supervisor's pid file.
    """
    from clusterkit.errors import ClusterkitError

    stop_runs_on(name)
    try:
        record = get_record(name)
    except ClusterkitError:
        loaded = state.load_record(name)
        if isinstance(loaded, state.Unreadable) or state.supervisor_pid(name):
            reap.down_by_pid_file(name, timeout)  # unreadable, or still starting: no record yet
        elif isinstance(loaded, ClusterRecord):
            reap.reap(loaded)
        else:
            raise
        return
    if record.elsewhere:
        raise BadInput(
            f"cluster '{name}' is supervised on host {record.host}: only there can it be stopped",
            hint=f"ssh {record.host} clusterkit down {name}",
        )
    with state.lock(name):
        if record.pid is not None:
            from clusterkit.lifecycle.spawn import stop_supervisor

            stop_supervisor(record.pid, timeout)
        # by its tags too: what the supervisor's own close could not reach (a dropped SSH
        # connection, a job it never heard of) must not outlive `down`
        get_backend(record.backend).teardown(record)
        state.remove_cluster(name)


def stop_runs_on(name: str) -> list[str]:
    """Detached runs on ``name`` are stopped first (their studies keep finished trials): the
    ``before_down`` hooks, which clusterkit.runs registers; the IDs of the runs stopped."""
    from clusterkit.lifecycle import hooks

    return hooks.call(hooks.BEFORE_DOWN, name)


def down_all(*, timeout: float = DOWN_TIMEOUT, dead_only: bool = False) -> list[str]:
    """``down`` of every cluster (or, ``dead_only``, of those whose supervisor is gone)."""
    names = [
        r.name for r in state.records() if not (r.elsewhere or (dead_only and state.is_live(r)))
    ]
    names += [u.name for u in state.unreadable_records()]
    for name in names:
        down(name, timeout=timeout)
    return names


def list_clusters(*, orphans: bool = False) -> list[dict[str, Any]]:
    """Clusters with worker and GPU counts, in the order they started, the newest last (as
    ``clusterkit runs`` lists runs); dead and unreadable ones are listed, not hidden."""
    rows = []
    for record in state.records():
        if orphans and state.is_live(record):
            continue
        if not state.is_live(record):
            info: dict[str, Any] = {"state": DEAD}
        elif record.elsewhere:  # its address may be the other host's loopback: not probed
            info = {"state": f"up on host {record.host}"}
        elif record.starting:
            info = {"state": f"starting (pid {record.pid or record.owner})"}
        else:
            info = _summary(record)
        if record.owner is not None and info.get("state") == "up":
            info["state"] = f"up (embedded in pid {record.owner})"
        rows.append(
            {
                "name": record.name,
                "backend": record.backend,
                "address": record.address,
                "workers": info.get("workers"),
                "gpus": info.get("gpus"),
                "gpus_busy": info.get("gpus_busy"),
                "age": record.age,
                "state": info.get("state", "up"),
                "dashboard": record.dashboard,
            }
        )
    for starting in state.starting_clusters():  # a supervisor still starting: no record yet
        rows.append(
            {
                "name": starting,
                "backend": None,
                "address": None,
                "workers": None,
                "gpus": None,
                "age": 0.0,
                "state": f"starting (supervisor pid {state.supervisor_pid(starting)})",
                "dashboard": None,
            }
        )
    for unreadable in state.unreadable_records():  # never hidden: `down NAME` still stops it
        rows.append(
            {
                "name": unreadable.name,
                "backend": None,
                "address": str(unreadable.path),
                "workers": None,
                "gpus": None,
                "age": time.time() - unreadable.path.stat().st_mtime,
                "state": f"unreadable: {unreadable.reason}",
                "dashboard": None,
            }
        )
    return sorted(rows, key=lambda row: (-row["age"], row["name"]))


def _summary(record: ClusterRecord) -> dict[str, Any]:
    try:
        workers = _worker_rows(record)
    except Exception as error:  # unreachable is a state to show, not a crash
        return {"state": f"unreachable ({type(error).__name__})"}
    busy, total = monitor.gpus_busy(workers)
    return {"workers": len(workers), "gpus": total, "gpus_busy": busy, "state": "up"}


def _worker_rows(record: ClusterRecord, timeout: float = 5) -> list[dict[str, Any]]:
    with connect(record, timeout=timeout) as client:
        info = scheduler_identity(client)
        processing = client.processing()
    rows = [
        monitor.worker_row(address, worker, len(processing.get(address, ())))
        for address, worker in info["workers"].items()
    ]
    return sorted(rows, key=lambda row: (_natural_key(row["name"]), _natural_key(row["address"])))


def _natural_key(text: str) -> list[tuple[int, int | str]]:
    """Sorts ``worker-2`` before ``worker-10`` (and ``:9000`` before ``:10000``)."""
    import re

    return [(1, int(part)) if part.isdigit() else (0, part) for part in re.split(r"(\d+)", text)]


def list_resources(backend_name: str) -> list[dict[str, Any]]:
    """Clusters a backend can see beyond clusterkit's records (e.g. DaskClusters in Kubernetes)."""
    from clusterkit.backends.base import require

    backend = get_backend(backend_name)
    require(backend, backend_name)
    return backend.list_resources()


def status(name: str) -> dict[str, Any]:
    """Per worker: CPU, memory, GPU use, tasks running and queued; the scaling mode; backend
    rows (jobs, pods)."""
    record = get_record(name)
    workers = _worker_rows(record, timeout=30)
    mode = None
    if record.control:
        described = _control(record, {"op": "describe"})
        rows, mode = described.get("rows", []), described.get("mode")
    else:  # a detached cluster: the backend asks its own API
        rows = [row.__dict__ for row in get_backend(record.backend).describe_record(record)]
    busy, total = monitor.gpus_busy(workers)
    return {
        "name": record.name,
        "backend": record.backend,
        "address": record.address,
        "dashboard": monitor.dashboard_link(record),
        "age": record.age,
        "mode": mode,
        "gpus_busy": busy,
        "gpus": total,
        "workers": workers,
        "rows": rows,
    }


def _control(record: ClusterRecord, request: dict[str, Any]) -> dict[str, Any]:
    from clusterkit.errors import ClusterkitError
    from clusterkit.lifecycle import control

    if not record.control:
        raise BadInput(f"cluster '{record.name}' has no supervisor to ask")
    if record.elsewhere:
        raise BadInput(
            f"cluster '{record.name}' is supervised on host {record.host}",
            hint=f"run this command there (ssh {record.host})",
        )
    try:
        return control.request(record.control, request)
    except ClusterkitError as error:
        raise ClusterkitError(f"cluster '{record.name}': {error.message}") from None


def scale(name: str, n: int, *, wait: bool = True, timeout: float = 120) -> bool:
    """Set the number of workers; waits until the count is reached.

    A fixed size ends adaptive scaling; returns whether it was on.
    """
    if n < 0:
        raise BadInput(f"cannot scale to {n} workers", hint="give 0 or more")
    record = get_record(name)
    ended_adaptive = False
    if record.pid is None:
        get_backend(record.backend).scale_record(record, n)
    else:
        ended_adaptive = bool(_control(record, {"op": "scale", "n": n}).get("ended_adaptive"))
    if wait:
        _wait_for_count(record, n, timeout)
    return ended_adaptive


def _wait_for_count(record: ClusterRecord, n: int, timeout: float) -> None:
    with connect(record) as client:
        deadline = time.monotonic() + timeout
        while len(scheduler_identity(client)["workers"]) != n:
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"did not reach {n} workers in {timeout:.0f}s", component="scale"
                )
            time.sleep(0.2)


def adapt(name: str, minimum: int | None = None, maximum: int | None = None) -> bool:
    """Turn adaptive scaling on (or change its bounds); with no bounds, turn it off.

    Returns whether adaptive scaling was on before (for ``off``).
    """
    record = get_record(name)
    if minimum is None and maximum is None:
        return bool(_control(record, {"op": "adapt", "off": True}).get("ended_adaptive"))
    low, high = minimum or 0, maximum if maximum is not None else max(minimum or 0, 1)
    if not 0 <= low <= high:
        raise BadInput(f"adapt needs 0 <= minimum <= maximum, got {low}..{high}")
    _control(record, {"op": "adapt", "minimum": low, "maximum": high})
    return True


def logs(
    name: str, *, lines: int = 200, component: str | None = None, since: str | None = None
) -> dict[str, list[str]]:
    """Recent log lines per component: ``supervisor``, ``scheduler``, ``worker ADDRESS``, and
    the backend's own (``job ID``: a batch job's log file, with what ran before its worker).

    ``component`` keeps one (``worker`` matches every worker; ``worker NAME`` one by name or
    address); ``since`` (``10m``) keeps lines written that recently.
    """
    from clusterkit.lifecycle.supervisor import log_tail

    record = get_record(name)
    after = monitor.parse_since(since)
    result: dict[str, list[str]] = {}
    if component in (None, "supervisor"):
        result["supervisor"] = log_tail(state.cluster_dir(name), lines)
    result.update(get_backend(record.backend).component_logs(record, component, lines))
    if component is None or (component != "supervisor" and not result):
        with connect(record) as client:
            result.update(monitor.cluster_logs(client, lines, component))
    if component is not None and not result:
        raise BadInput(
            f"no log component {component!r}",
            hint="supervisor, scheduler, worker [NAME], job ID (batch backends)",
        )
    return {key: monitor.since_filter(value, after) for key, value in result.items() if value}
