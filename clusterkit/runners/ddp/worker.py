"""Worker side of the DDP runner: the Dask task that owns one rank and its rank process.

The task secedes from the worker's thread pool (ranks wait on each other, so holding a slot
could deadlock two runs sharing a cluster), pauses the worker's statistical profiler while the
rank runs, and drives a rank process (``ddp_rank``) over a socket. The rank process comes
ready from :mod:`.pool` (a spare with torch imported, or a warm one of the same search).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any

from clusterkit.runners.ddp import output, pool, ports
from clusterkit.runners.ddp.pool import RankProcess

ABORTED = "stopped because another rank failed"

_lock = threading.Lock()
_running: dict[str, list[subprocess.Popen[bytes]]] = {}
_aborted: dict[str, float] = {}  # run attempt key -> when abort() came
_profiler_pauses = 0


class RankError(Exception):
    """A rank failed: carries the rank, the original error's type and message, the traceback."""

    def __init__(self, rank: int, kind: str, message: str, tb: str, when: float) -> None:
        super().__init__(rank, kind, message, tb, when)
        self.rank = rank
        self.kind = kind
        self.message = message
        self.traceback = tb
        self.time = when

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


def interface_of(dask_worker: Any) -> str | None:
    """Name of the network interface carrying this worker's Dask address (client.run)."""
    import psutil
    from distributed.comm import get_address_host

    host = get_address_host(dask_worker.address)
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return name
    return None


def facts_of(dask_worker: Any) -> dict[str, str | None]:
    """This worker's network interface (``interface_of``) and host name (client.run)."""
    return {"interface": interface_of(dask_worker), "node": socket.gethostname()}


def abort(key: str) -> int:
    """Kill this worker's rank processes of run attempt ``key`` (called through client.run)."""
    with _lock:
        _aborted.setdefault(key, time.time())
        procs = list(_running.get(key, ()))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return len(procs)


def terminate(key: str) -> int:
    """Send SIGTERM to this worker's rank processes of run attempt ``key`` (client.run): asked
    to end, as torchrun's agent and a batch system ask before a kill (:func:`abort` kills)."""
    with _lock:
        procs = list(_running.get(key, ()))
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    return len(procs)


def _set_profiler(worker: Any, pause: bool) -> None:
    """Pause the worker's 10 ms stack sampler while ranks run (it competes for the CPU)."""
    global _profiler_pauses
    with _lock:
        _profiler_pauses += 1 if pause else -1
        active = _profiler_pauses > 0
    callbacks = [worker.periodic_callbacks.get(n) for n in ("profile", "profile-cycle")]
    for callback in filter(None, callbacks):
        action = callback.stop if active else callback.start
        worker.loop.add_callback(action)


def _store_checkpoint(run_id: str, data: bytes) -> None:
    from distributed import Event, Variable, get_client

    client = get_client()
    Variable(f"{run_id}-ckpt", client=client).set(data)
    Event(f"{run_id}-ckpt", client).set()


class _ProgressRelay:
    """Rank 0's progress to the driver's event topic: at most every ``every`` seconds, the
    latest report always (``flush`` sends one held back)."""

    def __init__(self, topic: str | None, every: float = 0.25) -> None:
        self.topic = topic
        self.every = every
        self.pending: dict[str, Any] | None = None
        self.sent_at = -float("inf")

    def put(self, progress: dict[str, Any]) -> None:
        self.pending = progress
        if time.monotonic() - self.sent_at >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.topic is None or self.pending is None:
            return
        from distributed import get_worker

        # wrapped: the scheduler adds a "worker" key to a dict message, beside the metrics
        get_worker().log_event(self.topic, {"progress": self.pending})
        self.pending, self.sent_at = None, time.monotonic()


def _relay(key: str, rank: int, queues: dict[str, Any], message: list[Any]) -> Any:
    """A rank's event to the driver's topic and, if it asks one, the driver's answer (polled:
    an aborted attempt stops waiting)."""
    from distributed import Queue, get_worker

    topic, event, reply = message
    if reply is not None and reply not in queues:  # before the question: no answer is lost
        queues[reply] = Queue(reply)
    get_worker().log_event(topic, event)
    while reply is not None:
        if key in _aborted:
            raise RankError(rank, "Aborted", ABORTED, "", time.time())
        try:
            return queues[reply].get(timeout=5.0)
        except TimeoutError:
            continue
    return None


def _serve(spec: dict[str, Any], child: RankProcess) -> Any:
    queues: dict[str, Any] = {}
    topic = spec.get("output_topic")
    lines = output.Forwarder(topic, spec["rank"]) if topic else None
    try:
        return _serve_rank(spec, child, queues, lines)
    except RankError as error:
        if lines is not None:  # what the rank wrote before it failed comes first
            lines.drain(timeout=1.0)
        aborted_at = _aborted.get(spec["key"])
        # an error from after the abort is the abort's doing (the cause is another rank's); one
        # raised before it is a cause itself, though the abort came while it was on its way here
        if aborted_at is not None and error.time >= aborted_at:
            raise RankError(spec["rank"], "Aborted", ABORTED, "", error.time) from None
        if topic and error.kind != "Aborted":
            output.failed(topic, error.rank, error.kind, error.message, error.traceback)
        raise
    finally:
        if lines is not None:
            lines.close()
        for queue in queues.values():
            queue.close()


def _serve_rank(
    spec: dict[str, Any],
    child: RankProcess,
    queues: dict[str, Any],
    lines: output.Forwarder | None,
) -> Any:
    key, rank = spec["key"], spec["rank"]
    proc, conn = child.proc, child.conn
    ready = child.ready
    sent = False
    relay = _ProgressRelay(spec.get("progress_topic"))
    while True:
        if key in _aborted:
            raise RankError(rank, "Aborted", ABORTED, "", time.time())
        if not sent and (ready or rank == 0):
            if rank != 0:
                port = ports.wait(key, spec["rendezvous_timeout"], lambda: key in _aborted)
                spec["env"]["MASTER_PORT"] = str(port)
            conn.send(spec)
            if lines is not None:
                lines.hand_over(conn)
            sent = True
        if not _wait(conn, lines):
            relay.flush()
            if proc.poll() is not None and not conn.poll(0):
                raise RankError(rank, "ProcessExit", _exit_text(proc.returncode), "", time.time())
            continue
        try:
            kind, *rest = conn.recv()
        except (EOFError, OSError):
            proc.wait(timeout=5)
            text = _exit_text(proc.returncode)
            raise RankError(rank, "ProcessExit", text, "", time.time()) from None
        if kind == "ready":
            ready = True
        elif kind == "port":
            ports.publish(key, rest[0], spec["workers"])
        elif kind == "checkpoint":
            _store_checkpoint(spec["run_id"], rest[0])
            conn.send(("ack",))
        elif kind == "started":
            continue
        elif kind == "progress":
            relay.put(rest[0])
        elif kind == "warnings" and spec.get("warnings_topic"):
            from clusterkit.runners.workdir.once import send

            send(spec["warnings_topic"], rest[0])
        elif kind == "relay":
            answer = _relay(key, rank, queues, rest)
            if rest[2] is not None:
                conn.send(("reply", answer))
        elif kind == "result":
            relay.flush()
            if lines is not None:
                lines.drain(timeout=1.0)
            return rest[0]
        elif kind == "error":
            info = rest[0]
            raise RankError(rank, info["type"], info["message"], info["traceback"], info["time"])


def _wait(conn: Any, lines: output.Forwarder | None) -> bool:
    """Up to 0.2 s for a message from the rank, reading its output meanwhile; True when one
    is there."""
    if lines is None:
        return bool(conn.poll(0.2))
    from multiprocessing.connection import wait

    for ready in wait([conn, *lines.fds()], timeout=0.2):
        if ready is not conn:
            lines.read(ready)  # type: ignore[arg-type]
    lines.tick()
    return bool(conn.poll(0))


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank process killed by signal {-code}"
    return f"rank process exited with code {code} before reporting a result"


def _project_directory(project: Any) -> str | None:
    """Where this worker holds the run's project (in place or its synced copy), or None."""
    if project is None:
        return None
    from clusterkit.runners.workdir import tree

    found = tree.locate(project)
    if found is None:
        tree.probe(project)  # a copy that is complete but not yet built in this process
        found = tree.locate(project)
    if found is None:
        raise RuntimeError(f"project {project.root} is not on worker (no copy arrived)")
    return found[0]


def rank_task(spec: dict[str, Any]) -> bytes:
    """Run one rank on this worker; returns the cloudpickled result of ``train_fn``."""
    from distributed import get_worker, secede

    worker = get_worker()
    task = worker.get_current_task()
    output.quiet(task)  # a failure is the rank's own line on the driver, not distributed's
    secede()
    key = spec["key"]
    _set_profiler(worker, pause=True)
    child = pool.take(spec)
    with _lock:
        _running.setdefault(key, []).append(child.proc)
    kept = False
    try:
        spec["sys_path"] = list(sys.path)
        spec["workdir"] = _project_directory(spec.pop("project", None))
        result = _serve(spec, child)
        kept = key not in _aborted and pool.keep_warm(spec, child, pool.threads_of(worker))
        output.unquiet(task)  # it ended well: nothing more to silence
        return result
    finally:
        if not kept:
            _end(child)
        with _lock:
            procs = _running.get(key, [])
            if child.proc in procs:
                procs.remove(child.proc)
            if not procs:
                _running.pop(key, None)
        _set_profiler(worker, pause=False)
        if not kept:  # a warm process stands in for the spare until its search releases it
            pool.ensure_spare(worker)


def _end(child: RankProcess) -> None:
    """Let a rank process that is done exit (bounded), else kill it."""
    child.conn.close()
    if child.proc.poll() is None:
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
