"""The user's project directory on every worker: in place on a shared disk, else a synced copy.

Driver: ``project = resolve(workdir, fn)`` then ``ship(client, project)``. Worker:
``with entered(project) as directory:`` runs code with that directory as the working
directory and first on ``sys.path``, as ``python script.py`` or torchrun would.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clusterkit.runners.workdir.project import (
    COPY_ENV,
    DEFAULT_MAX_SIZE,
    MAX_SIZE_ENV,
    Project,
    parse_max_size,
    scan,
    without_outputs,
    writes,
)
from clusterkit.runners.workdir.ship import Shipment, reship, ship

__all__ = [
    "COPY_ENV",
    "DEFAULT_MAX_SIZE",
    "MAX_SIZE_ENV",
    "Project",
    "ProjectCall",
    "Shipment",
    "entered",
    "in_project",
    "parse_max_size",
    "reship",
    "resolve",
    "scan",
    "ship",
    "writes",
]

AUTO = "auto"
_enter_lock = threading.Lock()
_entered: dict[str, int] = {}  # directory -> trials/ranks inside it now (threads share a cwd)
_saved_cwd: list[str] = []
_last_project: dict[str, Project] = {}  # directory -> the version of it entered last


def _module_file(fn: Callable[..., Any]) -> str | None:
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return getattr(module, "__file__", None) if module is not None else None


def resolve(
    workdir: str | os.PathLike[str] | Project | None,
    fn: Callable[..., Any] | None = None,
    *,
    max_size: int | None = None,
) -> Project | None:
    """The project for ``workdir``: a path, a Project, None (off) or ``"auto"``.

    ``"auto"``: the current directory when ``fn``'s module file lives under it, else off.
    A Project scanned earlier loses the files this process has begun to write since.
    """
    if workdir is None:
        return None
    if isinstance(workdir, Project):
        return without_outputs(workdir)
    if str(workdir) == AUTO:
        where = _module_file(fn) if fn is not None else None
        cwd = Path.cwd().resolve()
        if where is None or cwd not in Path(where).resolve().parents:
            return None
        workdir = cwd
    return scan(workdir, max_size=max_size)


class ProjectCall:
    """``fn`` run inside ``project`` on the worker; unpickled there, after the project is on
    ``sys.path``, so the modules it uses by reference are the project's own."""

    def __init__(self, fn: Callable[..., Any], project: Project) -> None:
        from clusterkit.runners.workdir.pickling import dumps

        self.blob = dumps(fn)
        self.project = project
        self.topic = f"clusterkit-warnings-{uuid.uuid4().hex[:12]}"
        self.collector: Any = None  # driver side only
        self.__name__ = getattr(fn, "__name__", "objective")
        self.__wrapped__: Callable[..., Any] | None = fn

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "__wrapped__": None, "collector": None}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import cloudpickle

        from clusterkit.runners.workdir import once

        with entered(self.project), once.recorded() as raised:
            try:
                if self.__wrapped__ is None:  # kept: the worker caches this object
                    self.__wrapped__ = cloudpickle.loads(self.blob)
                return self.__wrapped__(*args, **kwargs)
            finally:
                once.send(self.topic, raised)

    def warnings_summary(self, what: str) -> None:
        """Driver side: show each warning the calls raised once, with how many raised it."""
        if self.collector is not None:
            self.collector.summary(what)


def in_project(
    client: Any, fn: Callable[..., Any], workdir: str | os.PathLike[str] | Project | None
) -> Callable[..., Any]:
    """Driver side: ship the project (``resolve(workdir, fn)``) and wrap ``fn`` to run in it."""
    project = resolve(workdir, fn)
    if project is None:
        return fn
    from clusterkit.runners.workdir.once import Collector

    ship(client, project)
    call = ProjectCall(fn, project)
    call.collector = Collector(client, call.topic)
    return call


def _purge_stale_modules(directory: str, project: Project) -> None:
    """Forget modules imported from an older version of this project (long-lived workers).

    Only the project's own files count: a virtual environment or anything else ignored under
    the directory (``.venv/.../numpy``) is not the project, and forgetting those modules
    breaks the worker (an extension module cannot be loaded twice)."""
    previous = _last_project.get(directory)
    _last_project[directory] = project
    if previous is None or previous.digest == project.digest:
        return  # the common case, every trial: no file lists built
    stale = {f.path for f in previous.files} | {f.path for f in project.files}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and _relative(path, directory) in stale:
            del sys.modules[name]
    import importlib

    importlib.invalidate_caches()


def _relative(path: str, directory: str) -> str | None:
    """``path`` relative to ``directory`` in the project's notation, or None if outside."""
    prefix = directory.rstrip(os.sep) + os.sep
    return path[len(prefix) :].replace(os.sep, "/") if path.startswith(prefix) else None


@contextlib.contextmanager
def entered(project: Project | None) -> Iterator[str | None]:
    """Worker side: run inside the project (cwd, ``sys.path[0]``); yields its directory."""
    if project is None:
        yield None
        return
    from clusterkit.runners.workdir import tree

    found = tree.locate(project) or _built(project)
    directory = found[0]
    with _enter_lock:
        if not any(_entered.values()):
            _saved_cwd[:] = [os.getcwd()]
        _entered[directory] = _entered.get(directory, 0) + 1
        _purge_stale_modules(directory, project)
        os.chdir(directory)
        sys.path.insert(0, directory)
    try:
        yield directory
    finally:
        with _enter_lock:
            _entered[directory] -= 1
            with contextlib.suppress(ValueError):
                sys.path.remove(directory)
            if not any(_entered.values()) and _saved_cwd:
                os.chdir(_saved_cwd.pop())


def _built(project: Project) -> tuple[str, str]:
    from clusterkit.runners.workdir import tree

    found = tree.probe(project)
    located = tree.locate(project)
    if located is None:
        raise RuntimeError(
            f"project {project.root} is not on this worker ({len(found['missing'])} files "
            "missing): it joined without the clusterkit workdir plugin"
        )
    return located
