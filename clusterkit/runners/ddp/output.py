"""The ranks' stdout and stderr on the driver, line by line: ``[rank1]: text``, as torchrun tees.

A rank's task (``worker``) makes two pipes and hands their write ends to its rank process over
their socket (``SCM_RIGHTS``); the rank puts them in place of its fds 1 and 2, line-buffered
(:func:`redirect`), so its prints, its warnings and whatever its subprocesses write go there as
they happen. The task reads the pipes (:class:`Forwarder`), cuts the bytes into whole lines
(two ranks' lines are never spliced, whatever the writers' buffering) and puts them on the run's
Dask topic (``Worker.log_event``); the driver subscribes (``Client.subscribe_topic``) and
writes each line, prefixed with its rank, to its own stdout or stderr (:class:`Printer`).
Every profile works alike: the events travel on the worker's and the client's own streams to
the scheduler, in order with the task's result. A failed rank is one line too (its type and
message); the traceback is printed only where it is asked for (``--tracebacks``, a detached
run's log, ``CLUSTERKIT_DEBUG=1``). Distributed's own ``Compute Failed`` report of a rank task
is silenced on the worker (:func:`quiet`): the rank's line says it, once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: A partial line (no newline yet) is sent as it is after this many seconds, or this long.
PARTIAL_AFTER = 1.0
PARTIAL_LIMIT = 64 * 1024
DEBUG_ENV = "CLUSTERKIT_DEBUG"  # set: the driver prints each failed rank's traceback


# ------------------------------------------------------------------ rank process


def redirect(conn: Any) -> Callable[[], None]:
    """Rank side: take the two pipe ends the task sends next as fds 1 and 2, line-buffered;
    returns what puts the process's own back (a warm process serves another trial after)."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
    streams = [s for s in (sys.stdout, sys.stderr) if isinstance(s, io.TextIOWrapper)]
    buffering = [stream.line_buffering for stream in streams]
    for stream in streams:
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for stream in streams:  # live, not in 8 KiB blocks (a pipe is not a terminal)
        stream.reconfigure(line_buffering=True)

    def restore() -> None:
        for stream, line_buffering in zip(streams, buffering, strict=True):
            stream.flush()
            stream.reconfigure(line_buffering=line_buffering)
        for target, fd in zip((1, 2), saved, strict=True):
            os.dup2(fd, target)
            os.close(fd)

    return restore


# ------------------------------------------------------------------ worker (the rank's task)


class Forwarder:
    """Worker side: reads a rank process's stdout and stderr pipes and sends whole lines to the
    driver's ``topic`` (one event per read: ``{"rank", "stream", "lines"}``)."""

    def __init__(self, topic: str, rank: int) -> None:
        self.topic, self.rank = topic, rank
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        self.streams = {out_read: "stdout", err_read: "stderr"}
        self.partial = {out_read: b"", err_read: b""}
        self.since: dict[int, float] = {}  # when a pending partial line began
        self.write_ends = [out_write, err_write]

    def hand_over(self, conn: Any) -> None:
        """Send the write ends to the rank process (after its spec), and close ours."""
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            socket.send_fds(sock, [b"o"], self.write_ends)
        self.close_write_ends()

    def close_write_ends(self) -> None:
        for fd in self.write_ends:
            os.close(fd)
        self.write_ends = []

    def fds(self) -> list[int]:
        """The pipes still open (for ``multiprocessing.connection.wait``)."""
        return list(self.streams)

    def read(self, fd: int) -> None:
        """Read what ``fd`` holds (it is ready); send its whole lines."""
        data = os.read(fd, PARTIAL_LIMIT)
        if not data:  # every writer closed it
            self._send(fd, [self.partial.pop(fd)] if self.partial.get(fd) else [])
            os.close(fd)
            del self.streams[fd]
            self.since.pop(fd, None)
            return
        *lines, rest = (self.partial[fd] + data).split(b"\n")
        if len(rest) >= PARTIAL_LIMIT:
            lines, rest = [*lines, rest], b""
        if rest and (lines or fd not in self.since):
            self.since[fd] = time.monotonic()
        elif not rest:
            self.since.pop(fd, None)
        self.partial[fd] = rest
        self._send(fd, lines)

    def tick(self) -> None:
        """Send partial lines that waited :data:`PARTIAL_AFTER` s (``print(..., end="")``)."""
        now = time.monotonic()
        for fd, began in list(self.since.items()):
            if now - began >= PARTIAL_AFTER:
                line, self.partial[fd] = self.partial[fd], b""
                del self.since[fd]
                self._send(fd, [line])

    def drain(self, timeout: float) -> None:
        """Read the pipes to their end: what the rank wrote before its last word (flushed
        before it) is there already; a subprocess of the rank may hold them open, so bounded."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while self.streams:
            ready = wait(self.fds(), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for fd in ready:
                self.read(fd)  # type: ignore[arg-type]
        for fd in list(self.streams):
            if self.partial[fd]:
                line, self.partial[fd] = self.partial[fd], b""
                self._send(fd, [line])

    def close(self) -> None:
        for fd in [*self.streams, *self.write_ends]:
            os.close(fd)
        self.streams, self.write_ends = {}, []

    def _send(self, fd: int, lines: list[bytes]) -> None:
        if not lines:
            return
        text = [_displayed(line.decode("utf-8", errors="replace")) for line in lines]
        event = {"rank": self.rank, "stream": self.streams[fd], "lines": text}
        _log_event(self.topic, event)


def _displayed(line: str) -> str:
    """A line as a terminal would leave it: what follows its last carriage return."""
    line = line.rstrip("\r")
    return line.rsplit("\r", 1)[-1]


def _log_event(topic: str, event: dict[str, Any]) -> None:
    from distributed import get_worker

    get_worker().log_event(topic, event)


def failed(topic: str, rank: int, kind: str, message: str, tb: str) -> None:
    """Worker side: rank ``rank`` failed (after its last output line, on the same stream)."""
    event = {"rank": rank, "failed": {"type": kind, "message": message, "traceback": tb}}
    _log_event(topic, event)


_quiet_keys: set[object] = set()
_quiet_lock = threading.Lock()


class _QuietRankTasks(logging.Filter):
    """Drops distributed's report of a rank task that failed or was cancelled in a closing
    worker: the driver shows the rank's own line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        with _quiet_lock:
            if not _quiet_keys:
                return True
            if str(record.msg).startswith(_COMPUTE_FAILED_PREFIX):
                key = record.args[0] if isinstance(record.args, tuple) and record.args else None
                if key not in _quiet_keys:
                    return True
                _quiet_keys.discard(key)  # logged once per failed task
                return False
            if "ended with CancelledError" in str(record.msg):
                text = str(record.msg)
                return not any(f"'{key}'" in text for key in _quiet_keys)
        return True


_COMPUTE_FAILED_PREFIX = "Compute Failed"
_filter = _QuietRankTasks()


def quiet(key: object) -> None:
    """Worker side: no ``Compute Failed`` log (nor a closing worker's ``CancelledError``
    warning) for task ``key``; :func:`unquiet` once it can no longer be logged."""
    with _quiet_lock:
        _quiet_keys.add(key)
    for name in ("distributed.worker", "distributed.worker.state_machine"):
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)


def unquiet(key: object) -> None:
    with _quiet_lock:
        _quiet_keys.discard(key)


# ------------------------------------------------------------------ driver


class Printer:
    """Driver side: the topic's handler; each line goes to this process's stdout or stderr as
    ``[rankN]: text`` (whole: one write per event, events one after another), each failure as
    ``[rankN]: failed: Type: message`` and, with ``tracebacks``, the rank's traceback."""

    def __init__(
        self, tracebacks: bool | None = None, sink: Callable[[str, str], None] | None = None
    ) -> None:
        self.tracebacks = bool(os.environ.get(DEBUG_ENV)) if tracebacks is None else tracebacks
        self.sink = sink or _write  # (stream name, whole lines): the CLI's goes past its status

    def __call__(self, event: tuple[float, dict[str, Any]]) -> None:
        message = event[1]
        prefix = f"[rank{message['rank']}]: "
        if "failed" in message:
            self.sink("stderr", self.failure_lines(prefix, message["failed"]))
            return
        stream = "stdout" if message.get("stream") == "stdout" else "stderr"
        self.sink(stream, "".join(f"{prefix}{line}\n" for line in message["lines"]))

    def failure_lines(self, prefix: str, info: dict[str, str]) -> str:
        from clusterkit.errors import fit

        head = fit(f"{prefix}failed: {info['type']}: {info['message']}", 1000)
        if not (self.tracebacks and info.get("traceback")):
            return head + "\n"
        body = "".join(f"{prefix}{line}\n" for line in info["traceback"].rstrip().splitlines())
        return f"{head}\n{body}"


def printer_for(stream_output: bool | Printer) -> Printer | None:
    """The printer a run's ``stream_output`` asks for: its own, a plain one, or none."""
    if isinstance(stream_output, Printer):
        return stream_output
    return Printer() if stream_output else None


@contextlib.contextmanager
def subscribed(client: Any, topic: str, printer: Printer | None) -> Iterator[None]:
    """While inside, the ranks' lines on ``topic`` go to ``printer``; nothing when None."""
    if printer is None:
        yield
        return

    def handle(event: tuple[float, dict[str, Any]]) -> None:
        try:
            printer(event)
        except Exception:  # a broken display must not stop the training
            logging.getLogger(__name__).warning("rank output lost", exc_info=True)

    client.subscribe_topic(topic, handle)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a closed client must not hide the outcome
            client.unsubscribe_topic(topic)


def _write(stream: str, text: str) -> None:
    target = sys.stdout if stream == "stdout" else sys.stderr
    with contextlib.suppress(OSError, ValueError):  # a broken stdout must not stop training
        target.write(text)
        target.flush()
