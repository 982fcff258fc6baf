"""The detached process that owns a cluster started by ``clusterkit up``.

It starts the cluster through ``start_cluster``, writes the record, reports ``ready`` (or the
error) on the readiness pipe, then serves the control socket (scale, adapt, describe, stop)
until SIGTERM, when it closes the cluster and removes the record. ``up`` forks it once its
imports are paid (``spawn``); ``python -m clusterkit.lifecycle.supervisor --name N --ready-fd FD``
is the same process started fresh, reading the profile from ``N/profile.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from clusterkit import state
from clusterkit.backends.base import Capability, backend_for
from clusterkit.errors import ClusterkitError
from clusterkit.lifecycle import control, hooks
from clusterkit.lifecycle.start import Claim, Started, start_cluster
from clusterkit.schema import ProfileCommon
from clusterkit.security import ClusterSecurity

logger = logging.getLogger(__name__)

LOG_NAME = "supervisor.log"
PROFILE_NAME = "profile.json"
#: Seconds between checks that the scheduler still answers, and how long it may not.
PING_INTERVAL = 3.0
SCHEDULER_LOST = 15.0
#: The connect timeout of the close's RPCs once the scheduler no longer answers.
CONNECT_TIMEOUT = "distributed.comm.timeouts.connect"
GONE_CONNECT = "1s"


def log_tail(directory: Path, lines: int = 15) -> list[str]:
    """The last lines of the supervisor's log (its stderr, and its workers')."""
    try:
        text = (directory / LOG_NAME).read_text(errors="replace")
    except OSError:
        return []
    kept = [line for line in text.splitlines() if line.strip()]
    return kept[-lines:]


def save_profile(directory: Path, profile: ProfileCommon) -> None:
    """The resolved profile, for a supervisor started fresh (0600)."""
    payload = {**profile.model_dump(mode="json"), "_name": profile.name, "_source": profile.source}
    fd = os.open(directory / PROFILE_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(payload))


def load_saved_profile(directory: Path) -> ProfileCommon:
    from clusterkit.backends.base import profile_model

    data = json.loads((directory / PROFILE_NAME).read_text())
    name, source = data.pop("_name"), data.pop("_source", None)
    return profile_model(data["backend"]).model_validate(data).named(name, source)


class Supervisor:
    """Owns one started cluster and answers control requests."""

    def __init__(
        self,
        name: str,
        directory: Path,
        profile: ProfileCommon,
        security: ClusterSecurity | None = None,
    ) -> None:
        self.name = name
        self.directory = directory
        self.profile = profile
        self.security = security  # made by `up` already (a warm start), else here
        self.started: Started | None = None
        self.record: state.ClusterRecord | None = None
        self.stopping = threading.Event()

    def start(self) -> state.ClusterRecord:
        remote = Capability.REMOTE in backend_for(self.profile).CAPABILITIES
        claim = Claim(self.profile, self.name, supervisor=True) if remote else None
        try:
            self.started = start_cluster(
                self.profile,
                name=self.name,
                security_dir=self.directory,
                claim=claim,
                prepared=self.security,
                stopping=self.stopping,  # SIGTERM (`down`) mid-start: tear down, don't wait
            )
        except BaseException:
            if claim is not None:  # torn down already; a claim left means this process died
                claim.withdraw()
            raise
        socket = state.control_socket(self.name)
        record = self.started.record(pid=os.getpid(), control=str(socket))
        state.write_record(record)
        self.record = record
        control.serve(socket, self.handle)
        return record

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        started, op = self.started, request.get("op")
        if started is None:
            return {"ok": False, "error": "the cluster is not started"}
        if op == "ping":
            return {"ok": True}
        if op == "record":  # what the record file says, for rewriting one that became unreadable
            return {
                "ok": True,
                "record": json.loads(self.record.to_json()) if self.record else None,
            }
        if op == "scale":
            was_adaptive = started.stop_adapting()
            started.scale(int(request["n"]))
            return {"ok": True, "ended_adaptive": was_adaptive}
        if op == "adapt":
            if request.get("off"):
                return {"ok": True, "ended_adaptive": started.stop_adapting()}
            started.adapt(int(request["minimum"]), int(request["maximum"]))
            return {"ok": True}
        if op == "describe":
            rows = started.backend.describe(started.cluster, started.profile)
            return {"ok": True, "rows": [row.__dict__ for row in rows], "mode": started.mode}
        if op == "stop":
            self.stopping.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def wait(self) -> None:
        """Run until SIGTERM/SIGINT, a `stop` request, or the scheduler is gone (closed by
        itself, or unreachable for ``SCHEDULER_LOST`` seconds: a remote scheduler killed)."""
        cluster = self.started.cluster if self.started else None
        last_seen = time.monotonic()
        while not self.stopping.wait(PING_INTERVAL):
            status = getattr(getattr(cluster, "status", None), "name", "running")
            if status in {"closed", "closing", "failed"}:
                logger.info("cluster %s closed by itself (%s)", self.name, status)
                return
            if _answers(cluster):
                last_seen = time.monotonic()
                self._resume_lost_runs()
            elif time.monotonic() - last_seen > SCHEDULER_LOST:
                logger.error("the scheduler has not answered for %.0fs: closing", SCHEDULER_LOST)
                return

    def _resume_lost_runs(self) -> None:
        """Detached runs on this cluster whose monitor died start again: the ``watch`` hooks
        (clusterkit.runs registers the one that resumes them)."""
        try:
            for run_id in hooks.call(hooks.WATCH, self.name):
                logger.warning("run %s lost its monitor: resumed", run_id)
        except Exception:
            logger.exception("resuming the lost runs of %s failed", self.name)

    def close(self) -> None:
        if self.started is not None:
            import dask

            # a scheduler that is gone would hold each of the close's RPCs (retiring the
            # workers, terminating it) for the whole connect timeout, 30 s by default
            gone = not _answers(self.started.cluster)
            try:
                with dask.config.set({CONNECT_TIMEOUT: GONE_CONNECT} if gone else {}):
                    self.started.close()
            except Exception:
                logger.exception("closing the cluster failed")
        state.remove_cluster(self.name)


def _answers(cluster: Any) -> bool:
    """Whether the cluster's scheduler answers an identity call within a few seconds."""
    import asyncio

    async def ping() -> None:
        await asyncio.wait_for(cluster.scheduler_comm.identity(), PING_INTERVAL)

    try:
        cluster.sync(ping)
    except Exception:
        return False
    return True


def failure(error: BaseException, directory: Path) -> dict[str, Any]:
    """The readiness reply for a failed start: the library's account, then the log's tail."""
    if isinstance(error, ClusterkitError):
        return {
            "type": type(error).__name__,
            "message": error.message,
            "hint": error.hint,
            "component": getattr(error, "component", "supervisor"),
            "evidence": [*getattr(error, "evidence", []), *log_tail(directory, 10)],
        }
    logger.error("start failed", exc_info=error)
    return {
        "type": "ClusterStartError",
        "message": f"{type(error).__name__}: {error}",
        "component": "supervisor",
        "evidence": log_tail(directory),
    }


def report(fd: int | None, payload: dict[str, Any], *, last: bool = True) -> None:
    """One JSON line on the readiness pipe (closed after the last)."""
    if fd is None:
        return
    try:
        os.write(fd, json.dumps(payload, default=str).encode() + b"\n")
        if last:
            os.close(fd)
    except OSError:
        pass  # `up` went away; the record is still there for `ls`


def run(
    name: str,
    profile: ProfileCommon,
    ready_fd: int | None,
    security: ClusterSecurity | None = None,
) -> int:
    """The supervisor's whole life: start, report, serve until told to stop, close."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # a forking parent's handlers: their files may be gone
        root.removeHandler(handler)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    directory = state.cluster_dir(name)
    state.write_pid_file(name, os.getpid())
    supervisor = Supervisor(name, directory, profile, security)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: supervisor.stopping.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        record = supervisor.start()
    except BaseException as error:
        supervisor.close()  # jobs, pods and processes are gone before `up` hears back
        report(ready_fd, {"ok": False, **failure(error, directory)})
        return 1
    report(ready_fd, {"ok": True, "record": json.loads(record.to_json())})
    logger.info("cluster %s ready at %s", name, record.address)
    try:
        supervisor.wait()
    finally:
        supervisor.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusterkit.lifecycle.supervisor")
    parser.add_argument("--name", required=True)
    parser.add_argument("--ready-fd", type=int)
    args = parser.parse_args(argv)
    report(args.ready_fd, {"pid": os.getpid()}, last=False)
    try:
        profile = load_saved_profile(state.cluster_dir(args.name))
    except Exception as error:
        report(args.ready_fd, {"ok": False, **failure(error, state.cluster_dir(args.name))})
        return 1
    return run(args.name, profile, args.ready_fd)


if __name__ == "__main__":
    sys.exit(main())
