"""An account of the hours: the slot-seconds a search held, and where they went.

A slot is a GPU where trials ask for GPUs (``resources={"GPU": 1}``), else a core (a worker
thread). Each worker holds its slots from when it joined the search (a batch job of SLURM, PBS
or Grid Engine: from the job's start, as the batch system reports it; a worker there before the
search: from the search's start) until it left or the search ended. Each attempt of a trial
holds its slots from its start to its end on the worker. The held slot-seconds split into:

- ``finished``, ``pruned``, ``failed``: attempts that ended so (the trial's state);
- ``lost``: attempts whose worker died, hit its walltime or was preempted, and attempts the
  search abandoned when it stopped (a resume runs them again: the hours are redone). An
  attempt that saved a checkpoint first (``TrialInterrupted``) counts toward its trial's
  outcome once the trial ends (its work was kept); lost until then;
- ``idle``: held by the search, no trial on the slot.

:func:`split` computes it from intervals (:class:`Held`, :class:`Segment`); a :class:`Ledger`
collects those intervals while the search runs (:mod:`.loop` feeds it).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

#: The outcomes of an attempt, in the account's order; ``idle`` follows them.
OUTCOMES = ("finished", "pruned", "failed", "lost")
KINDS = (*OUTCOMES, "idle")
#: A trial's state (Optuna's) -> its attempt's outcome.
BY_STATE = {"COMPLETE": "finished", "PRUNED": "pruned", "FAIL": "failed"}
#: The file the account is written to in the results folder.
FILE = "account.json"


class Held(NamedTuple):
    """A worker holding ``slots`` from ``start`` to ``end`` (seconds since the epoch)."""

    worker: str
    start: float
    end: float
    slots: float


class Segment(NamedTuple):
    """One attempt of trial ``trial`` on ``worker``, holding ``slots`` of it, and how it ended."""

    worker: str
    trial: int
    start: float
    end: float
    slots: float
    outcome: str  # one of OUTCOMES


@dataclass
class Account:
    """Slot-seconds by kind (``KINDS``), in all, per worker (with its ``slots``, ``held``, the
    ``start`` and ``end`` of its holding; from a Ledger, when it ``joined`` and a batch worker's
    ``job``) and per trial (no idle)."""

    unit: str  # "GPU" or "core"
    since: float
    until: float
    total: dict[str, float]
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    trials: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def held(self) -> float:
        return sum(self.total.values())

    def to_json(self) -> dict[str, Any]:
        """Plain data: slot-seconds, ``held`` with each part (the parts add up to it)."""
        return {
            "unit": self.unit,
            "since": self.since,
            "until": self.until,
            "held": self.held,
            **self.total,
            "workers": self.workers,
            "trials": {str(number): kinds for number, kinds in sorted(self.trials.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Account:
        return cls(
            unit=data["unit"],
            since=data["since"],
            until=data["until"],
            total={kind: float(data.get(kind, 0.0)) for kind in KINDS},
            workers=dict(data.get("workers", {})),
            trials={int(n): dict(kinds) for n, kinds in data.get("trials", {}).items()},
        )


def split(
    held: Iterable[Held], segments: Iterable[Segment], unit: str, since: float, until: float
) -> Account:
    """The account of ``held`` intervals and the trials' ``segments``, within [since, until).

    A segment counts only inside its worker's held intervals (a worker's clock a little off the
    scheduler's cannot make a trial outlast the job that ran it); a worker's held slot-seconds
    not covered by a segment are idle (never below zero)."""
    spans: dict[str, list[tuple[float, float, float]]] = {}
    for item in held:
        start, end = max(item.start, since), min(item.end, until)
        if end > start:
            spans.setdefault(item.worker, []).append((start, end, item.slots))
    total = dict.fromkeys(KINDS, 0.0)
    workers: dict[str, dict[str, Any]] = {
        worker: {
            "slots": max(s for _, _, s in mine),
            "start": min(start for start, _, _ in mine),
            "end": max(end for _, end, _ in mine),
            **dict.fromkeys(KINDS, 0.0),
        }
        for worker, mine in spans.items()
    }
    trials: dict[int, dict[str, float]] = {}
    for seg in segments:
        used = seg.slots * sum(
            max(0.0, min(seg.end, end) - max(seg.start, start))
            for start, end, _ in spans.get(seg.worker, ())
        )
        if used <= 0:
            continue
        workers[seg.worker][seg.outcome] += used
        mine = trials.setdefault(seg.trial, {})
        mine[seg.outcome] = mine.get(seg.outcome, 0.0) + used
    for worker, intervals in spans.items():
        kinds = workers[worker]
        capacity = sum((end - start) * slots for start, end, slots in intervals)
        kinds["idle"] = max(0.0, capacity - sum(kinds[k] for k in OUTCOMES))
        kinds["held"] = sum(kinds[k] for k in KINDS)
        for kind in KINDS:
            total[kind] += kinds[kind]
    return Account(unit, since, until, total, workers, trials)


def hours(slot_seconds: float, unit: str) -> str:
    """``0.42 core-h``, ``12.5 GPU-h``, ``0.0031 GPU-h``: three figures."""
    return f"{slot_seconds / 3600:.3g} {unit}-h"


def line(account: Account) -> str:
    """``hours: 0.42 core-h held, 81% finished, 5% pruned, 0% failed, 2% lost, 12% idle``."""
    held = account.held
    parts = [f"{account.total[k] / held:.0%} {k}" if held else f"0% {k}" for k in KINDS]
    return f"hours: {hours(held, account.unit)} held, {', '.join(parts)}"


def so_far(ledger: Ledger) -> str:
    """The progress line's `` | 0.42 core-h held, 81% finished``: a search's account so far (a
    trial counts once it ended); empty before it held anything."""
    split = ledger.account()
    if split.held <= 0:
        return ""
    share = split.total["finished"] / split.held
    return f" | {hours(split.held, split.unit)} held, {share:.0%} finished"


def write(account: Account, folder: str | Path) -> Path:
    path = Path(folder) / FILE
    path.write_text(json.dumps(account.to_json(), indent=1) + "\n", encoding="utf-8")
    return path


def read(folder: str | Path | None) -> Account | None:
    """The account in a results folder; None without one (or unreadable)."""
    if not folder:
        return None
    try:
        return Account.from_json(json.loads((Path(folder) / FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def unit_of(resources: Mapping[str, float] | None) -> str:
    """``GPU`` where a trial asks for GPUs, else ``core``."""
    return "GPU" if resources and any(k.upper() == "GPU" for k in resources) else "core"


def trial_slots(resources: Mapping[str, float] | None) -> float:
    """The slots one (single-rank) trial holds: its GPUs, else one core."""
    for name, amount in (resources or {}).items():
        if name.upper() == "GPU":
            return float(amount)
    return 1.0


def worker_slots(info: Mapping[str, Any], resources: Mapping[str, float] | None) -> float:
    """A worker's slots, from the scheduler's view of it: its GPUs, else its threads."""
    for name in resources or {}:
        if name.upper() == "GPU":
            return float((info.get("resources") or {}).get(name, 0))
    return float(info.get("nthreads", 1))


def cluster_hours(client: Any) -> dict[str, float]:
    """A cluster's hours since its scheduler started (``up``): ``held``, its workers' thread-
    seconds (from the scheduler's add and remove events), ``busy``, the thread-seconds its tasks
    computed, and ``share_busy``; ``since``, the scheduler's start."""
    found = client.run_on_scheduler(held_and_busy)
    found["share_busy"] = found["busy"] / found["held"] if found["held"] > 0 else 0.0
    return found


def held_and_busy(dask_scheduler: Any) -> dict[str, float]:
    """Run on the scheduler: :func:`cluster_hours`' figures. A worker that left counts the mean
    threads of those there now; one whose join fell out of the event log, from the start."""
    now, since = time.time(), float(dask_scheduler.time_started)
    threads = {address: ws.nthreads for address, ws in dask_scheduler.workers.items()}
    mean = sum(threads.values()) / len(threads) if threads else 1.0
    joined: dict[str, float] = {}
    held = 0.0
    for stamp, msg in dask_scheduler.get_events("all"):
        action, worker = (
            (msg.get("action"), msg.get("worker")) if isinstance(msg, dict) else ("", "")
        )
        if action == "add-worker" and worker:
            joined[worker] = stamp
        elif action == "remove-worker" and worker in joined:
            held += (stamp - joined.pop(worker)) * mean
    held += sum((now - joined.get(w, since)) * n for w, n in threads.items())
    prefixes = dask_scheduler.task_prefixes.values()
    busy = sum(prefix.all_durations.get("compute", 0.0) for prefix in prefixes)
    return {"since": since, "held": held, "busy": float(busy)}


async def job_start() -> tuple[str, float] | None:
    """Run on a worker (``client.run``): its batch job's id and start, as the batch system
    reports it (SLURM: ``squeue -o %S``; PBS: ``qstat -f``'s ``stime``; Grid Engine: the task's
    ``JAT_start_time`` of ``qstat -j ID -xml``); None outside a batch job, or when the batch
    system does not answer. The query runs in a thread, off the worker's event loop."""
    import asyncio
    import os

    return await asyncio.get_running_loop().run_in_executor(None, _job_start, dict(os.environ))


def _job_start(environ: dict[str, str]) -> tuple[str, float] | None:
    from clusterkit.backends.jobqueue.commands import job_start as start_of
    from clusterkit.backends.jobqueue.pbs import PBSQueue
    from clusterkit.backends.jobqueue.sge import SGEQueue
    from clusterkit.backends.jobqueue.slurm import SlurmQueue

    for queue in (SlurmQueue(), PBSQueue(), SGEQueue()):
        if queue.job_here(environ):
            return start_of(queue, environ)
    return None


class Ledger:
    """The intervals of one search, as they happen: the workers' joins and leaves (the
    scheduler's ``all`` events, and the loop's polls of its workers), each attempt's start on
    its worker, and how it ended. :meth:`account` makes the :class:`Account` of it."""

    def __init__(self, resources: Mapping[str, float] | None, since: float | None = None) -> None:
        self.resources = dict(resources) if resources else None
        self.unit = unit_of(resources)
        self.since = time.time() if since is None else since
        self.until: float | None = None
        self.joined: dict[str, float] = {}
        self.left: dict[str, float] = {}
        self.slots: dict[str, float] = {}
        self.job_start: dict[str, float] = {}  # a batch job's start, by worker
        self.jobs: dict[str, str] = {}  # a worker's batch job id
        self.client: Any = None  # the client whose events are heard (listen)
        self.running: dict[int, tuple[str, float]] = {}  # trial -> (worker, start)
        self.segments: list[Segment] = []
        self.kept: dict[int, list[Segment]] = {}  # checkpointed attempts, till their trial ends

    # ------------------------------------------------------------------ workers

    def listen(self, client: Any) -> None:
        """Hear the workers' joins and leaves from now on; the workers there now joined at the
        search's start."""
        workers = client.scheduler_info(n_workers=-1)["workers"]
        self.seen(workers, self.since)
        self.client = client
        client.subscribe_topic("all", self.event)

    def seen(self, workers: Mapping[str, Any], now: float | None = None) -> None:
        """The scheduler's workers now (``identity()["workers"]``): their slots; a worker not
        announced by an event joined ``now``, one gone unannounced left now."""
        now = time.time() if now is None else now
        for address, info in workers.items():
            self.slots[address] = worker_slots(info, self.resources)
            if address not in self.joined or address in self.left:
                self._joined(address, self.joined.get(address, now))
        for address in set(self.joined) - set(workers) - set(self.left):
            self.left[address] = now

    def event(self, event: tuple[float, Mapping[str, Any]]) -> None:
        """A scheduler event of topic ``all``: a worker's add or removal, at its time."""
        stamp, msg = event
        worker, action = msg.get("worker"), msg.get("action")
        if not isinstance(worker, str):
            return
        if action == "add-worker":
            self._joined(worker, max(self.since, float(stamp)))
        elif action == "remove-worker":
            self.left[worker] = float(stamp)

    def _joined(self, worker: str, stamp: float) -> None:
        """``worker`` joined at ``stamp``; once the search listens, its batch job's start is
        asked for (a worker in a batch job holds its slots from then)."""
        new = worker not in self.joined
        self.joined[worker] = stamp
        self.left.pop(worker, None)
        if new and self.client is not None:
            self.client.loop.add_callback(self._ask_job_start, worker)

    async def _ask_job_start(self, worker: str) -> None:
        """On the client's event loop: the worker's batch job and its start (:func:`job_start`)."""
        try:
            found = await self.client.run(
                job_start, workers=[worker], on_error="return", asynchronous=True
            )
        except Exception:  # gone already, or the scheduler briefly unreachable: its join counts
            return
        answer = found.get(worker)
        if isinstance(answer, tuple | list) and len(answer) == 2:
            self.jobs[worker], self.job_start[worker] = str(answer[0]), float(answer[1])

    def held(self, until: float) -> list[Held]:
        """Each worker's held interval: from its job's start (when known) or its join."""
        found = []
        for worker, joined in self.joined.items():
            start = min(joined, self.job_start.get(worker, joined))
            end = self.left.get(worker, until)
            found.append(Held(worker, start, end, self.slots.get(worker, 1.0)))
        return found

    # ------------------------------------------------------------------ trials

    def started(self, trial: int, worker: str, stamp: float) -> None:
        """An attempt started; one of the same trial still open was lost (its worker died)."""
        if trial in self.running:
            self.lost(trial, stamp)
        self.running[trial] = (worker, stamp)
        self.joined.setdefault(worker, max(self.since, stamp))

    def ended(self, trial: int, record: Mapping[str, Any]) -> float:
        """A trial's record (worker, start, end, state): its last attempt's segment; the
        seconds its checkpointed attempts ran before (they count toward it too)."""
        self.running.pop(trial, None)
        kept = self.kept.pop(trial, []) if "start" in record and "end" in record else []
        if "start" in record and "end" in record:
            outcome = BY_STATE.get(record["state"], "failed")
            worker, start, end = record["worker"], record["start"], record["end"]
            self.segments += [s._replace(outcome=outcome) for s in kept]
            self.segments.append(
                Segment(worker, trial, start, end, trial_slots(self.resources), outcome)
            )
        return sum(s.end - s.start for s in kept)

    def lost(self, trial: int, stamp: float | None = None, cause: object = None) -> None:
        """The open attempt of ``trial`` was lost: it ends when its worker left, if that is
        known and earlier, else now (``stamp``). ``cause`` TrialInterrupted: it saved a
        checkpoint, kept for the trial's outcome."""
        from clusterkit.runners.hpo.preemption import TrialInterrupted

        opened = self.running.pop(trial, None)
        if opened is None:
            return
        worker, start = opened
        end = min(time.time() if stamp is None else stamp, self.left.get(worker, float("inf")))
        slots = trial_slots(self.resources)
        kept = isinstance(cause, TrialInterrupted)
        mine = self.kept.setdefault(trial, []) if kept else self.segments
        mine.append(Segment(worker, trial, start, max(start, end), slots, "lost"))

    def close(self, client: Any = None) -> None:
        """The search ended: attempts still open are lost (a resume runs them again); no
        more of ``client``'s events."""
        if client is not None and client.status not in ("closing", "closed"):
            with contextlib.suppress(ValueError):  # never subscribed
                client.unsubscribe_topic("all")
        self.until = time.time()
        for trial in list(self.running):
            self.lost(trial, self.until)

    def account(self) -> Account:
        until = self.until if self.until is not None else time.time()
        kept = [segment for mine in self.kept.values() for segment in mine]  # lost so far
        result = split(self.held(until), self.segments + kept, self.unit, self.since, until)
        for worker, kinds in result.workers.items():
            kinds["joined"] = self.joined[worker]  # its registration (or the search's start)
            if worker in self.jobs:
                kinds["job"] = self.jobs[worker]
        return result
