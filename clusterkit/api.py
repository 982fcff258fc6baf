"""Lifecycle verbs over any backend; the only place that picks a backend."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterkit import state
from clusterkit.backends.base import (
    Backend,
    Capability,
    check_capabilities,
    get_backend,
    require,
)
from clusterkit.client import connect
from clusterkit.errors import (
    BadInput,
    ClusterExists,
    ClusterkitError,
    ClusterNotFound,
    ClusterStartError,
)
from clusterkit.profiles import check_name, load_profile
from clusterkit.security import ClusterSecurity, prepare
from clusterkit.state import ClusterRecord

if TYPE_CHECKING:
    from clusterkit.schema import ProfileCommon

#: Seconds `up` waits beyond the profile's start timeout for the supervisor's own start.
SUPERVISOR_GRACE = 30.0
DOWN_TIMEOUT = 30.0


def backend_for(profile: ProfileCommon) -> Backend:
    """The profile's backend, with its library present and its capabilities checked."""
    backend = get_backend(profile.backend_name)
    require(backend, profile.name)
    check_capabilities(backend, profile)
    return backend


def security_hostnames(profile: ProfileCommon) -> list[str]:
    hosts = [getattr(profile, "scheduler_host", None), *getattr(profile, "hosts", [])]
    scheduler = getattr(profile, "scheduler", None)
    if scheduler is not None and scheduler.host:
        hosts.append(scheduler.host)
    return [h for h in hosts if h]


def render(profile_ref: str | os.PathLike[str] | ProfileCommon) -> str:
    """What the backend would run for this profile (job script, commands, manifest)."""
    profile = load_profile(profile_ref)
    backend = get_backend(profile.backend_name)
    check_capabilities(backend, profile)
    security = ClusterSecurity(protocol=profile.protocol)
    if profile.protocol == "tls":
        security = ClusterSecurity(
            protocol="tls",
            ca_file="<cluster dir>/ca.pem",
            cert_file="<cluster dir>/cert.pem",
            key_file="<cluster dir>/key.pem",
        )
    elif profile.protocol == "ucx":
        security = prepare(profile, None)
    return backend.render(profile, security)


# ---------------------------------------------------------------------------- up


def up(
    profile_ref: str | os.PathLike[str] | ProfileCommon | None = None,
    *,
    name: str | None = None,
) -> ClusterRecord:
    """Start a cluster that outlives this process and return its record.

    A detached supervisor owns the cluster (a DETACHED backend, Kubernetes, needs none: the
    cluster lives in the API server). Raises ClusterExists if ``name`` is already up, and
    ClusterStartError with evidence if the workers do not arrive in time; then nothing is
    left running.
    """
    profile = load_profile(profile_ref)
    name = name or profile.name
    check_name(name)
    backend = backend_for(profile)
    with state.starting(name):
        existing = state.read_record(name)
        if existing is not None:
            if state.is_live(existing):
                raise ClusterExists(
                    f"cluster '{name}' is already up at {existing.address}",
                    hint=f"`clusterkit down {name}` first, or pick another --name",
                )
            state.remove_cluster(name)
        directory = state.cluster_dir(name)
        try:
            security = prepare(profile, directory, security_hostnames(profile))
            if Capability.DETACHED in backend.CAPABILITIES:
                return _up_detached(backend, profile, name, security)
            return _up_supervised(profile, name, directory, security)
        except BaseException:
            if state.read_record(name) is None:
                state.remove_cluster(name)
            raise


def _up_detached(
    backend: Backend, profile: ProfileCommon, name: str, security: ClusterSecurity
) -> ClusterRecord:
    from clusterkit.lifecycle.supervisor import wait_for_workers

    security.apply_env()
    # a detached resource is named after the cluster (`up --name`), not the profile
    cluster: Any = backend.create_cluster(profile, security, name=name)  # type: ignore[call-arg]
    try:
        deadline = time.monotonic() + profile.start_timeout
        wait_for_workers(cluster, int(getattr(profile, "min_workers", 0)), deadline)
    except ClusterStartError as error:
        hook = getattr(backend, "evidence", None)
        error.evidence = hook(cluster, profile) if hook else error.evidence
        teardown = getattr(backend, "teardown_cluster", None)
        if teardown is not None:
            teardown(cluster)
        raise
    record = ClusterRecord(
        name=name,
        backend=profile.backend_name,
        profile=profile.name,
        profile_source=profile.source,
        digest=profile.digest(),
        address=cluster.scheduler_address,
        dashboard=getattr(cluster, "dashboard_link", None),
        pid=None,
        security=security.to_dict(),
        min_workers=int(getattr(profile, "min_workers", 0)),
        extra=dict(getattr(backend, "record_extra", lambda c, p: {})(cluster, profile)),
    )
    state.write_record(record)
    close = getattr(cluster, "close", None)
    if close is not None and getattr(backend, "close_after_up", True):
        close()
    return record


def _up_supervised(
    profile: ProfileCommon, name: str, directory: Path, security: ClusterSecurity
) -> ClusterRecord:
    payload = {**profile.model_dump(mode="json"), "_name": profile.name, "_source": profile.source}
    _write_private(directory / "profile.json", json.dumps(payload))
    _write_private(directory / "security.json", json.dumps(security.to_dict()))
    read_fd, write_fd = os.pipe()
    log = open(directory / "supervisor.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clusterkit.lifecycle.supervisor",
                "--name",
                name,
                "--ready-fd",
                str(write_fd),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(write_fd,),
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(write_fd)
        log.close()
    try:
        reply = _read_reply(read_fd, profile.start_timeout + SUPERVISOR_GRACE, process)
    finally:
        os.close(read_fd)
    if reply is None or not reply.get("ok"):
        _kill_group(process.pid, grace=5.0)
        process.wait(timeout=10)
        from clusterkit.lifecycle.supervisor import log_tail

        evidence = (reply or {}).get("evidence") or log_tail(directory)
        state.remove_cluster(name)
        if reply is None:
            code = process.returncode
            why = (
                f"exited with code {code} before it was ready"
                if code is not None and code >= 0
                else f"gave no answer within {profile.start_timeout + SUPERVISOR_GRACE:.0f}s"
            )
            raise ClusterStartError(why, component="supervisor", evidence=evidence)
        raise _error_from_reply(reply, evidence)
    return ClusterRecord(**reply["record"])


def _error_from_reply(reply: dict[str, Any], evidence: list[str]) -> ClusterkitError:
    from clusterkit import errors

    kind = getattr(errors, str(reply.get("type")), None)
    message = str(reply.get("message"))
    if isinstance(kind, type) and issubclass(kind, errors.BadInput):
        error: ClusterkitError = errors.BadInput(message, hint=reply.get("hint"))
        error.exit_code = kind.exit_code
        return error
    component = str(reply.get("component") or "supervisor")
    message = message.removeprefix(f"{component}: ")
    return ClusterStartError(
        message, component=component, evidence=evidence, hint=reply.get("hint")
    )


def _read_reply(fd: int, timeout: float, process: subprocess.Popen[bytes]) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    buffer = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # the supervisor closed the pipe (exited)
                break
            buffer += chunk
            if buffer.endswith(b"\n"):
                return json.loads(buffer)
        elif process.poll() is not None and not buffer:
            break
    try:
        return json.loads(buffer) if buffer else None
    except ValueError:
        return None


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def _kill_group(pid: int, grace: float) -> None:
    """SIGTERM the supervisor's process group, then SIGKILL what is left after ``grace``."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _group_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


# ---------------------------------------------------------------------------- down / ls


def get_record(name: str) -> ClusterRecord:
    check_name(name)
    record = state.read_record(name)
    if record is None or not state.is_live(record):
        if record is not None:
            state.remove_cluster(name)
        known = ", ".join(r.name for r in state.records()) or "none"
        raise ClusterNotFound(f"no cluster named '{name}' is up", hint=f"up: {known}")
    return record


def down(name: str, *, timeout: float = DOWN_TIMEOUT) -> None:
    """Close gracefully, kill the process group after ``timeout``, drop the record."""
    record = get_record(name)
    with state.lock(name):
        if record.pid is None:
            backend = get_backend(record.backend)
            teardown = getattr(backend, "teardown", None)
            if teardown is not None:
                teardown(record)
        else:
            _stop_supervisor(record.pid, timeout)
        state.remove_cluster(name)


def _stop_supervisor(pid: int, timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and state.pid_alive(pid):
        time.sleep(0.05)
    # workers the supervisor started share its process group; none may outlive it
    _kill_group(pid, grace=2.0 if state.pid_alive(pid) else 3.0)


def down_all(*, timeout: float = DOWN_TIMEOUT) -> list[str]:
    names = [r.name for r in state.records()]
    for name in names:
        down(name, timeout=timeout)
    return names


def list_clusters() -> list[dict[str, Any]]:
    """Live clusters (dead supervisors' records are pruned), with worker and GPU counts."""
    rows = []
    for record in state.records():
        info = _scheduler_summary(record)
        rows.append(
            {
                "name": record.name,
                "backend": record.backend,
                "address": record.address,
                "workers": info.get("workers"),
                "gpus": info.get("gpus"),
                "age": record.age,
                "state": info.get("state", "up"),
                "dashboard": record.dashboard,
            }
        )
    return rows


def scheduler_identity(client: Any) -> dict[str, Any]:
    """The scheduler's own view, fetched now.

    ``client.scheduler_info()`` returns a cache that the client's periodic refresh can replace
    with a copy that lists no workers; asking the scheduler directly avoids that race.
    """
    identity: dict[str, Any] = client.sync(client.scheduler.identity, n_workers=-1)
    return identity


def list_resources(backend_name: str) -> list[dict[str, Any]]:
    """Clusters a backend can see beyond clusterkit's records (e.g. DaskClusters in Kubernetes)."""
    backend = get_backend(backend_name)
    require(backend, backend_name)
    lister = getattr(backend, "list_resources", None)
    if lister is None:
        raise BadInput(f"backend '{backend_name}' has no resources to list")
    resources: list[dict[str, Any]] = lister()
    return resources


def _scheduler_summary(record: ClusterRecord) -> dict[str, Any]:
    try:
        with connect(record, timeout=5) as client:
            workers = scheduler_identity(client)["workers"]
    except Exception as error:  # unreachable is a state to show, not a crash
        return {"state": f"unreachable ({type(error).__name__})"}
    gpus = sum(int(w.get("resources", {}).get("GPU", 0)) for w in workers.values())
    return {"workers": len(workers), "gpus": gpus, "state": "up"}


# ---------------------------------------------------------------------------- status


def status(name: str) -> dict[str, Any]:
    """Workers (threads, memory, GPUs, tasks processing) and backend rows (jobs, pods)."""
    record = get_record(name)
    with connect(record) as client:
        info = scheduler_identity(client)
        processing = client.processing()
    workers = []
    for address, worker in sorted(info["workers"].items()):
        workers.append(
            {
                "address": address,
                "name": str(worker.get("name")),
                "threads": worker.get("nthreads"),
                "memory_limit": worker.get("memory_limit"),
                "memory": worker.get("metrics", {}).get("memory"),
                "gpus": int(worker.get("resources", {}).get("GPU", 0)),
                "processing": len(processing.get(address, ())),
            }
        )
    if record.control:
        rows = _control(record, {"op": "describe"}).get("rows", [])
    else:  # a detached cluster: the backend asks its own API
        describe = getattr(get_backend(record.backend), "describe", None)
        rows = [row.__dict__ for row in describe(record)] if describe else []
    return {
        "name": record.name,
        "backend": record.backend,
        "address": record.address,
        "dashboard": record.dashboard,
        "age": record.age,
        "workers": workers,
        "rows": rows,
    }


def _control(record: ClusterRecord, request: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    if not record.control:
        raise BadInput(f"cluster '{record.name}' has no supervisor to ask")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(record.control)
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data or b"{}")
    if not reply.get("ok"):
        raise ClusterkitError(f"cluster '{record.name}': {reply.get('error', 'no answer')}")
    return reply


def scale(name: str, n: int, *, wait: bool = True, timeout: float = 120) -> None:
    """Set the number of workers (ends adaptivity); waits until the count is reached."""
    if n < 0:
        raise BadInput(f"cannot scale to {n} workers", hint="give 0 or more")
    record = get_record(name)
    if record.pid is None:
        hook = getattr(get_backend(record.backend), "scale", None)
        if hook is None:
            raise BadInput(f"backend '{record.backend}' cannot scale")
        hook(record, n)
    else:
        _control(record, {"op": "scale", "n": n})
    if not wait:
        return
    with connect(record) as client:
        deadline = time.monotonic() + timeout
        while len(scheduler_identity(client)["workers"]) != n:
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"did not reach {n} workers in {timeout:.0f}s", component="scale"
                )
            time.sleep(0.2)


def logs(name: str, *, lines: int = 200) -> dict[str, list[str]]:
    """Supervisor log tail plus the scheduler's and each worker's in-memory logs."""
    from clusterkit.lifecycle.supervisor import log_tail

    record = get_record(name)
    result: dict[str, list[str]] = {}
    tail = log_tail(state.cluster_dir(name), lines)
    if tail:
        result["supervisor"] = tail
    with connect(record) as client:
        result["scheduler"] = [msg for _, msg in client.get_scheduler_logs(n=lines)]
        for address, entries in client.get_worker_logs(n=lines).items():
            result[f"worker {address}"] = [msg for _, msg in entries]
    return result
