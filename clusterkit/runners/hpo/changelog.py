"""The driver's side of the workers' study mirrors (see :mod:`.mirror`): a log of trial
snapshots, what each live worker acknowledged, and the base snapshot late workers load."""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client, Future
    from optuna.trial import FrozenTrial


logger = logging.getLogger(__name__)

#: Tries to scatter the base while workers come and go.
SCATTER_TRIES = 5
SCATTER_TIMEOUT = 30.0
#: A base up to this size travels inside the tasks. A scattered one is a dependency, and Dask
#: places a task on the workers that hold its dependencies: every task sent while some worker had
#: no mirror queued behind the one busy holder until work stealing moved it (up to 0.9 s idle
#: per worker at the start of a search).
INLINE_BASE = 64 * 1024


class ChangeLog:
    """Trial snapshots (pickled) in the order the driver saw them change; a mirror's version
    is a length.

    A task carries the entries from ``since`` (the oldest version a live worker acknowledged, and
    never more than ``window`` entries back) to the head: about as many entries as trials that
    changed while the slowest worker's last task was on its way. While a live worker has not
    acknowledged anything (it joined late, restarted, or the search just began) tasks also carry
    the base, the log up to a recent version: inside the task while it is small, else scattered
    once and fetched by each worker from its peers (Dask's dependency transfer).
    """

    def __init__(self, client: Client, trials: list[FrozenTrial], slots: int) -> None:
        self.client = client
        #: each snapshot pickled once, when it is logged: a task carries the bytes, and a
        #: mirror unpickles only the entries it lacks (the cost per trial stays flat however
        #: many trials are in flight, where re-pickling every carried entry grew with them)
        self.entries: list[bytes] = [pickle.dumps(trial) for trial in trials]
        self.acks: dict[str, int] = {}
        self.live: set[str] = set()
        self.window = 64
        self.resize(slots)
        self._base: Future | tuple[int, bytes] | None = None
        self._base_version = -1
        self._held: list[Future] = []

    def resize(self, slots: int) -> None:
        # Not 2 x slots, the worst case: acknowledgements lag by the task's round trip, which
        # grows with the load, while a busy worker's mirror is only the entries of a few ms
        # behind. A window from the acknowledgements made every task carry more as more slots
        # made the round trip slower (1,300 entries, 0.5 MB, a task at 1,024 slots); a mirror
        # further behind than this says it is stale and gets the base instead.
        self.window = 64 + slots // 16

    def add(self, trial: FrozenTrial) -> None:
        self.entries.append(pickle.dumps(trial))

    def ack(self, worker: str, version: int) -> None:
        self.acks[worker] = version

    def forget(self, worker: str) -> None:
        """A worker's mirror was too old or is gone: send it the base until it acknowledges."""
        self.acks.pop(worker, None)

    def set_live(self, workers: set[str]) -> None:
        self.live = workers
        for gone in set(self.acks) - workers:
            del self.acks[gone]

    def _needs_base(self) -> bool:
        return not self.acks or not self.live <= self.acks.keys()

    def _base_for(self, head: int) -> tuple[Future | tuple[int, bytes], int]:
        if self._base is None or head - self._base_version > self.window // 2:
            version = head
            base = (version, pickle.dumps(self.entries[:version]))
            if len(base[1]) <= INLINE_BASE:
                self._base = base
            else:
                self._base = self._scatter(base)
                # Held to the end: a task submitted with an older base may reach the scheduler
                # after the client would otherwise have released it (it then waits forever).
                self._held.append(self._base)
            self._base_version = version
        return self._base, self._base_version

    def _scatter(self, base: tuple[int, bytes]) -> Future:
        """Put the base on one worker; the others fetch it with their first task that needs it
        (Dask's own dependency transfer). Not broadcast: the scheduler's replicate retries a
        worker that died meanwhile forever. A worker dying mid-call can still fail it or leave
        it waiting on a connection that never answers: bounded, and tried again."""
        import asyncio

        for attempt in range(SCATTER_TRIES):
            pending = self.client.scatter(base, hash=False, asynchronous=True)
            try:
                return self.client.sync(asyncio.wait_for, pending, SCATTER_TIMEOUT)
            except Exception as error:  # CommClosedError, a timeout, KeyError of a gone worker
                if attempt == SCATTER_TRIES - 1:
                    raise
                logger.info("scattering the study's base failed (%r); again", error)
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def drop_base(self) -> None:
        """The base was lost (every worker holding it died): the next task scatters a new one."""
        self._base, self._base_version = None, -1

    def delta(self, with_base: bool = False) -> tuple[bytes, Future | tuple[int, bytes] | None]:
        """The pickled ``(since, entries)`` a task carries, and the base (inline or a future)
        or None."""
        head = len(self.entries)
        since = max(min(self.acks.values(), default=head), head - self.window)
        base: Any = None
        if with_base or self._needs_base():
            base, version = self._base_for(head)
            since = min(since, version)
        return pickle.dumps((since, self.entries[since:head])), base

    def close(self, topic: str) -> None:
        """Drop the workers' mirrors of this search and the base."""
        from clusterkit.runners.hpo.mirror import drop_mirror

        self._base, self._held = None, []
        with contextlib.suppress(Exception):  # a gone cluster has no mirrors left to drop
            self.client.run(drop_mirror, topic)
