"""optuna-dashboard for a study's storage: read-only, on loopback, live while the search runs.

optuna-dashboard (PyPI ``optuna-dashboard``) is what Optuna users open: history, importances,
parallel coordinates, intermediate values, the trial table. Its page polls the server, which
reads the storage again, so trials appear as the driver flushes them. It has no authentication
and writes through its API (tell, delete studies, notes, user attributes), so it is served:

- behind a secret of its own (:mod:`clusterkit.webauth`), carried once by the printed link;
- on 127.0.0.1 at a free port; a user whose browser is elsewhere gets the ssh tunnel line;
- read-only: every request but GET and HEAD is answered 403 before optuna-dashboard sees it
  (each of its writes is a POST, PUT or DELETE);
- on a handle of its own: a journal file through Optuna's plain backend (it reads what the
  driver's batched journal flushed, and never writes), a database through a new
  ``RDBStorage`` that creates no tables. Another storage object is served as it is.
"""

from __future__ import annotations

import html
import os
import socketserver
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from clusterkit.errors import BadInput
from clusterkit.webauth import Gate, guard_wsgi, new_token, with_token

LOOPBACK = "127.0.0.1"
#: The only methods passed on to optuna-dashboard; every write of its API uses another.
READ_METHODS = frozenset({"GET", "HEAD"})
#: ``/study/NAME``: the page of study NAME (:func:`by_name`).
BY_NAME = "/study/"
WAITING = (
    '<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="1">'
    "<title>study {name}</title><p>waiting for the search to create study {name}...</p>"
)
REFUSED = b'{"reason": "this dashboard is read-only (clusterkit serves no write endpoint)"}'

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def read_only(app: WSGIApp) -> WSGIApp:
    """``app`` answering only GET and HEAD; any other method gets 403 and never reaches it."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET").upper() in READ_METHODS:
            return app(environ, start_response)
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(REFUSED))),
            ("Allow", "GET, HEAD"),
        ]
        start_response("403 Forbidden", headers)
        return [REFUSED]

    return guarded


def by_name(app: WSGIApp, viewer: Any) -> WSGIApp:
    """``app`` where ``/study/NAME`` redirects to that study's page: a link to print before the
    search has created its study (until then, a page that asks again every second)."""

    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not path.startswith(BY_NAME):
            return app(environ, start_response)
        name = path[len(BY_NAME) :].encode("latin-1").decode("utf-8", "replace")  # PEP 3333
        try:
            study_id = viewer.get_study_id_from_name(name)
        except KeyError:
            page = WAITING.format(name=html.escape(name)).encode()
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [page]
        start_response("302 Found", [("Location", f"/dashboard/studies/{study_id}")])
        return [b""]

    return routed


def viewer_storage(storage: Any) -> Any:
    """A reading handle of its own on what ``storage`` (an object, a URL or a journal file
    path) holds; a storage object of another kind is returned as it is."""
    from optuna.storages import BaseStorage, JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    from clusterkit.runners.hpo.storage import journal_path

    if isinstance(storage, BaseStorage):
        if isinstance(storage, RDBStorage):
            return RDBStorage(storage.url, skip_table_creation=True)
        path = journal_path(storage)
        if path is None:
            return storage
        storage = path
    spec = str(storage)
    if "://" in spec:
        return RDBStorage(spec, skip_table_creation=True)
    if not Path(spec).is_file():
        raise BadInput(f"no study storage at {spec}", hint="the search has not created it yet?")
    return JournalStorage(JournalFileBackend(spec))


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a page's open request never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the page polls every few seconds
        pass


@dataclass
class StudyDashboard:
    """optuna-dashboard served from a thread of this process; :meth:`close` stops it."""

    server: WSGIServer
    study_name: str | None
    thread: threading.Thread = field(repr=False)
    #: the secret its pages need (:mod:`clusterkit.webauth`): the printed link carries it once
    token: str = field(default="", repr=False)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        """The study's page (through :func:`by_name`), or the list of studies."""
        page = BY_NAME + quote(self.study_name, safe="") if self.study_name else "/dashboard"
        return with_token(f"http://{LOOPBACK}:{self.port}{page}", self.token)

    def close(self) -> None:
        """Stop serving, close the socket, wait for the thread; idempotent."""
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join()
        self.server.server_close()

    def __enter__(self) -> StudyDashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def artifact_store(where: str | None) -> Any:
    """The artifact store trials uploaded to (``optuna.artifacts.upload_artifact``): a folder
    (``FileSystemArtifactStore``) or ``s3://BUCKET`` (``Boto3ArtifactStore``); None: none."""
    if where is None:
        return None
    if where.startswith("s3://"):
        bucket = where[len("s3://") :].strip("/")
        if not bucket or "/" in bucket:
            raise BadInput(f"artifacts {where!r}: give s3://BUCKET (a bucket, no prefix)")
        try:
            from optuna.artifacts import Boto3ArtifactStore

            return Boto3ArtifactStore(bucket)
        except ImportError as error:
            raise BadInput(f"artifacts {where!r} need boto3", hint="pip install boto3") from error
    if "://" in where:
        raise BadInput(f"artifacts {where!r}: give a folder or s3://BUCKET")
    if not Path(where).is_dir():
        raise BadInput(f"artifacts {where!r}: no such folder")
    from optuna.artifacts import FileSystemArtifactStore

    return FileSystemArtifactStore(where)


def serve(
    storage: Any, study_name: str | None = None, *, port: int = 0, artifacts: str | None = None
) -> StudyDashboard:
    """Serve optuna-dashboard for ``storage`` on 127.0.0.1 (``port`` 0: a free one),
    read-only, until :meth:`StudyDashboard.close`; ``artifacts``: the store the trials'
    artifacts are in (:func:`artifact_store`), shown on their trials' pages."""
    try:
        import optuna_dashboard
    except ImportError as error:
        raise BadInput(
            "the study dashboard needs optuna-dashboard", hint="pip install 'clusterkit[hpo]'"
        ) from error
    store = artifact_store(artifacts)
    viewer = viewer_storage(storage)
    app = read_only(by_name(optuna_dashboard.wsgi(viewer, artifact_store=store), viewer))
    token = new_token()  # the owner's: the link printed in this process
    app = guard_wsgi(app, Gate(token))
    server = make_server(LOOPBACK, port, app, server_class=_Server, handler_class=_QuietHandler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
    )
    thread.name = "clusterkit-study-dashboard"
    thread.start()
    return StudyDashboard(server, study_name, thread, token)


def dask_dashboard(cluster: Any = None, client: Any = None) -> tuple[str | None, str | None]:
    """The Dask dashboard of a cluster from `up` (its record) or of ``client``'s cluster, and
    the tunnel to run first when it listens on another host (what `clusterkit dashboard`
    prints)."""
    from clusterkit.client import dashboard_link
    from clusterkit.monitor import dashboard_link as recorded_link
    from clusterkit.monitor import dashboard_tunnel

    if cluster is not None:
        if not cluster.dashboard:
            return None, None
        tunnel = dashboard_tunnel(cluster)
        return (tunnel[1], tunnel[0]) if tunnel is not None else (recorded_link(cluster), None)
    return (dashboard_link(client) if client is not None else None), None


def links(view: StudyDashboard, cluster: Any = None, client: Any = None) -> list[str]:
    """The lines to print: the study's page, the ssh tunnel to it when this session is remote
    (``SSH_CONNECTION``), and the cluster's Dask dashboard beside it (:func:`dask_dashboard`)."""
    from clusterkit.monitor import ssh_tunnel
    from clusterkit.state import HOST

    lines = [f"study dashboard: {view.url} (read-only)"]
    if os.environ.get("SSH_CONNECTION"):
        command = ssh_tunnel(HOST, view.port)
        lines.append(f"the study dashboard listens on {HOST} only; first run: {command}")
    if cluster is None and client is None:
        lines.append("dask dashboard: not recorded (the run's cluster is its own, not from `up`)")
        return lines
    dask, tunnel = dask_dashboard(cluster, client)
    if dask is None:
        lines.append("dask dashboard: none (the cluster runs without one)")
        return lines
    lines.append(f"dask dashboard: {dask}" + (f" (first run: {tunnel})" if tunnel else ""))
    return lines
