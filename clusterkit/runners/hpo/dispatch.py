"""Slots, resources and attempts: what the driver's dispatch loop counts on."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput, ClusterkitError

if TYPE_CHECKING:
    from distributed import Client, Future

logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    """A trial in flight: its current Dask future and how often it started."""

    number: int
    trial_id: int
    future: Future
    starts: int = 0
    submits: int = 1
    requeues: int = 0  # Dask dropped the task (lost inputs): submitted again, not a new attempt
    workers: list[str] = field(default_factory=list)


def slots(client: Client, resources: Mapping[str, float] | None) -> int:
    """Trials that can run at once: worker threads, or units of the requested resources."""
    return count_slots(client.scheduler_info(n_workers=-1)["workers"].values(), resources)


def count_slots(workers: Any, resources: Mapping[str, float] | None) -> int:
    if not resources:
        return sum(int(w.get("nthreads", 1)) for w in workers)
    total = 0
    for w in workers:
        have = w.get("resources") or {}
        total += min(int(have.get(name, 0) // amount) for name, amount in resources.items())
    return total


def check_resources(client: Client, resources: Mapping[str, float] | None) -> None:
    if not resources:
        return
    for name, amount in resources.items():
        if amount <= 0:
            raise BadInput(f"resources[{name!r}] must be positive, got {amount}")
    if slots(client, resources) == 0:
        info = client.scheduler_info(n_workers=-1)["workers"].values()
        seen = sorted({k for w in info for k in (w.get("resources") or {})})
        want = ", ".join(f"{k}={v:g}" for k, v in resources.items())
        raise BadInput(
            f"no worker advertises the resources a trial asks for ({want}); "
            f"the workers offer {', '.join(seen) or 'no resources'}",
            hint="use a profile with worker.gpus set, or drop --gpus-per-trial",
        )


def check_cluster(client: Client, done: int, n_trials: int) -> None:
    """A client whose scheduler is gone closes itself (after its timeout): stop, resumably."""
    if client.status in ("closing", "closed"):
        raise ClusterkitError(
            f"lost the cluster mid-search ({done} of {n_trials} trials finished); "
            "every reported result is in the study",
            hint="bring the cluster back and run the same search (same storage and study "
            "name) to resume",
        )


def is_lost_worker(error: BaseException) -> bool:
    from distributed.comm.core import CommClosedError
    from distributed.scheduler import KilledWorker

    return isinstance(error, KilledWorker | CommClosedError | OSError) or (
        type(error).__name__ in {"CancelledError", "FutureCancelledError"}
    )


def lost_rank(futures: list[Any], slots: list[Any], live: set[str], aborted_at: float) -> Any:
    """The failure of a gang's rank that the cluster ended, not the objective: its worker left
    (its task lost or cancelled with it), or its process was killed by a signal before the
    driver aborted the gang (``aborted_at``: out of memory, a walltime's kill). A
    ``GroupFailed`` marked ``lost``; None when every failure is the objective's own."""
    from clusterkit.runners.ddp.group import GroupFailed
    from clusterkit.runners.ddp.worker import RankError

    for rank, (future, slot) in enumerate(zip(futures, slots, strict=True)):
        why = None
        if slot.worker not in live:
            why = f"worker {slot.worker} left the cluster"
        elif future.status in ("cancelled", "lost"):
            why = f"its task was {future.status} with its worker"
        elif future.status == "error":
            error = future.exception()
            if isinstance(error, RankError):
                killed = error.kind == "ProcessExit" and "killed by signal" in error.message
                why = error.message if killed and error.time < aborted_at else None
            elif is_lost_worker(error):
                why = f"its worker was lost ({type(error).__name__}: {error})"
        if why is not None:
            failure = GroupFailed(rank, why)
            failure.lost = True  # type: ignore[attr-defined]
            return failure
    return None


def log_stall(client: Client, keys: list[Any], quiet: float) -> None:
    """Log, for a search that heard nothing for ``quiet`` seconds, what the scheduler says of
    its tasks ``keys`` (a stall is then diagnosable)."""

    def task_states(dask_scheduler: Any, keys: list[Any]) -> dict[str, str]:
        tasks = dask_scheduler.tasks
        return {key: tasks[key].state if key in tasks else "unknown" for key in keys}

    try:
        states = client.run_on_scheduler(task_states, keys=keys)
    except Exception as error:  # diagnosis only: never stop the search for it
        states = {"scheduler": f"unreachable ({error!r})"}
    logger.warning(
        "no trial finished or reported for %.0fs; %d in flight; their tasks on the scheduler: %s",
        quiet,
        len(keys),
        ", ".join(f"{key}: {state}" for key, state in states.items()),
    )
