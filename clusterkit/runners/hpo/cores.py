"""joblib inside a trial: the worker's cores, in threads.

Dask starts its worker processes as daemons, and a daemon may start no process of its own:
there joblib's default backend (loky, processes) runs ``n_jobs=-1`` (sklearn's) as one job,
with a warning to reconfigure Dask before the cluster is created, which a user of the CLI
cannot do. In a daemonic worker a trial's joblib calls run in threads instead, as many for
``n_jobs=-1`` as the worker has cores: this host's CPUs as joblib counts them (affinity, cgroup
quota) shared among the Dask workers' threads on this host, and never fewer than this worker's
own threads. A backend the objective chooses itself (``parallel_config``, ``backend=``) wins.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds to wait for the scheduler's list of workers before counting this worker alone.
IDENTITY_TIMEOUT = 10.0


@contextlib.contextmanager
def joblib_on_worker_cores() -> Iterator[None]:
    """Inside: joblib's default backend is threads on this worker's cores (in a daemonic
    Dask worker process; elsewhere, and without joblib, nothing changes)."""
    backend = _threads_backend() if multiprocessing.current_process().daemon else None
    if backend is None:
        yield
        return
    import joblib

    with joblib.parallel_config(backend=backend()):
        yield


def call(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with joblib on this worker's cores."""
    with joblib_on_worker_cores():
        return function(*args)


@functools.cache
def _threads_backend() -> type | None:
    """joblib's threads backend, ``n_jobs=-1`` counted on this worker's cores."""
    try:
        from joblib.parallel import ThreadingBackend
    except ImportError:
        return None

    class WorkerThreads(ThreadingBackend):  # type: ignore[misc]
        """Threads; ``n_jobs=-1`` is this worker's cores, -2 one fewer, and so on."""

        cores: int | None = None  # counted once per trial (one backend each)

        def effective_n_jobs(self, n_jobs: int | None) -> int:
            if n_jobs is None or n_jobs >= 0:
                return int(super().effective_n_jobs(n_jobs))
            if self.cores is None:
                self.cores = worker_cores()
            return max(self.cores + 1 + n_jobs, 1)

    return WorkerThreads


def worker_cores() -> int:
    """This worker's share of its host's CPUs, by its threads among the host's worker threads;
    at least its own thread count."""
    from distributed import get_worker
    from distributed.comm import get_address_host
    from distributed.utils import sync
    from joblib import cpu_count

    worker = get_worker()
    own = int(worker.state.nthreads)
    host = get_address_host(worker.address)
    try:
        info: dict[str, Any] = sync(
            worker.loop, worker.scheduler.identity, callback_timeout=IDENTITY_TIMEOUT
        )
    except Exception as error:  # the scheduler is busy or gone: this worker alone
        logger.debug("no worker list from the scheduler: %r", error)
        return max(own, int(cpu_count()))
    on_host = sum(
        int(w.get("nthreads", 0)) for w in info.get("workers", {}).values() if w.get("host") == host
    )
    return max(own, int(cpu_count()) * own // max(on_host, own, 1))
