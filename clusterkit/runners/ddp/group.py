"""One attempt's rank group, watched from the driver: wait for every rank, find the first
real failure (a lost worker, else the earliest error: a peer's comes later), stop them all.

A worker cut off from the scheduler is dropped when the scheduler's connection to it times out
(``distributed.comm.timeouts.tcp``, 30 s), which ends the group; the ranks still blocked in a
collective with it are killed then, not at the process group's timeout (30 min for gloo).
Stopping is bounded too: a worker that does not take the abort within :data:`ABORT_WAIT`
seconds is counted unreachable (its node is likely cut off as well) and not waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from clusterkit.runners.ddp.placement import Slot, live_workers

if TYPE_CHECKING:
    from distributed import Client, Future

log = logging.getLogger(__name__)

#: Seconds a worker has to take an abort before it counts as unreachable
ABORT_WAIT = 10.0
#: Seconds without a heartbeat after which a worker is not even asked (it cannot answer)
SILENT = 10.0


class GroupFailed(Exception):
    """A rank (or None: the group) failed; its message and traceback."""

    def __init__(self, rank: int | None, message: str, tb: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.message = message
        self.traceback = tb
        self.unreachable: frozenset[str] = frozenset()  # workers that did not take the abort


def lost(worker: str, nodes: dict[str, str | None] | None = None, why: str = "left") -> str:
    """'worker ADDRESS on node NAME left the cluster' (the node's host name when known)."""
    node = (nodes or {}).get(worker)
    where = f" on node {node}" if node else ""
    text = "left the cluster" if why == "left" else "stopped answering"
    return f"worker {worker}{where} {text}"


def watch(
    client: Client,
    futures: list[Future],
    slots: list[Slot],
    deadline: float | None,
    nodes: dict[str, str | None] | None = None,
) -> list[bytes]:
    """Wait for every rank; raise GroupFailed at the first failure or lost worker."""
    last_check = time.monotonic()
    while True:
        statuses = [f.status for f in futures]
        if all(s == "finished" for s in statuses):
            return client.gather(futures)
        for rank, status in enumerate(statuses):
            if status in ("error", "cancelled", "lost"):
                raise GroupFailed(rank, f"task {status}")
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise GroupFailed(None, "timed out")
        if now - last_check > 1.0:
            last_check = now
            alive = set(live_workers(client))
            for rank, slot in enumerate(slots):
                if slot.worker not in alive and futures[rank].status != "finished":
                    raise GroupFailed(rank, lost(slot.worker, nodes))
        time.sleep(0.02)


def first_failure(
    futures: list[Future],
    slots: list[Slot],
    alive: set[str],
    nodes: dict[str, str | None] | None = None,
    unreachable: frozenset[str] = frozenset(),
) -> GroupFailed:
    """The cause: a lost (else an unreachable) worker, else the earliest real error (a peer's
    comes later); the search runner's gangs use it too."""
    from clusterkit.runners.ddp.worker import RankError

    for rank, slot in enumerate(slots):
        if slot.worker not in alive:
            return GroupFailed(rank, lost(slot.worker, nodes))
    for rank, slot in enumerate(slots):
        if slot.worker in unreachable:
            return GroupFailed(rank, lost(slot.worker, nodes, why="silent"))
    errors = []
    for index, future in enumerate(futures):
        if future.status != "error":
            continue
        error = future.exception()
        if isinstance(error, RankError):
            if error.kind != "Aborted":
                text = f"{error.kind}: {error.message}"
                errors.append((error.time, error.rank, text, error.traceback))
        else:
            errors.append((float("inf"), index, f"{type(error).__name__}: {error}", ""))
    if not errors:
        return GroupFailed(None, "a rank task ended without a result")
    _, first, message, tb = min(errors, key=lambda e: (e[0], e[1]))
    return GroupFailed(first, message, tb)


def abort_all(client: Client, key: str, workers: list[str]) -> set[str]:
    """Ask each worker to kill its rank processes of ``key``, all at once, for at most
    :data:`ABORT_WAIT` seconds; the workers that did. One call per worker, in daemon threads,
    so a worker that cannot be reached holds up neither the others nor this process's exit."""
    from clusterkit.runners.ddp.worker import abort

    answered: set[str] = set()

    def ask(worker: str) -> None:
        try:
            client.run(abort, key, workers=[worker])
        except Exception as error:  # a worker dying right now must not mask the real failure
            log.debug("abort of %s on %s failed: %s", key, worker, error)
        else:
            answered.add(worker)

    threads = [threading.Thread(target=ask, args=(w,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    until = time.monotonic() + ABORT_WAIT
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))
    return set(answered)


def silent_workers(workers: dict[str, Any]) -> set[str]:
    """Workers in scheduler info with no heartbeat for :data:`SILENT` seconds, measured on
    the scheduler's clock (against its latest heartbeat), not this machine's."""
    seen = {w: float(info.get("last_seen", 0.0)) for w, info in workers.items()}
    latest = max(seen.values(), default=0.0)
    return {w for w, when in seen.items() if when and latest - when > SILENT}


def settle(client: Client, unreachable: frozenset[str], timeout: float = 60.0) -> None:
    """Wait (bounded) until the scheduler drops each worker that could not answer, or hears
    from it again: a restart's broadcasts (the project, plugins) reach every worker the
    scheduler lists, and one cut off holds each up for the connect timeout (30 s)."""
    deadline = time.monotonic() + timeout
    pending = unreachable
    while pending and time.monotonic() < deadline:
        workers = live_workers(client)
        pending = frozenset(pending & set(workers) & silent_workers(workers))
        if pending:
            time.sleep(0.5)


def stop(
    client: Client, key: str, futures: list[Future], slots: list[Slot]
) -> tuple[set[str], frozenset[str]]:
    """Kill every rank process of this attempt, let the tasks settle (bounded). Returns the
    workers alive and those that could not answer (no heartbeat for :data:`SILENT` seconds,
    or no answer to the abort within :data:`ABORT_WAIT`)."""
    from distributed import wait

    workers = live_workers(client)
    alive, silent = set(workers), silent_workers(workers)
    targets = sorted({s.worker for s in slots} & (alive - silent))
    answered = abort_all(client, key, targets)
    unreachable = frozenset(silent | (set(targets) - answered))
    running = [f for f, s in zip(futures, slots, strict=True) if s.worker in answered]
    try:
        with client.as_current():  # wait() asks for the default client; ours may not be it
            wait(running, timeout=15)
    except TimeoutError:
        log.warning("ranks of %s still running 15s after abort", key)
    return alive, unreachable


def submit_ranks(
    client: Client, specs: list[dict], slots: list[Slot], interfaces: dict[str, dict]
) -> list[Future]:
    """One pinned task per rank (``rank_task`` on its slot's worker, a GPU resource for a GPU
    slot), with the worker's interface environment; all in one graph, so the scheduler gets them
    in one message (a ``submit`` each: the client sends the first at once and holds the others
    for its 10 ms batching interval, and the other ranks start that much after rank 0)."""
    from dask.delayed import Delayed
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
    from dask.task_spec import DataNode, Task

    from clusterkit.runners.ddp.worker import rank_task

    tasks, workers, resources = {}, {}, {}
    for spec, slot in zip(specs, slots, strict=True):
        spec["default_env"] = interfaces.get(slot.worker, {})
        key = f"{spec['key']}-rank{spec['rank']}"
        tasks[key] = Task(key, rank_task, DataNode(None, spec))
        workers[key], resources[key] = [slot.worker], {"GPU": 1} if slot.gpu else {}
    restrictions = {  # per task (a callable of its key), as client.submit's arguments
        "workers": workers.__getitem__,
        "allow_other_workers": False,
        "resources": resources.__getitem__,
    }
    name = specs[0]["key"]
    layer = MaterializedLayer(tasks, annotations=restrictions)
    graph = HighLevelGraph({name: layer}, {name: set()})
    ranks = [Delayed(key, graph, layer=name) for key in tasks]
    return list(client.compute(ranks, optimize_graph=False))
