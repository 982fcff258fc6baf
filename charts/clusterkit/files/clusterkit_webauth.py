"""The owner's secret in front of every web page of a cluster or a run.

Dask's HTTP server (the dashboard with its websockets, the info and JSON pages, ``/metrics``)
and optuna-dashboard have no authentication, and 127.0.0.1 answers every user of the host. The
gate answers 403 to any request without one of:

- ``?token=SECRET`` on a GET, the link clusterkit prints: answered with a cookie and a redirect
  to the same page without it (as Jupyter does), so the secret leaves the address bar;
- that cookie (``clusterkit-<digest>``, one name per secret: cookies do not tell ports apart);
- ``Authorization: Bearer SECRET`` (a Prometheus scrape, ``curl``).

``/health`` stays open (liveness probes). A Dask server gets the gate from this module as a
preload (``dask_setup``), given the secret's file by ``--token-file`` or
``$CLUSTERKIT_WEB_TOKEN_FILE``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import click

#: The secret's file in a cluster's directory, beside its certificates.
TOKEN_FILE = "web-token"
#: Where a Dask process started elsewhere (a job, a pod, an SSH host) finds the secret's file.
TOKEN_ENV = "CLUSTERKIT_WEB_TOKEN_FILE"
#: Path prefixes a Dask process serves without the secret, beside /health (space-separated).
OPEN_PATHS_ENV = "CLUSTERKIT_WEB_OPEN_PATHS"
#: The preload that puts the gate in a Dask scheduler or worker.
PRELOAD = __name__
QUERY = "token"
ALWAYS_OPEN = ("/health",)
REFUSED = (
    b"403: this page needs its owner's secret: open the link `clusterkit dashboard NAME` prints"
    b" (or send Authorization: Bearer SECRET)\n"
)


def new_token() -> str:
    """A fresh secret (256 bits, URL- and cookie-safe)."""
    return secrets.token_urlsafe(32)


def write_token(directory: Path) -> Path:
    """A fresh secret in ``directory``/web-token, created 0600."""
    path = directory / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(new_token() + "\n")
    os.chmod(path, 0o600)
    return path


def read_token(path: str | os.PathLike[str]) -> str:
    """The secret in ``path``; ValueError if it is empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path}: empty web token")
    return token


def with_token(url: str, token: str | None) -> str:
    """``url`` carrying ``token`` once (the link to print); unchanged without one."""
    if not token:
        return url
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query, keep_blank_values=True), (QUERY, token)]
    return urlunsplit(parts._replace(query=urlencode(query)))


def link(url: str | None, token_file: str | None) -> str | None:
    """The printable link of a page served behind the secret in ``token_file``."""
    if not url or not token_file or not Path(token_file).is_file():
        return url
    return with_token(url, read_token(token_file))


def preloads(
    token_file: str | None, modules: list[str], *, open_paths: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``preload`` and ``preload_argv`` of a Dask server started in this process: ``modules``
    then the gate, given ``token_file`` on its argv (clusters in one process differ)."""
    if token_file is None:
        return {"preload": modules} if modules else {}
    argv = ["--token-file", token_file]
    for path in open_paths:
        argv += ["--open-path", path]
    return {"preload": [*modules, PRELOAD], "preload_argv": [*([] for _ in modules), argv]}


def token_env(token_file: str | None) -> dict[str, str]:
    """Environment telling the gate of a Dask process where the secret is."""
    return {TOKEN_ENV: token_file} if token_file else {}


def remote_env(directory: str | None) -> dict[str, str]:
    """:func:`token_env` of a process started elsewhere: the secret's copy in the cluster's
    ``directory`` there."""
    return token_env(f"{directory}/{TOKEN_FILE}" if directory else None)


@dataclass(frozen=True)
class Gate:
    """Who passes: the holder of ``token``, and anyone to ``open_paths`` (prefixes)."""

    token: str
    open_paths: tuple[str, ...] = ALWAYS_OPEN

    @property
    def cookie(self) -> str:
        return "clusterkit-" + hashlib.sha256(self.token.encode()).hexdigest()[:12]

    def _is(self, value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(str(value).encode(), self.token.encode())

    def _cookie_value(self, header: str | None) -> str | None:
        try:
            morsel = SimpleCookie(header or "").get(self.cookie)
        except CookieError:
            return None
        return morsel.value if morsel is not None else None

    def decide(
        self, method: str, path: str, query: str, authorization: str | None, cookie: str | None
    ) -> tuple[str, str | None]:
        """``("pass", None)``, ``("enter", location)`` (set the cookie, redirect there) or
        ``("refuse", None)``."""
        if any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.open_paths):
            return "pass", None
        scheme, _, credential = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and self._is(credential.strip()):
            return "pass", None
        if self._is(self._cookie_value(cookie)):
            return "pass", None
        pairs = parse_qsl(query, keep_blank_values=True)
        if method in ("GET", "HEAD") and any(k == QUERY and self._is(v) for k, v in pairs):
            rest = urlencode([(k, v) for k, v in pairs if k != QUERY])
            return "enter", path + (f"?{rest}" if rest else "")
        return "refuse", None

    def set_cookie(self) -> str:
        """The ``Set-Cookie`` value that lets a browser in from now on."""
        return f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Lax"


def guard(application: Any, gate: Gate) -> None:
    """Put ``gate`` in front of every route of a tornado ``Application`` (Dask's HTTP server,
    the bokeh dashboard's pages and websockets included: they are routed through it)."""
    from tornado.routing import Matcher, Rule
    from tornado.web import RequestHandler

    def verdict(request: Any) -> tuple[str, str | None]:
        headers = request.headers
        return gate.decide(
            request.method or "GET",
            request.path,
            request.query,
            headers.get("Authorization"),
            headers.get("Cookie"),
        )

    class Stopped(Matcher):
        def match(self, request: Any) -> dict[str, Any] | None:
            return None if verdict(request)[0] == "pass" else {}

    class Door(RequestHandler):
        def prepare(self) -> None:
            decision, location = verdict(self.request)
            if decision == "enter" and location is not None:
                self.add_header("Set-Cookie", gate.set_cookie())
                self.redirect(location)
                return
            self.set_status(403)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish(REFUSED)

    router = application.default_router
    router.rules.insert(0, router.process_rule(Rule(Stopped(), Door)))


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def guard_wsgi(app: WSGIApp, gate: Gate) -> WSGIApp:
    """``app`` (optuna-dashboard) behind ``gate``."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        decision, location = gate.decide(
            environ.get("REQUEST_METHOD", "GET").upper(),
            environ.get("PATH_INFO", "") or "/",
            environ.get("QUERY_STRING", ""),
            environ.get("HTTP_AUTHORIZATION"),
            environ.get("HTTP_COOKIE"),
        )
        if decision == "pass":
            return app(environ, start_response)
        if decision == "enter" and location is not None:
            start_response("302 Found", [("Location", location), ("Set-Cookie", gate.set_cookie())])
            return [b""]
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
        return [REFUSED]

    return guarded


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--token-file", envvar=TOKEN_ENV, help="The secret's file.")
@click.option("--open-path", multiple=True, envvar=OPEN_PATHS_ENV, help="Served to anyone.")
@click.argument("others", nargs=-1, type=click.UNPROCESSED)
def dask_setup(
    server: Any, token_file: str | None, open_path: tuple[str, ...], others: Any
) -> None:
    """Dask preload: the gate in front of ``server``'s HTTP routes, as it starts. ``others``:
    what a launcher gives every preload (dask-cuda's ``--create-cuda-context``). Without the
    secret's file the server does not start (its pages would be open)."""
    if not token_file:
        raise click.UsageError(f"the web pages' gate needs --token-file or ${TOKEN_ENV}")
    guard(server.http_application, Gate(read_token(token_file), ALWAYS_OPEN + open_path))
