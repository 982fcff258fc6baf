"""One attempt's rank group, watched from the driver: wait for every rank, find the first
real failure (a lost worker, else the earliest error: a peer's comes later), stop them all."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from clusterkit.runners.ddp.placement import Slot, live_workers

if TYPE_CHECKING:
    from distributed import Client, Future

log = logging.getLogger(__name__)


class GroupFailed(Exception):
    """A rank (or None: the group) failed; its message and traceback."""

    def __init__(self, rank: int | None, message: str, tb: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.message = message
        self.traceback = tb


def watch(
    client: Client, futures: list[Future], slots: list[Slot], deadline: float | None
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
                    raise GroupFailed(rank, f"worker {slot.worker} left the cluster")
        time.sleep(0.02)


def first_failure(futures: list[Future], slots: list[Slot], alive: set[str]) -> GroupFailed:
    """The cause: a lost worker, else the earliest real error (a peer's comes later); the
    search runner's gangs use it too."""
    from clusterkit.runners.ddp.worker import RankError

    for rank, slot in enumerate(slots):
        if slot.worker not in alive:
            return GroupFailed(rank, f"worker {slot.worker} left the cluster")
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


def stop(client: Client, key: str, futures: list[Future], slots: list[Slot]) -> set[str]:
    """Kill every rank process of this attempt, let the tasks settle (bounded); alive workers."""
    from distributed import wait

    from clusterkit.runners.ddp.worker import abort

    alive = set(live_workers(client))
    targets = sorted({s.worker for s in slots} & alive)
    if targets:
        try:
            client.run(abort, key, workers=targets, on_error="ignore")
        except Exception as error:  # a worker dying right now must not mask the real failure
            log.warning("abort of %s failed: %s", key, error)
    running = [f for f, s in zip(futures, slots, strict=True) if s.worker in alive]
    try:
        with client.as_current():  # wait() asks for the default client; ours may not be it
            wait(running, timeout=15)
    except TimeoutError:
        log.warning("ranks of %s still running 15s after abort", key)
    return alive


def submit_ranks(
    client: Client, specs: list[dict], slots: list[Slot], interfaces: dict[str, dict]
) -> list[Future]:
    """One pinned task per rank (``rank_task`` on its slot's worker, a GPU resource for a GPU
    slot), with the worker's interface environment."""
    from clusterkit.runners.ddp.worker import rank_task

    futures = []
    for spec, slot in zip(specs, slots, strict=True):
        spec["default_env"] = interfaces.get(slot.worker, {})
        futures.append(
            client.submit(
                rank_task,
                spec,
                key=f"{spec['key']}-rank{spec['rank']}",
                workers=[slot.worker],
                allow_other_workers=False,
                pure=False,
                resources={"GPU": 1} if slot.gpu else None,
            )
        )
    return futures
