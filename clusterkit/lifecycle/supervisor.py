"""The detached process that owns a cluster started by ``clusterkit up``.

``python -m clusterkit.lifecycle.supervisor --name N --ready-fd FD`` reads ``N/profile.json`` and
``N/security.json`` from the cluster's directory, builds the cluster, waits for the minimum
workers, writes the record, reports ``ready`` (or the error) on FD, then serves a small
JSON control socket (scale, adapt, describe) until SIGTERM, when it closes the cluster and
removes the record.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

from clusterkit import state
from clusterkit.backends.base import Backend, get_backend
from clusterkit.errors import ClusterkitError, ClusterStartError
from clusterkit.schema import MODELS
from clusterkit.security import ClusterSecurity

logger = logging.getLogger("clusterkit.lifecycle.supervisor")

LOG_NAME = "supervisor.log"
CLOSE_TIMEOUT = 20.0


def log_tail(directory: Path, lines: int = 15) -> list[str]:
    """The last lines of the supervisor's log (its stderr, and its workers')."""
    try:
        text = (directory / LOG_NAME).read_text(errors="replace")
    except OSError:
        return []
    kept = [line for line in text.splitlines() if line.strip()]
    return kept[-lines:]


def wait_for_workers(cluster: Any, minimum: int, deadline: float) -> None:
    """Block until ``minimum`` workers joined, or raise ClusterStartError at the deadline."""
    while True:
        joined = len(cluster.scheduler_info.get("workers", {}))
        if joined >= minimum:
            return
        if time.monotonic() > deadline:
            raise ClusterStartError(
                f"{joined} of {minimum} workers joined before the start timeout",
                component="workers",
            )
        time.sleep(0.1)


class Supervisor:
    """Owns one cluster and answers control requests."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory
        data = json.loads((directory / "profile.json").read_text())
        profile_name, source = data.pop("_name", name), data.pop("_source", None)
        self.profile = MODELS[data["backend"]].model_validate(data).named(profile_name, source)
        self.security = ClusterSecurity.from_dict(
            json.loads((directory / "security.json").read_text())
        )
        self.backend: Backend = get_backend(self.profile.backend_name)
        self.cluster: Any = None
        self.stopping = threading.Event()

    def start(self) -> state.ClusterRecord:
        self.security.apply_env()
        deadline = time.monotonic() + self.profile.start_timeout
        self.cluster = self.backend.create_cluster(self.profile, self.security)
        try:
            wait_for_workers(self.cluster, self.profile_min_workers(), deadline)
        except ClusterStartError as error:
            hook = getattr(self.backend, "evidence", None)
            evidence = (hook(self.cluster, self.profile) if hook else []) or log_tail(
                self.directory
            )
            # the backend's first line (e.g. a job's pending reason) belongs in the message
            reason = f"; {evidence[0]}" if hook and evidence else ""
            raise ClusterStartError(
                f"{error.message.removeprefix(error.component + ': ')}{reason}",
                component=error.component,
                evidence=evidence,
                hint=error.hint,
            ) from None
        adapt = getattr(self.profile, "adapt", None)
        if adapt is not None:
            self.cluster.adapt(minimum=adapt.minimum, maximum=adapt.maximum)
        record = state.ClusterRecord(
            name=self.name,
            backend=self.profile.backend_name,
            profile=self.profile.name,
            profile_source=self.profile.source,
            digest=self.profile.digest(),
            address=self.cluster.scheduler_address,
            dashboard=self.cluster.dashboard_link if self.dashboard_enabled() else None,
            pid=os.getpid(),
            security=self.security.to_dict(),
            min_workers=self.profile_min_workers(),
            control=str(self.directory / "control.sock"),
        )
        state.write_record(record)
        return record

    def profile_min_workers(self) -> int:
        return int(getattr(self.profile, "min_workers", 0))

    def dashboard_enabled(self) -> bool:
        scheduler = getattr(self.profile, "scheduler", None)
        return bool(scheduler is None or scheduler.dashboard)

    # ---------------------------------------------------------------- control requests

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "scale":
            if hasattr(self.cluster, "_adaptive") and self.cluster._adaptive is not None:
                self.cluster._adaptive.stop()  # an explicit size ends adaptivity, as in dask
            self.cluster.scale(int(request["n"]))
            return {"ok": True}
        if op == "adapt":
            self.cluster.adapt(minimum=int(request["minimum"]), maximum=int(request["maximum"]))
            return {"ok": True}
        if op == "describe":
            hook = getattr(self.backend, "describe", None)
            rows = hook(self.cluster, self.profile) if hook else []
            return {"ok": True, "rows": [row.__dict__ for row in rows]}
        if op == "stop":
            self.stopping.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def serve(self) -> socketserver.UnixStreamServer:
        supervisor = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    request = json.loads(self.rfile.readline() or b"{}")
                    reply = supervisor.handle(request)
                except Exception as error:  # reported to the caller, not fatal here
                    logger.exception("control request failed")
                    reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
                self.wfile.write(json.dumps(reply, default=str).encode() + b"\n")

        path = self.directory / "control.sock"
        path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        finally:
            os.umask(old)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True, name="control").start()
        return server

    def wait(self) -> None:
        """Run until SIGTERM/SIGINT, a `stop` request, or the scheduler closing by itself."""
        while not self.stopping.wait(1.0):
            status = getattr(getattr(self.cluster, "status", None), "name", "running")
            if status in {"closed", "closing", "failed"}:
                logger.info("cluster %s closed by itself (%s)", self.name, status)
                return
            scheduler = getattr(self.cluster, "scheduler", None)
            if scheduler is not None and getattr(scheduler.status, "name", "") == "closed":
                logger.info("scheduler closed (idle timeout?)")
                return

    def close(self) -> None:
        if self.cluster is not None:
            try:
                self.cluster.close(timeout=CLOSE_TIMEOUT)
            except Exception:
                logger.exception("closing the cluster failed")
        state.remove_cluster(self.name)


def _report(fd: int | None, payload: dict[str, Any]) -> None:
    if fd is None:
        return
    try:
        os.write(fd, json.dumps(payload, default=str).encode() + b"\n")
        os.close(fd)
    except OSError:
        pass  # `up` went away; the record is still there for `ls`


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusterkit.lifecycle.supervisor")
    parser.add_argument("--name", required=True)
    parser.add_argument("--ready-fd", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    directory = state.cluster_dir(args.name)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    supervisor: Supervisor | None = None
    try:
        supervisor = Supervisor(args.name, directory)
        supervisor.stopping = stopping
        record = supervisor.start()
        supervisor.serve()
    except BaseException as error:
        if isinstance(error, ClusterkitError):
            # the library's own account first, then what the processes wrote to stderr
            failure = {
                "type": type(error).__name__,
                "message": error.message,
                "hint": error.hint,
                "component": getattr(error, "component", "supervisor"),
                "evidence": [*getattr(error, "evidence", []), *log_tail(directory, 10)],
            }
        else:
            logger.exception("start failed")
            failure = {
                "type": "ClusterStartError",
                "message": f"{type(error).__name__}: {error}",
                "component": "supervisor",
                "evidence": log_tail(directory),
            }
        if supervisor is not None:
            supervisor.close()  # jobs, pods and processes are gone before `up` hears back
        _report(args.ready_fd, {"ok": False, **failure})
        return 1
    _report(args.ready_fd, {"ok": True, "record": json.loads(record.to_json())})
    logger.info("cluster %s ready at %s", args.name, record.address)
    try:
        supervisor.wait()
    finally:
        supervisor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
