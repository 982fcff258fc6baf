"""A worker told to end by its batch system retires instead of dying with its trials.

SLURM (walltime, ``scancel``, preemption), PBS, Grid Engine and Kubernetes (a pod deletion) end
a worker with SIGTERM, then SIGKILL a grace later (SLURM's KillWait, 30 s by default; a pod's
terminationGracePeriodSeconds, 30 s). Dask's worker process dies at once on it and its nanny
closes it, so a running trial is lost with its progress. While a search runs, its workers
handle it (:func:`register`): the nanny passes the signal to its worker process, which asks
the scheduler to retire it (no new task; ``hpo.should_checkpoint()`` turns True, gangs are
told), waits for its running tasks to end (trials save and raise ``TrialInterrupted``) for at
most ``clusterkit.sigterm-grace`` seconds (Dask config, default :data:`GRACE`), then closes
with its nanny. The batch system's SIGKILL ends whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from distributed.core import Status
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

logger = logging.getLogger(__name__)

#: Seconds a worker waits after SIGTERM for its running tasks before it closes anyway.
GRACE = 25.0
#: Seconds the scheduler has to take a SIGTERMed worker's retirement (it may be gone too).
RETIRE_TIMEOUT = 5.0
NAME = "clusterkit-graceful-end"
#: The modules of ``dask worker`` and ``dask cuda worker`` (jobs' and pods' commands), and the
#: scripts that run them.
COMMANDS = ("distributed.cli.dask_worker", "dask_cuda.cli")
SCRIPTS = ("dask", "dask-worker", "dask-cuda-worker")


def grace() -> float:
    """``clusterkit.sigterm-grace`` from Dask's config, in seconds; else :data:`GRACE`."""
    import dask
    from dask.utils import parse_timedelta

    value = dask.config.get("clusterkit.sigterm-grace", None)
    return GRACE if value is None else float(parse_timedelta(value))


def end_after_sigterm(dask_worker: Any) -> float | None:
    """The latest ``dask_worker`` closes, a ``time.time()`` stamp, once it got SIGTERM (None: it
    did not)."""
    plugin = getattr(dask_worker, "plugins", {}).get(NAME)
    if not isinstance(plugin, RetireOnSigterm) or plugin.noted_at is None:
        return None
    return plugin.noted_at + plugin.grace


class RetireOnSigterm(WorkerPlugin):
    """In the worker process: SIGTERM retires the worker once its running tasks ended."""

    name = NAME
    idempotent = True

    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace
        self.noted_at: float | None = None
        self._previous: Any = None

    def setup(self, worker: Any) -> None:
        self.worker, self.noted_at = worker, None
        if worker.nanny or in_worker_command():  # a process of its own: its signal
            self._previous = _handle(self._noted)

    def teardown(self, worker: Any) -> None:
        _restore(self._previous)

    def _noted(self, signum: int, frame: Any) -> None:
        if self.noted_at is None:  # the nanny passes on the batch system's: the same signal
            self.noted_at = time.time()
            self.worker.loop.asyncio_loop.call_soon_threadsafe(self._start_retiring)

    def _start_retiring(self) -> None:
        self._retiring = asyncio.ensure_future(self._retire())

    async def _retire(self) -> None:
        worker = self.worker
        logger.info(
            "SIGTERM: worker %s retires; its running tasks have %.0fs to end",
            worker.address,
            self.grace,
        )
        retiring = worker.scheduler.retire_workers(
            workers=[worker.address],
            close_workers=False,
            remove=False,
            stimulus_id=f"clusterkit-sigterm-{time.time()}",
        )
        with contextlib.suppress(Exception):  # the scheduler gone (`down`): close all the same
            await asyncio.wait_for(retiring, RETIRE_TIMEOUT)
        deadline = time.monotonic() + self.grace
        while _running(worker) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await worker.close(nanny=True, reason="SIGTERM: retired")


def _running(worker: Any) -> int:
    state = worker.state
    return int(state.executing_count) + len(state.long_running)


class ForwardSigterm(NannyPlugin):
    """In a ``dask worker`` command's process: SIGTERM goes to each nanny's worker process,
    which retires (:class:`RetireOnSigterm`) and closes its nanny with it; the nannies do not
    close them. Elsewhere (nannies inside another program) nothing changes."""

    name = NAME
    idempotent = True

    def setup(self, nanny: Any) -> None:
        if not in_worker_command():
            return
        if not _nannies:
            _previous.append(_handle(_forward))
        _nannies.append(nanny)

    def teardown(self, nanny: Any) -> None:
        if nanny in _nannies:
            _nannies.remove(nanny)
            if not _nannies and _previous:
                _restore(_previous.pop())


_nannies: list[Any] = []  # this process's nannies whose workers SIGTERM goes to
_previous: list[Any] = []  # the handler before :func:`_forward`


def _forward(signum: int, frame: Any) -> None:
    """SIGTERM in a worker command's process: each nanny's worker gets it, and the nanny closes
    once its worker exits, however it ends (it never starts another)."""
    live = [n for n in _nannies if n.process is not None and n.process.is_alive()]
    if not live and _previous and callable(_previous[0]):  # no worker: as before
        _previous[0](signum, frame)
    for nanny in live:
        nanny.status = Status.closing_gracefully  # Nanny.close_gracefully(), without its log
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(nanny.process.pid, signal.SIGTERM)


def in_worker_command() -> bool:
    """Whether this process is a ``dask worker`` or ``dask cuda worker`` command's (a batch
    job's, a pod's): run as ``python -m MODULE``, or as the ``dask`` script with the module
    loaded. Not a program that runs its nannies itself (a LocalCluster's)."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main, "name", None) in COMMANDS:
        return True
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script in SCRIPTS and any(module in sys.modules for module in COMMANDS)


def _handle(handler: Any) -> Any:
    """SIGTERM handled by ``handler``; the handler before it (None: not in the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _restore(previous: Any) -> None:
    if previous is not None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def registered(client: Any) -> Iterator[None]:
    """SIGTERM retires the workers of ``client``'s cluster (those to come too) while inside;
    Dask's own SIGTERM handling back after."""
    client.register_plugin(RetireOnSigterm(grace()), name=NAME)
    client.register_plugin(ForwardSigterm(), name=NAME)
    try:
        yield
    finally:
        if client.status == "running":  # a cluster gone: its processes ended anyway
            with contextlib.suppress(Exception):
                client.sync(_unregister, client)


async def _unregister(client: Any) -> None:
    """The plugin off the workers and the nannies at once (a broadcast to every nanny: 5 ms on
    8 idle workers, 0.25-0.33 s while they start spare rank processes, hence before a gang
    search's release); waited for, since a client closed right after the search would leave it
    on."""
    scheduler = client.scheduler
    both = asyncio.gather(
        scheduler.unregister_worker_plugin(name=NAME),
        scheduler.unregister_nanny_plugin(name=NAME),
        return_exceptions=True,
    )
    await asyncio.wait_for(both, RETIRE_TIMEOUT)  # a cluster lost mid-search: do not hang on it
