"""Gang trials that outlive their worker, the driver's side (:mod:`.preemption` has the one-rank
trial's and the names an objective uses).

A running gang is told to end when a worker of it is about to: within its lead of its
lifetime's end (the earliest end among the gang's workers counts) or retiring. Then

- ``hpo.should_checkpoint()`` is True on every rank at the same call: rank 0's question decides
  and every other rank gets its answer for the same call (:func:`agree`, as pruning does), so a
  collective save works; the ranks save in ``hpo.checkpoint_dir(trial)`` (or with
  ``rank_context().save_checkpoint``) and raise ``hpo.TrialInterrupted``;
- each rank process gets SIGTERM, as torchrun's agent and SLURM (``--signal``, then the
  walltime) send before a kill, and SIGKILL once the grace is over: at the worker's end, or
  GRACE seconds after the notice where that end is not known (a retirement). A rank that does
  not trap SIGTERM is not ended by it (it keeps asking ``should_checkpoint``).

A launch that then ended (``TrialInterrupted``, an exit, the signal, the kill) is interrupted,
not failed: the loop runs the trial again (same number and parameters) on workers with time
left, where it resumes from its checkpoint; each resume counts as one of ``max_resumes``.
Placement: a gang starts only on slots of workers that are not ending and, once its likely
duration is known (finished gangs of its size; before, ``trial_walltime``), have that much
time left, so the earliest end among its slots leaves it time (:meth:`GangWatch.usable`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from clusterkit.runners.hpo.dispatch import START_DELAY

logger = logging.getLogger(__name__)

#: Seconds from SIGTERM to SIGKILL where the ending worker's end is not known (a retirement).
GRACE = 10.0


def agree(
    decisions: dict[int, bool],
    asking: dict[int, list[str]],
    msg: dict[str, Any],
    decide: Callable[[], bool],
    answer: Callable[[str, Any], None],
    step: str = "step",
) -> None:
    """One rank's question for ``msg[step]``: rank 0's is decided (``decide``) and answered, with
    the other ranks' for the same step, held in ``asking`` until then; later ones get it."""
    at = int(msg[step])
    if msg["rank"] != 0:
        if at in decisions:
            answer(msg["reply"], decisions[at])
        else:
            asking.setdefault(at, []).append(msg["reply"])
        return
    decisions[at] = decide()
    for reply in [msg["reply"], *asking.pop(at, [])]:
        answer(reply, decisions[at])


class Ending(NamedTuple):
    """Why a launch that ended unfinished ended where it was told to; ``saved``: its ranks
    ended by themselves (they save), not killed at the end of their grace (hours lost)."""

    why: str
    saved: bool


@dataclass
class Notice:
    """A launch of a gang: the answers given at each call, and when it was told to end."""

    key: str
    workers: tuple[str, ...]
    decisions: dict[int, bool] = field(default_factory=dict)
    asking: dict[int, list[str]] = field(default_factory=dict)
    told: float | None = None  # time.time() when its ranks were told (and signalled)
    why: str = ""
    kill_at: float = math.inf
    killed: bool = False  # its grace ran out
    signalled: int | None = None  # the first rank that got SIGTERM from elsewhere (its job's)


def closing(workers: dict[str, Any]) -> set[str]:
    """The retiring ones of the scheduler's ``workers`` (``identity()["workers"]``)."""
    return {a for a, w in workers.items() if "closing" in str(w.get("status", ""))}


class GangWatch:
    """The gang loop's notices to gangs whose workers are ending. ``guard``: the loop's
    :class:`~.dispatch.WalltimeGuard` (each worker's end, and when it counts as ending)."""

    def __init__(self, client: Any, guard: Any) -> None:
        self.client = client
        self.guard = guard
        self.notices: dict[int, Notice] = {}
        self.closing: set[str] = set()  # workers still there but retiring

    def seen(self, workers: dict[str, Any]) -> None:
        """The scheduler's workers (``identity()["workers"]``): which are retiring."""
        self.closing = closing(workers)

    def launched(self, number: int, key: str, workers: Iterable[str]) -> None:
        self.notices[number] = Notice(key, tuple(sorted(set(workers))))

    def ending(self, workers: Iterable[str], at: float) -> str | None:
        """Why a gang on ``workers`` must end by ``at`` (None: it need not)."""
        for worker in sorted(set(workers)):
            if worker in self.closing:
                return f"worker {worker} is retiring"
            start, end = self.guard.ending_from.get(worker), self.guard.ends.get(worker)
            if start is not None and end is not None and start <= at:
                return f"worker {worker} ends in {max(end - time.time(), 0.0):.0f}s"
        return None

    def usable(self, free: Sequence[Any], need: float | None) -> list[Any]:
        """The ``free`` slots a gang may start on: not on an ending worker; with ``need`` (the
        gang's likely seconds), those of workers with that much left, else (too few for any
        gang) the others, the longest-lived first."""
        start = time.time() + START_DELAY
        ends, retiring = self.guard.ends, self.guard.retiring
        open_ = [
            s for s in free if s.worker not in retiring and self.ending([s.worker], start) is None
        ]
        if need is None or all(ends.get(s.worker) is None for s in open_):
            return open_
        fits = [s for s in open_ if ends.get(s.worker) is None or ends[s.worker] - start >= need]
        if fits:
            return fits
        return sorted(open_, key=lambda s: -(ends.get(s.worker) or math.inf))

    def retire_short(self, idle: Iterable[str], need: float | None) -> None:
        """Retire the ``idle`` workers (no gang holds a slot of theirs) with less than ``need``
        seconds left (the shortest gang waiting, as likely): no trial would finish on them, so
        their jobs end now and their hours stop (``adapt`` brings fresh ones)."""
        if need is None:
            return
        start = time.time() + START_DELAY
        ends, retiring = self.guard.ends, self.guard.retiring
        short = sorted(
            w
            for w in set(idle) - retiring - self.closing
            if ends.get(w) is not None and ends[w] - start < need
        )
        if short:
            self.guard.retire(tuple(short), need)

    def check(self, running: Iterable[Any], kill: Callable[[Any], None]) -> None:
        """Tell each running gang (:class:`~.gang_loop.GangAttempt`) whose worker is ending;
        ``kill`` the ones told whose grace is over."""
        now = time.time()
        for attempt in running:
            notice = self.notices.get(attempt.number)
            if notice is None or notice.key != attempt.key or attempt.failed:
                continue
            if notice.told is None:
                self.tell(attempt.number)
            elif now >= notice.kill_at:
                notice.killed = True
                logger.info(
                    "trial %s: its ranks outlived their grace; killing them", attempt.number
                )
                kill(attempt)

    def tell(self, number: int, why: str | None = None) -> bool:
        """Trial ``number``'s launch is told to end if a worker of it is ending (or ``why``):
        its ranks get SIGTERM and its kill is set; True once it was told."""
        notice = self.notices.get(number)
        if notice is None or notice.told is not None:
            return notice is not None
        why = why or self.ending(notice.workers, time.time())
        if why is None:
            return False
        ends = [self.guard.ends.get(w) for w in notice.workers]
        known = [end for end in ends if end is not None and end > time.time()]
        notice.told, notice.why = time.time(), why
        notice.kill_at = min(known) if known else notice.told + GRACE
        logger.info(
            "trial %s: %s; its ranks checkpoint and get SIGTERM (SIGKILL in %.0fs)",
            number,
            why,
            notice.kill_at - notice.told,
        )
        signal = threading.Thread(  # off the loop: a worker already gone takes a connect timeout
            target=self._terminate, args=(number, notice.key, list(notice.workers)), daemon=True
        )
        signal.start()
        return True

    def _terminate(self, number: int, key: str, workers: list[str]) -> None:
        from clusterkit.runners.ddp.worker import terminate

        try:
            self.client.run(terminate, key, workers=workers, on_error="ignore")
        except Exception as error:  # a worker going now must not stop the search
            logger.debug("SIGTERM to the ranks of trial %s failed: %s", number, error)

    def answer(
        self,
        number: int,
        msg: dict[str, Any],
        reply: Callable[[str, Any], None],
        workers: Sequence[str] = (),
    ) -> None:
        """A rank's ``should_checkpoint()`` call: every rank gets rank 0's answer at that call
        (True once the gang was told, or a rank got SIGTERM from elsewhere: the batch system
        signals the processes of the job it ends, which need not be rank 0's; ``workers``, by
        rank: that rank's worker retires, and no gang starts there)."""
        notice = self.notices[number]
        if msg.get("signalled") and notice.signalled is None:
            notice.signalled = int(msg["rank"])
            self.closing.update(workers[notice.signalled : notice.signalled + 1])

        def decide() -> bool:
            outside = (
                None if notice.signalled is None else f"its rank {notice.signalled} got SIGTERM"
            )
            return self.tell(number, outside)

        agree(notice.decisions, notice.asking, msg, decide, reply, step="call")

    def interrupted(self, number: int, futures: Sequence[Any]) -> Ending | None:
        """Why the launch that ended unfinished was interrupted (None: it was not): a rank
        raised TrialInterrupted, or its ranks had been told to end (and ended, or were killed)."""
        from clusterkit.runners.ddp.worker import RankError

        notice = self.notices.pop(number, None)
        for future in futures:
            error = future.exception() if future.status == "error" else None
            if isinstance(error, RankError) and error.kind == "TrialInterrupted":
                return Ending(f"rank {error.rank} saved a checkpoint ({error.message})", True)
        if notice is not None and notice.killed:
            return Ending(f"{notice.why}: its ranks were killed at the end of their grace", False)
        if notice is not None and notice.told is not None:
            return Ending(f"{notice.why}: its ranks were told to end, and ended", True)
        return None

    def told(self, number: int) -> bool:
        """Whether trial ``number``'s launch was told to end (its ranks end as they save)."""
        notice = self.notices.get(number)
        return notice is not None and notice.told is not None

    def forget(self, number: int) -> None:
        self.notices.pop(number, None)
