"""Warm the workers before their first trial: while the driver ships the project, opens the loop
and samples, every worker imports the runner's worker side (optuna), the modules the objective's
module imports and, once the project is in place there, that module itself.

A worker plugin, registered without waiting for it (on the client's event loop): live workers
run it at once and workers that join later when they start (after the project's own plugin has
fetched the files: the warm-up waits for the project). Its setup imports the runner's modules
(optuna) on the worker's event loop, the thread that unpickles tasks and ``client.run``
functions: two threads importing optuna at once can each get it half-initialised (its circular
imports), an ImportError. The objective's modules are imported in a thread, so neither the driver
nor a worker's start waits for them; a trial unpickles its objective under :data:`IMPORTING`,
which that thread holds while it imports, so it waits as it would have imported them itself
(torch's imports are no safer from two threads at once). Only what is importable is
warmed: an objective pickled by value (``__main__``, a notebook, a module registered by value)
gets the runner's modules only. Errors are logged at debug level and dropped: the trial, which
imports the same modules, reports the real one. :func:`start` returns the search's
:class:`Warmup`, which :func:`stop` unregisters: searches sharing a client each stop their own.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
import threading
import time
import types
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

if TYPE_CHECKING:
    from clusterkit.runners.workdir import Project

logger = logging.getLogger(__name__)

#: Off: the first trial on each worker pays the imports (bench/hpo.py --cold --no-warm).
ENABLED = True
#: Seconds the warm-up waits for the project on a worker before giving the module up.
PROJECT_WAIT = 30.0
RUNNER_MODULES = ("clusterkit.runners.hpo.worker", "clusterkit.runners.workdir")
#: Held by the warm-up thread while it imports, and by a trial unpickling its objective.
IMPORTING = threading.Lock()


class WarmPlugin(WorkerPlugin):
    """Imports ``modules`` on the worker, then ``module`` inside ``project`` (if any)."""

    def __init__(self, modules: list[str], module: str | None, project: Project | None) -> None:
        self.modules = modules
        self.module = module
        self.project = project

    def setup(self, worker: Any) -> None:
        _import_each(RUNNER_MODULES)  # here, on the event loop: see the module's docstring
        threading.Thread(target=self.warm, name="clusterkit-hpo-warmup", daemon=True).start()

    def warm(self) -> None:
        with IMPORTING:
            _import_each(self.modules)
        if self.module is None:
            return
        try:
            if self.project is None:
                with IMPORTING:
                    importlib.import_module(self.module)
                return
            from clusterkit.runners.workdir import entered, tree

            deadline = time.monotonic() + PROJECT_WAIT
            while tree.locate(self.project) is None:  # a late worker: still fetching it
                if time.monotonic() > deadline:
                    return
                time.sleep(0.2)
            with IMPORTING, entered(self.project):
                importlib.import_module(self.module)
        except BaseException as error:
            logger.debug("warm-up: importing %s failed: %r", self.module, error)


def _import_each(modules: tuple[str, ...] | list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as error:  # the trial reports it, if it matters
            logger.debug("warm-up: importing %s failed: %r", name, error)


@dataclass(frozen=True)
class Warmup:
    """One search's warm-up plugin: registered under ``name``, until :func:`stop`."""

    client: Any
    name: str
    #: Set on the client's loop once registration is over: True if it succeeded.
    registered: Future[bool] = field(default_factory=Future)


def start(client: Any, objective: Any, project: Project | None) -> Warmup | None:
    """Register the warm-up for ``objective`` on the cluster, not waiting for it."""
    if not ENABLED:
        return None
    try:
        plugin = WarmPlugin(*_modules(objective, project), project)
        warm = Warmup(client, f"clusterkit-hpo-warmup-{uuid.uuid4().hex[:12]}")
        client.loop.add_callback(_register, warm, plugin)
        return warm
    except Exception as error:  # never stop a search for its warm-up
        logger.debug("warm-up not started: %r", error)
        return None


def stop(warm: Warmup | None) -> None:
    """Unregister this warm-up (without waiting): later workers need not import it."""
    if warm is None:
        return
    try:  # a closed client's loop drops the callback, or is gone
        warm.client.loop.add_callback(_unregister, warm)
    except Exception as error:
        logger.debug("warm-up not unregistered: %r", error)


# Run on the client's event loop, where its public methods return coroutines instead of blocking.
async def _register(warm: Warmup, plugin: WarmPlugin) -> None:
    try:
        await warm.client.register_plugin(plugin, warm.name)
        warm.registered.set_result(True)
    except Exception as error:
        warm.registered.set_result(False)
        logger.debug("warm-up not registered: %r", error)


async def _unregister(warm: Warmup) -> None:
    try:  # after the registration: the scheduler may not have it yet
        if await asyncio.wrap_future(warm.registered):
            await warm.client.unregister_worker_plugin(warm.name)
    except Exception as error:  # gone with the cluster or the client
        logger.debug("warm-up not unregistered: %r", error)


def _modules(objective: Any, project: Project | None) -> tuple[list[str], str | None]:
    """The modules to import first (the objective module's own imports outside the project),
    and the objective's module, or None when it travels by value."""
    fn = getattr(objective, "func", objective)  # a functools.partial: its function
    name = getattr(fn, "__module__", None) or type(fn).__module__
    module = sys.modules.get(name)
    if module is None or name in ("__main__", "__mp_main__") or _by_value(name):
        return [], None
    if not getattr(module, "__file__", None):
        return [], None
    inside = project.root + os.sep if project is not None else None
    imported = sorted(
        value.__name__
        for value in vars(module).values()
        if isinstance(value, types.ModuleType)
        and value.__name__ not in ("__main__", "__mp_main__")
        and not (inside and (getattr(value, "__file__", None) or "").startswith(inside))
    )
    return imported, name


def _by_value(name: str) -> bool:
    import cloudpickle

    registered: set[str] = getattr(cloudpickle, "list_registry_pickle_by_value", set)()
    return any(name == m or name.startswith(m + ".") for m in registered)
