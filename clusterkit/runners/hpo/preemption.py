"""Trials that outlive their worker, the worker's side: the notice that it is about to end and
the trial's checkpoint folder.

A worker ends at its lifetime (a batch job's walltime less the profile's margin, which
dask-jobqueue sets), or when it is retired (a lifetime's end, walltime placement, ``adapt``).
An objective that asks :func:`should_checkpoint` between steps saves its state in
:func:`checkpoint_dir` and raises :class:`TrialInterrupted`; the runner submits the same trial
(same number, same parameters) again on a worker with time left, where the objective finds
its checkpoint and resumes. Each resume counts as one of the search's ``max_resumes``, apart
from ``max_retries`` (attempts lost with nothing saved): a trial longer than a job's walltime
spans as many jobs as it needs. An objective that never asks is retried from its start once its
worker is gone, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds before a worker's end from which :func:`should_checkpoint` is True: at most LEAD,
#: at most SHARE of the worker's lifetime; Dask's config ``clusterkit.checkpoint-lead``
#: (``DASK_CLUSTERKIT__CHECKPOINT_LEAD``) sets it for every worker.
LEAD = 60.0
SHARE = 0.1


def lead() -> float | None:
    """The lead the user set in Dask's config, in seconds; None: each worker's default."""
    import dask
    from dask.utils import parse_timedelta

    value = dask.config.get("clusterkit.checkpoint-lead", None)
    return None if value is None else float(parse_timedelta(value))


def worker_lead(dask_worker: Any, lead: float | None) -> float:
    """Seconds before ``dask_worker``'s end from which its trials checkpoint and it takes none."""
    if lead is not None:
        return lead
    return min(LEAD, SHARE * float(getattr(dask_worker, "lifetime", None) or 0.0))


class TrialInterrupted(Exception):
    """Raised by an objective once it saved its checkpoint because its worker is ending: the
    trial runs again, on another worker, and resumes from the checkpoint."""

    def __init__(self, message: str = "saved a checkpoint: its worker is ending") -> None:
        super().__init__(message)


@dataclass(frozen=True)
class TrialContext:
    """What a running trial's helpers need: its number, where its checkpoints go, how long
    before the worker's end to ask for one; a gang's rank: ``ask``, the driver's answer."""

    number: int
    checkpoint_dir: str | None
    lead: float | None
    ask: Callable[[], bool] | None = None


_local = threading.local()  # the trial running on this thread (a worker runs several)


@dataclass(frozen=True)
class Resumable:
    """The objective, called in its trial's context (what :func:`should_checkpoint` and
    :func:`checkpoint_dir` read); other attributes are the objective's."""

    objective: Callable[[Any], Any]
    checkpoint_dir: str | None
    lead: float | None

    def __call__(self, trial: Any) -> Any:
        from clusterkit.runners.hpo.retried import series_number

        number = series_number(trial.number, trial.user_attrs)  # where earlier runs saved
        with trial_context(number, self.checkpoint_dir, self.lead):
            return self.objective(trial)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("objective", "checkpoint_dir", "lead"):
            raise AttributeError(name)  # not while unpickling, before the fields are set
        return getattr(self.objective, name)


@contextmanager
def trial_context(
    number: int,
    checkpoint_dir: str | None,
    lead: float | None,
    ask: Callable[[], bool] | None = None,
) -> Iterator[None]:
    """Around the objective's call on a worker thread (or in a gang's rank process: ``ask``)."""
    _local.context = TrialContext(number, checkpoint_dir, lead, ask)
    try:
        yield
    finally:
        _local.context = None


def _context() -> TrialContext | None:
    return getattr(_local, "context", None)


def worker_end(dask_worker: Any) -> float | None:
    """The worker's end, a ``time.time()`` stamp, from its ``lifetime`` (dask-jobqueue sets it
    from the job's walltime less the profile's margin; Kubernetes and local workers have none:
    None). Read off the lifetime's timer, else the process's start."""
    from clusterkit.runners.graceful import end_after_sigterm

    signalled = end_after_sigterm(dask_worker)  # its batch system ends it: SIGTERM
    lifetime = getattr(dask_worker, "lifetime", None)
    if not lifetime or signalled is not None:
        return signalled
    loop = dask_worker.io_loop.asyncio_loop
    for handle in list(getattr(loop, "_scheduled", ())):  # asyncio's timers (not uvloop's)
        call = handle._args[0] if handle._args else None
        if getattr(call, "func", None) == dask_worker.close_gracefully:
            return time.time() + handle.when() - loop.time()
    import psutil

    return float(psutil.Process().create_time() + lifetime)


def worker_times(dask_worker: Any, lead: float | None) -> tuple[float, float] | None:
    """Run on a worker (``client.run``): its end and the time from which it counts as ending
    (``time.time()`` stamps), or None: it has no end."""
    end = worker_end(dask_worker)
    return None if end is None else (end, end - worker_lead(dask_worker, lead))


def ending_reason(dask_worker: Any, lead: float | None) -> str | None:
    """Why ``dask_worker`` is about to end (None: it is not): its retirement, SIGTERM
    (:mod:`clusterkit.runners.graceful`), or its lifetime's end within its lead
    (:func:`worker_lead`)."""
    status = getattr(getattr(dask_worker, "status", None), "name", "")
    if status in ("closing_gracefully", "closing", "closed", "failed"):
        return f"it is {status.replace('_', ' ')}"
    from clusterkit.runners.graceful import end_after_sigterm

    if end_after_sigterm(dask_worker) is not None:
        return "it got SIGTERM: its batch system ends it"
    end = worker_end(dask_worker)
    if end is not None and end - time.time() <= worker_lead(dask_worker, lead):
        return f"its lifetime ends in {max(end - time.time(), 0.0):.0f}s"
    return None


def hold_if_ending(dask_worker: Any, lead: float | None) -> bool:
    """Before a trial starts: if ``dask_worker`` is already ending, start nothing and wait for
    it to close (the scheduler then runs the task on another worker, no attempt lost); True
    if it was ending. A trial placed there anyway (every worker ending) waits for a fresh one
    instead of being interrupted at once, again and again."""
    if ending_reason(dask_worker, lead) is None:
        return False
    while getattr(getattr(dask_worker, "status", None), "name", "closed") in ("running", "paused"):
        time.sleep(0.1)
    return True


def should_checkpoint() -> bool:
    """True when the worker running this trial is about to end: save a checkpoint in
    :func:`checkpoint_dir` and raise :class:`TrialInterrupted` to resume on another worker.
    False outside a trial's task (the objective run elsewhere, e.g. in a test of its own).
    In a gang's rank it asks the driver, which gives every rank the same answer at the same
    call (:mod:`.gang_preemption`): every rank calls it at the same points."""
    context = _context()
    if context is None:
        return False
    if context.ask is not None:
        return context.ask()
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        return False
    return ending_reason(worker, context.lead) is not None


def checkpoint_dir(trial: Any = None) -> Any:
    """This trial's checkpoint folder, ``DIR/trial-N`` under the search's ``checkpoint_dir``:
    a ``Path``, made if missing, or for a URL (``s3://...``) the URL string, for fsspec. Every
    attempt of trial N finds there what an earlier one saved. ``trial``: the Optuna trial (its
    number), else the one running on this thread."""
    context = _context()  # its number: the trial's, or the first of its retries' (.retried)
    number = context.number if context is not None else getattr(trial, "number", None)
    if number is None:
        raise RuntimeError("checkpoint_dir() outside a trial: pass the trial")
    if context is None or context.checkpoint_dir is None:
        raise RuntimeError(
            "no checkpoint_dir for this search: pass checkpoint_dir= to hpo.run "
            "(--checkpoint-dir), a folder every worker can reach"
        )
    if "://" in context.checkpoint_dir:
        return f"{context.checkpoint_dir.rstrip('/')}/trial-{number}"
    folder = Path(context.checkpoint_dir) / f"trial-{number}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
