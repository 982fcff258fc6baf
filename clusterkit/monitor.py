"""What a running cluster is doing: per-worker load (CPU, memory, GPUs, tasks) and its logs.

Pure helpers over what the scheduler reports; ``api`` fetches, this module shapes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

#: distributed's log lines start with ``2026-11-24 15:58:01,123 - ...``
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def scheduler_identity(client: Any) -> dict[str, Any]:
    """The scheduler's own view, fetched now.

    ``client.scheduler_info()`` returns a cache that the client's periodic refresh can replace
    with a copy that lists no workers; asking the scheduler directly avoids that race.
    """
    identity: dict[str, Any] = client.sync(client.scheduler.identity, n_workers=-1)
    return identity


def worker_row(address: str, worker: dict[str, Any], processing: int) -> dict[str, Any]:
    """One worker's load: CPU, memory, GPU use (NVML, when the worker has GPUs), tasks."""
    metrics = worker.get("metrics", {})
    # distributed flattens the NVML metrics (gpu_utilization, gpu_memory_used, gpu-memory-total;
    # seen on an H200); older releases nest them under "gpu" and the total under the worker
    gpu = metrics.get("gpu") or {}
    total = metrics.get("gpu-memory-total") or (worker.get("gpu") or {}).get("memory-total")
    executing = int(metrics.get("task_counts", {}).get("executing", 0))
    return {
        "address": address,
        "name": str(worker.get("name")),
        "threads": worker.get("nthreads"),
        "cpu": metrics.get("cpu"),
        "memory": metrics.get("memory"),
        "memory_limit": worker.get("memory_limit"),
        "gpus": int(worker.get("resources", {}).get("GPU", 0)),
        "gpu_utilization": metrics.get("gpu_utilization", gpu.get("utilization")),
        "gpu_memory_used": metrics.get("gpu_memory_used", gpu.get("memory-used")),
        "gpu_memory_total": total,
        "running": executing,
        "queued": max(processing - executing, 0),
        "processing": processing,
    }


def cluster_logs(client: Any, lines: int, component: str | None) -> dict[str, list[str]]:
    """The scheduler's and workers' recent log lines, for one component or all."""
    result: dict[str, list[str]] = {}
    if component in (None, "scheduler"):
        result["scheduler"] = [msg for _, msg in client.get_scheduler_logs(n=lines)]
    if component is not None and not component.startswith("worker"):
        return result
    wanted = (component or "worker").removeprefix("worker").strip()
    names = {
        address: str(info.get("name"))
        for address, info in scheduler_identity(client)["workers"].items()
    }
    for address, entries in client.get_worker_logs(n=lines).items():
        if wanted in ("", address, names.get(address)):
            result[f"worker {address}"] = [msg for _, msg in entries]
    return result


def gpus_busy(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(busy, total) GPUs: busy when NVML shows utilization, else when its worker runs a task."""
    busy = total = 0
    for row in rows:
        total += row["gpus"]
        if not row["gpus"]:
            continue
        active = row["gpu_utilization"] if row["gpu_utilization"] is not None else row["running"]
        busy += row["gpus"] if active else 0
    return busy, total


def parse_since(text: str | None) -> float | None:
    """``10m`` -> the epoch seconds that far back (dask's duration syntax)."""
    if not text:
        return None
    from dask.utils import parse_timedelta

    from clusterkit.errors import BadInput

    try:
        seconds = parse_timedelta(text, default="seconds")
    except (ValueError, KeyError, TypeError):
        raise BadInput(f"--since {text!r} is not a duration", hint="e.g. 90s, 10m, 2h") from None
    return time.time() - float(seconds or 0)


def stamp(line: str) -> float | None:
    """The epoch seconds at the start of a distributed log line, if it has one."""
    match = _STAMP.match(line)
    if not match:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").timestamp()


def since_filter(lines: list[str], since: float | None) -> list[str]:
    """Lines at or after ``since``. An unstamped line goes with the stamped line before it;
    those before the first stamp (a batch job's prologue) with the first stamped line, and a
    text with no stamp at all is kept whole: nothing says it is old."""
    if since is None:
        return lines
    first = next((when for when in map(stamp, lines) if when is not None), None)
    keep = first is None or first >= since - 1
    kept = []
    for line in lines:
        when = stamp(line)
        if when is not None:
            keep = when >= since - 1
        if keep:
            kept.append(line)
    return kept


def new_lines(seen: list[str], current: list[str]) -> list[str]:
    """The lines of ``current`` after the longest overlap with the end of ``seen``.

    Dask keeps a bounded deque of recent log lines: what was seen last time is a prefix
    of what is there now, minus lines that fell off the front.
    """
    for start in range(len(current), 0, -1):
        if current[:start] == seen[-start:]:
            return current[start:]
    return current


def follow(fetch: Any, interval: float = 1.0) -> Iterator[tuple[str, str]]:
    """Poll ``fetch() -> {component: lines}`` and yield each new (component, line) forever."""
    seen: dict[str, list[str]] = {}
    while True:
        for component, lines in fetch().items():
            for line in new_lines(seen.get(component, []), lines):
                yield component, line
            seen[component] = lines
        time.sleep(interval)


def dashboard_link(record: Any) -> str | None:
    """The recorded dashboard as a link carrying the cluster's web secret once (the page keeps
    it in a cookie); None without a dashboard."""
    from clusterkit.webauth import link

    return link(record.dashboard, record.security.get("web_token_file"))


def dashboard_tunnel(record: Any) -> tuple[str, str] | None:
    """For a dashboard this machine cannot open directly: (the command that opens a tunnel to
    it, the link to use then, with the web secret). None when the recorded link works here."""
    from urllib.parse import urlsplit

    from clusterkit.security import is_loopback
    from clusterkit.state import HOST
    from clusterkit.webauth import link as with_secret

    link = urlsplit(record.dashboard)
    port = link.port or 8787
    local = f"http://localhost:{port}{link.path or '/status'}"
    local = with_secret(local, record.security.get("web_token_file")) or local
    if record.backend == "kubernetes":
        namespace, service = record.extra.get("namespace"), record.extra.get("name")
        if namespace and service:
            forward = f"kubectl port-forward -n {namespace} service/{service}-scheduler"
            return f"{forward} {port}:8787", local
        return None
    if record.host != HOST and is_loopback(link.hostname or ""):
        return ssh_tunnel(record.host, port), local
    return None


def ssh_tunnel(host: str, port: int) -> str:
    """The command that forwards local ``port`` to ``port`` on the loopback of ``host``."""
    return f"ssh -N -L {port}:127.0.0.1:{port} {host}"
