"""Rank processes kept ready on a worker: one spare, and warm ones a search reuses.

A rank process imports torch before it is needed (a *spare*), so a run on a cluster that is up
starts in well under a second; the spare is replaced when a run ends. A search's gang trials go
further: a rank process that ended its trial cleanly is kept *warm* for the next trial of the
same search (its objective's modules imported, its process group destroyed, its environment and
working directory put back), so a trial starts without a new interpreter. Warm processes belong
to one search (``reuse`` scope) and, for NCCL, to one GPU layout; a process that failed is never
reused. While a worker holds a warm process its spare is not replaced: the search's own trials
do not need it, and a new spare imports torch (seconds of CPU) beside them; it comes back when
the search releases its warm processes, or a rank process is not kept.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger(__name__)

SPARE_ENV = "CLUSTERKIT_DDP_SPARES"  # "0" disables spare rank processes
REUSE_ENV = "CLUSTERKIT_DDP_REUSE"  # "0": every trial's ranks in fresh processes
#: "0": spares import torch only, not also what DDP's first construction needs
#: (``rank.SPARE_PRELOAD``); the first training step then comes about a second later
PRELOAD_ENV = "CLUSTERKIT_DDP_PRELOAD"
#: glibc's trim threshold, which a Dask nanny sets for its worker (not for rank processes)
TRIM = "MALLOC_TRIM_THRESHOLD_"

_lock = threading.Lock()
_spares: list[RankProcess] = []
_warm: dict[tuple[Any, ...], list[RankProcess]] = {}
_releasing: list[threading.Thread] = []  # release() threads that may still start a spare
_imports: list[str] = []  # modules spares import too: the rank code of the runners used here
_broadcasts: set[Any] = set()  # on the scheduler: releases under way (release_everywhere)


class RankProcess:
    """A rank process and our end of its socket; ``ready`` once it waits for a spec. A spare
    imports what a training's first steps need before it is ready (``rank.SPARE_PRELOAD``, and
    the modules :func:`preload` named; ``CLUSTERKIT_DDP_PRELOAD=0``: torch only)."""

    def __init__(self, threads: int, spare: bool = False) -> None:
        ours, theirs = socket.socketpair()
        env = rank_environ(threads)
        argv = [sys.executable, "-m", "clusterkit.runners.ddp.rank", str(theirs.fileno())]
        if spare and os.environ.get(PRELOAD_ENV, "1") != "0":
            argv += ["--preload", *_imports]
        self.proc = subprocess.Popen(
            argv,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            # away from the terminal's Ctrl-C: the driver stops the ranks (and a rank whose
            # worker is gone ends itself), not a KeyboardInterrupt in each rank
            start_new_session=True,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_ready(self) -> bool:
        """Consume the ``ready`` message if it has arrived."""
        if not self.ready and self.conn.poll(0):
            message = self.conn.recv()
            self.ready = message[0] == "ready"
        return self.ready

    def close(self) -> None:
        self.conn.close()
        if self.alive():
            self.proc.kill()
        self.proc.wait()


def rank_environ(threads: int) -> dict[str, str]:
    """A rank process's environment: the worker's with its threads, less the malloc trim
    threshold a Dask nanny gives its worker (``distributed.nanny.pre-spawn-environ``, 64 KiB).
    Inherited, it turns off glibc's adaptive mmap threshold, so every tensor over 128 KiB a
    training step frees goes back to the kernel and faults in again (a small MLP: 54,000 page
    faults an epoch instead of 2, 1.5x the CPU; 4 ranks over two nodes: the steady epoch 1.36x
    torchrun's). A value of the worker's own (another value) stays."""
    import dask

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    nanny = dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}
    if TRIM in nanny and env.get(TRIM) == str(nanny[TRIM]):
        del env[TRIM]
    return env


def threads_of(worker: Any) -> int:
    return max(1, int(getattr(worker.state, "nthreads", 1)))


def ensure_spare(worker: Any) -> None:
    """Start a spare rank process on this worker unless one is there (or spares are off)."""
    if os.environ.get(SPARE_ENV, "1") == "0":
        return
    with _lock:
        _spares[:] = [r for r in _spares if r.alive()]
        if not _spares:
            _spares.append(RankProcess(threads_of(worker), spare=True))


def preload(modules: list[str]) -> None:
    """Spares started on this worker from now on import ``modules`` too (a runner's rank code:
    a search's first trial on each worker then does not import Optuna beside the others)."""
    with _lock:
        _imports.extend(m for m in modules if m not in _imports)


def spare_ready() -> bool:
    """Whether this worker's spare has imported torch (client.run helper for benchmarks)."""
    with _lock:
        return any(r.alive() and r.check_ready() for r in _spares)


def warm_key(spec: dict[str, Any]) -> tuple[Any, ...] | None:
    """Which warm processes may serve ``spec``: same search, and for NCCL the same GPU layout
    (CUDA reads it once per process); None when the spec does not reuse processes."""
    scope = spec.get("reuse")
    if scope is None or os.environ.get(REUSE_ENV, "1") == "0":
        return None
    layout = (spec["slot"], spec["local_rank"]) if spec["backend"] == "nccl" else None
    return (scope, layout, spec["threads"])


def take(spec: dict[str, Any]) -> RankProcess:
    """A warm process for ``spec`` if one is idle, else the spare, else a new process."""
    key = warm_key(spec)
    with _lock:
        for pool in (_warm.get(key, []) if key else [], _spares):
            while pool:
                process = pool.pop()
                if process.alive():
                    return process
                process.close()
    return RankProcess(spec["threads"])


def keep_warm(spec: dict[str, Any], process: RankProcess, limit: int) -> bool:
    """Keep ``process`` (whose rank ended cleanly) for the next trial of the same search; the
    warm processes of other searches go. False when it is not kept (the caller ends it)."""
    key = warm_key(spec)
    if key is None or not process.alive():
        return False
    process.ready = False  # it says ``ready`` again once its state is put back
    with _lock:
        stale = [k for k in _warm if k[0] != key[0]]
        gone = [p for k in stale for p in _warm.pop(k)]
        pool = _warm.setdefault(key, [])
        kept = len(pool) < limit
        if kept:
            pool.append(process)
    for old in gone:
        old.close()
    return kept


def release(scope: str, dask_worker: Any = None) -> int:
    """End the warm processes of search ``scope`` and put a spare back (at the search's end,
    :func:`release_everywhere`), off the worker's event loop: the search returns without
    waiting for them (8 workers ending and starting processes on 2 cores held its return
    0.2-0.5 s); how many end. None held: the spare was never stood in for, and nothing
    starts (a release that reaches a worker after :func:`end_all` leaves no process behind)."""
    with _lock:
        gone = [p for k in [k for k in _warm if k[0] == scope] for p in _warm.pop(k)]
        if not gone:
            return 0
        thread = threading.Thread(
            target=_replace, args=(gone, dask_worker), name="clusterkit-rank-release", daemon=True
        )
        _releasing[:] = [t for t in _releasing if t.is_alive()] + [thread]
    thread.start()
    return len(gone)


async def release_soon(scope: str, dask_worker: Any = None) -> None:
    """:func:`release` once the worker has answered (a ``run`` with ``wait=False``, sent by
    :func:`release_everywhere`: answering first, a busy worker does not hold the broadcast)."""
    release(scope, dask_worker)


async def release_everywhere(scope: str, dask_scheduler: Any = None) -> None:
    """On the scheduler (``client.run_on_scheduler``): :func:`release_soon` on every worker,
    broadcast in the background. The search waits for the scheduler alone, which then sees the
    release through if the client closes at once; waiting for every worker's answer held a
    gang search's return 22-442 ms while its workers were busy."""
    import asyncio

    from distributed.protocol.pickle import dumps

    message = {
        "op": "run",
        "function": dumps(release_soon),
        "args": dumps((scope,)),
        "kwargs": dumps({}),
        "wait": False,
    }
    sending = asyncio.ensure_future(dask_scheduler.broadcast(msg=message, on_error="ignore"))
    _broadcasts.add(sending)  # a reference, or the task may be collected before it ends
    sending.add_done_callback(_broadcasts.discard)


def _replace(gone: list[RankProcess], worker: Any) -> None:
    """End ``gone``, then start the worker's spare (:func:`release`'s thread)."""
    for process in gone:
        process.close()
    if worker is not None:
        ensure_spare(worker)


class SparePlugin(WorkerPlugin):
    """Keeps a spare rank process on every worker, including workers that join later; it
    imports ``imports`` too (:func:`preload`)."""

    name = "clusterkit-ddp-spares"

    def __init__(self, imports: tuple[str, ...] = ()) -> None:
        self.imports = imports

    def setup(self, worker: Any) -> None:
        from clusterkit.runners.ddp import ports

        ports.install(worker)  # before the first group: a rank 0 elsewhere may send it a port
        preload(list(self.imports))
        ensure_spare(worker)
        threading.Thread(target=connect_client, args=(worker,), daemon=True).start()

    def teardown(self, worker: Any) -> None:
        end_all()


def connect_client(worker: Any) -> None:
    """Open the worker's own client to the scheduler now: a gang's rank 0 publishes its
    rendezvous port through it and the other ranks wait through it, and its first connection
    (with TLS, 70-200 ms on 2 cores) would otherwise delay the first gang on each worker."""
    try:
        worker._get_client()  # what distributed.get_client() returns in a task, made now
    except Exception as error:  # a closing worker; the first rank makes it then
        logger.debug("no early client on %s: %s", worker.address, error)


def end_all() -> int:
    """End this worker's spare and warm rank processes; how many there were (after a
    :func:`release` still under way: the spare it starts too)."""
    for thread in list(_releasing):
        thread.join(timeout=30)
    with _lock:
        processes = [*_spares, *(p for pool in _warm.values() for p in pool)]
        _spares.clear()
        _warm.clear()
    for process in processes:
        process.close()
    return len(processes)
