"""The supervisor's control socket: one JSON request per connection, one JSON reply.

A 0600 Unix socket in the user's private runtime directory on the local disk
(``state.control_socket``); only its owner can connect.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clusterkit.errors import ClusterkitError

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def request(path: str, payload: dict[str, Any], *, timeout: float = 60) -> dict[str, Any]:
    """Send one request to the control socket at ``path`` and return its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data or b"{}")
    if not reply.get("ok"):
        raise ClusterkitError(str(reply.get("error", "no answer from the supervisor")))
    return reply


def serve(path: Path, handle: Handler) -> socketserver.UnixStreamServer:
    """Answer requests at ``path`` with ``handle`` on a daemon thread; returns the server."""

    class _Connection(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            try:
                reply = handle(json.loads(self.rfile.readline() or b"{}"))
            except Exception as error:  # reported to the caller, not fatal here
                logger.exception("control request failed")
                reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            self.wfile.write(json.dumps(reply, default=str).encode() + b"\n")

    path.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        server = socketserver.ThreadingUnixStreamServer(str(path), _Connection)
    finally:
        os.umask(old)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="control").start()
    return server
