"""Slots, resources and attempts: what the driver's dispatch loop counts on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput, ClusterkitError
from clusterkit.runners.hpo import walltime
from clusterkit.runners.hpo.preemption import TrialInterrupted, lead, worker_times

if TYPE_CHECKING:
    import optuna
    from distributed import Client, Future

logger = logging.getLogger(__name__)

#: Seconds a placed trial may take to start (the hand-off, the worker's imports): walltime
#: placement counts a worker's time left from then.
START_DELAY = 2.0


@dataclass
class Attempt:
    """A trial in flight: its current Dask future and how often it started."""

    number: int
    trial_id: int
    future: Future
    starts: int = 0
    submits: int = 1
    requeues: int = 0  # Dask dropped the task (lost inputs): submitted again, not a new attempt
    resumes: int = 0  # attempts that ended having saved a checkpoint (TrialInterrupted)
    workers: list[str] = field(default_factory=list)

    @property
    def attempts(self) -> int:
        """Attempts started or submitted so far, this one included."""
        return max(self.starts, self.submits)


@dataclass(frozen=True)
class Retries:
    """How often a trial runs again: ``lost``, attempts whose worker died with nothing saved
    (``max_retries``: each redoes the trial from its start); ``resumes``, attempts that saved a
    checkpoint as their worker ended (``max_resumes``: each goes on from there, so a trial
    longer than one job's walltime spans as many jobs as it needs, as submitit keeps timeouts
    apart from failures)."""

    lost: int = 2
    resumes: int = 10

    def exceeded(self, attempt: Attempt, ended: int) -> str | None:
        """Why ``attempt`` runs no more (None: it may run again), ``ended``: its attempts that
        ended so far, this one included."""
        if attempt.resumes > self.resumes:
            return f"it resumed from its checkpoint as often as max_resumes={self.resumes} allows"
        if ended - attempt.resumes > self.lost:
            return "its worker was lost with nothing saved"
        return None


class Watchdog:
    """Quiet for ``after`` seconds (or 3x the longest trial) while trials are in flight:
    ``log(quiet)`` once, till something is heard again."""

    def __init__(self, log: Callable[[float], None]) -> None:
        import time

        self.log, self.heard_at, self.logged, self.longest = log, time.monotonic(), False, 0.0

    def heard(self) -> None:
        import time

        self.heard_at, self.logged = time.monotonic(), False

    def took(self, seconds: float) -> None:
        """A trial took ``seconds``: a quiet spell shorter than 3x that is no stall."""
        self.longest = max(self.longest, seconds)

    def check(self, after: float) -> None:
        import time

        quiet = time.monotonic() - self.heard_at
        if quiet >= max(after, 3 * self.longest) and not self.logged:
            self.logged = True
            self.log(quiet)


def ask(study: optuna.Study, storage: Any, study_id: int, enqueued: bool) -> optuna.Trial:
    """``study.ask()`` while ``enqueued`` trials are left; else a new trial, without ask()'s scan
    of every trial for enqueued ones (the runner enqueues only before the loop): it made trials
    cost more in larger studies."""
    if enqueued:
        return study.ask()
    import optuna

    return optuna.Trial(study, storage.create_new_trial(study_id))


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


def is_open(client: Any) -> bool:
    """The client still talks to its cluster (not closed with it: a ``down`` or a lost
    scheduler closes it, and what the search would undo there is gone with it)."""
    return getattr(client, "status", "running") not in ("closing", "closed")


def unsubscribe(client: Any, topic: str) -> None:
    if is_open(client):
        client.unsubscribe_topic(topic)


def cancel(client: Any, futures: list[Any], force: bool = False) -> None:
    if futures and is_open(client):
        client.cancel(futures, force=force)


def is_lost_worker(error: BaseException) -> bool:
    """The cluster ended the trial's task (its worker died or is ending): run it again."""
    from distributed.comm.core import CommClosedError
    from distributed.scheduler import KilledWorker

    return isinstance(error, KilledWorker | CommClosedError | OSError | TrialInterrupted) or (
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


class WalltimeGuard:
    """Walltime-aware placement in the loop (:mod:`.walltime` decides): the workers' ends, the
    trials' likely duration, and the retirement of workers with too little left."""

    def __init__(self, client: Client, study: Any, hint: float | None) -> None:
        if hint is not None and not hint > 0:
            raise BadInput(f"trial_walltime must be positive seconds, got {hint}")
        self.client = client
        self.durations = walltime.completed_durations(study.get_trials(deepcopy=False))
        self.hint = hint
        self.need = walltime.likely_duration(self.durations, hint)
        self.ends: dict[str, float | None] = {}
        self.live: set[str] | None = None  # the scheduler's workers, as last seen (the loop's)
        self.retiring: set[str] = set()
        self.lead = lead()  # the user's lead (None: each worker's), :mod:`.preemption`
        self.ending_from: dict[str, float] = {}  # when each worker with an end counts as ending
        self.asking: set[str] = set()  # workers asked for their ends, no answer yet

    @property
    def bounded(self) -> bool:
        """Placement is on: a trial's likely duration is known and some worker has an end."""
        return self.need is not None and any(end is not None for end in self.ends.values())

    def finished(self, record: dict[str, Any], before: float = 0.0) -> None:
        """A trial's record: a completed one's duration counts (pruned ones end early), with
        the ``before`` seconds its attempts ran till they saved a checkpoint (a resumed
        trial's last attempt alone would make trials look shorter than they are)."""
        if record["state"] == "COMPLETE":
            self.durations.append(record["end"] - record["start"] + before)
            self.need = walltime.likely_duration(self.durations, self.hint)

    def refresh(self) -> None:
        """Ask workers new since the last time for their ends: before the loop has seen the
        workers (its first trials), at once; later in the background, since a worker that just
        left would hold the loop for a connect timeout."""
        live = self.live
        if live is None:
            live = set(self.client.scheduler_info(n_workers=-1)["workers"])
            self._ask_ends([w for w in live if w not in self.ends])
            return
        for gone in set(self.ends) - live:
            del self.ends[gone]
            self.ending_from.pop(gone, None)
        new = [w for w in live if w not in self.ends and w not in self.asking]
        if new:
            self.asking.update(new)
            threading.Thread(target=self._ask_ends, args=(new,), daemon=True).start()

    def _ask_ends(self, workers: list[str]) -> None:
        try:
            times = self.client.run(
                worker_times, lead=self.lead, workers=workers, on_error="return"
            )
        except Exception as error:  # the cluster is going: the loop hears of it by itself
            logger.debug("could not ask %s for their ends: %s", workers, error)
            times = {}
        for worker, answer in times.items():
            if isinstance(answer, Exception):
                continue
            self.ends[worker] = None if answer is None else answer[0]
            if answer is not None:
                self.ending_from[worker] = answer[1]
        self.asking.difference_update(workers)
        if any(end is not None for end in self.ends.values()):  # trials were placed: new workers
            self._free_stranded()

    def _free_stranded(self) -> None:
        try:
            freed = self.client.run_on_scheduler(free_stranded)
        except Exception as error:  # the cluster is going: the loop hears of it by itself
            logger.debug("could not free stranded trials: %s", error)
            return
        if freed:
            logger.info("%s waited for workers that left: any worker takes them", ", ".join(freed))

    def restrictions(self, inflight: Any) -> dict[str, Any]:
        """``client.submit``'s keywords placing the next trial (none: anywhere), given the
        :class:`Attempt` s in flight; retires the idle workers with too little left for any.
        A worker within its checkpoint lead (:mod:`.preemption`) takes no new trial. Loose: if
        the listed workers are gone, another (a fresh job) takes the trial."""
        if all(end is None for end in self.ends.values()):
            return {}
        import time

        start = time.time() + START_DELAY
        left = walltime.seconds_left(
            {w: e for w, e in self.ends.items() if w not in self.retiring}, start
        )
        ending = {w for w, at in self.ending_from.items() if at <= start and w in left}
        busy = {attempt.workers[-1] for attempt in inflight if attempt.workers}
        placement = walltime.place(left, busy, self.need)
        if placement.retire:
            self.retire(placement.retire, self.need)
        if placement.workers is None and not ending:
            return {}
        allowed = [w for w in (placement.workers or left) if w not in ending]
        if not allowed:  # every worker is ending: the fresh jobs that replace them take it
            return {}
        return {"workers": sorted(allowed), "allow_other_workers": True}

    def retire(self, workers: tuple[str, ...], need: float | None) -> None:
        """Retire ``workers``: less than ``need`` (a trial's likely seconds) left on each."""
        self.retiring.update(workers)
        logger.info(
            "retiring %s: too little walltime left for a trial (likely %.0fs)",
            ", ".join(workers),
            need or 0.0,
        )
        loop: Any = self.client.loop
        loop.add_callback(self._retire_now, list(workers))

    async def _retire_now(self, workers: list[str]) -> None:
        scheduler: Any = self.client.scheduler
        try:
            await scheduler.retire_workers(workers=workers, close_workers=True)
        except OSError as error:  # the scheduler is briefly unreachable: the lifetime ends it
            logger.debug("could not retire %s: %s", workers, error)


def free_stranded(dask_scheduler: Any) -> list[str]:
    """Run on the scheduler: tasks waiting for a worker (``no-worker``) whose loose worker
    restrictions (``allow_other_workers``) name only workers that left lose them and go to a
    running worker; their keys. Dask hands such a task only to a joining worker its
    restrictions name: a trial placed on workers whose jobs all ended before a fresh one
    started would wait forever."""
    import time

    freed = [
        ts
        for ts in list(dask_scheduler.unrunnable)
        if ts.loose_restrictions
        and ts.worker_restrictions
        and not any(address in dask_scheduler.workers for address in ts.worker_restrictions)
    ]
    for ts in freed:
        ts.worker_restrictions = None
        ts.loose_restrictions = False
    if freed:
        stimulus = f"clusterkit-free-stranded-{time.time()}"
        dask_scheduler.transitions({ts.key: "processing" for ts in freed}, stimulus_id=stimulus)
    return [str(ts.key) for ts in freed]
