"""The dispatch loop for multi-rank trials (``ranks_per_trial``): gangs of DDP ranks.

Each trial's objective runs in k rank processes on k slots reserved together (:mod:`.gangs`),
launched as the training runner launches a group (:mod:`clusterkit.runners.ddp`): torchrun's
environment, a fresh rendezvous port per launch, a torch process group left initialised is
destroyed when the rank process ends. The driver holds the trial: it samples each parameter
when a rank first asks for it (every rank gets the same value) and decides pruning on rank 0's
values. A rank that raises or loses its worker ends every rank of its trial. A trial that lost
a rank's worker (or a rank killed by a signal: out of memory, walltime) is retried whole, first
in line, up to ``max_retries`` times; one whose objective raised fails at once; one whose worker
is ending resumes from its checkpoint, ``max_resumes`` times at most (:mod:`.gang_preemption`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from clusterkit.errors import BadInput
from clusterkit.runners.ddp import placement as ddp_placement
from clusterkit.runners.hpo import dispatch, gangs, inputs
from clusterkit.runners.hpo.dispatch import Attempt, lost_rank
from clusterkit.runners.hpo.gang_account import GangLedger, held_by
from clusterkit.runners.hpo.gang_preemption import GangWatch, agree, closing
from clusterkit.runners.hpo.gangs import GangOptions
from clusterkit.runners.hpo.loop import SearchLoop
from clusterkit.runners.hpo.preemption import TrialInterrupted
from clusterkit.runners.hpo.retried import series_number

if TYPE_CHECKING:
    import optuna
    from distributed import Future

    from clusterkit.runners.ddp.placement import Slot

logger = logging.getLogger(__name__)

#: Seconds the ranks of a launch wait for rank 0's rendezvous port before the launch fails.
RENDEZVOUS_TIMEOUT = 60.0


@dataclass
class GangAttempt(Attempt):
    """A gang trial: waiting in line, or launched (``key``, ``slots``, ``futures``)."""

    future: Any = None
    size: int = 1
    trial: Any = None  # the driver's optuna.Trial: it samples for every rank
    key: str = ""
    slots: list[Slot] = field(default_factory=list)
    futures: list[Future] = field(default_factory=list)
    launched_at: float = 0.0
    failed: bool = False
    aborted_at: float = math.inf  # when the driver killed its ranks (their deaths are not lost)
    decisions: dict[int, bool] = field(default_factory=dict)  # step -> rank 0's verdict
    asking: dict[int, list[str]] = field(default_factory=dict)  # step -> replies owed
    checkpoint: bytes | None = None  # what rank 0 saved with the scheduler: a retry resumes


class GangLoop(SearchLoop):
    """:class:`SearchLoop` with every trial run as a gang of ranks."""

    def __init__(self, *args: Any, gang: GangOptions, trial_walltime: float | None = None) -> None:
        super().__init__(*args, trial_walltime=trial_walltime)  # type: ignore[misc]
        from clusterkit.runners.ddp.driver import Leftovers, prepare
        from clusterkit.runners.hpo.gang_rank import run_rank
        from clusterkit.runners.workdir.once import Collector

        self.options = gang
        self.line: list[int] = []  # trial numbers waiting, in order
        self.layout: list[Slot] = []
        self.live: set[str] = set()
        self.policy = gangs.GangPolicy()  # which waiting trials start; learns durations by size
        self.space: dict[str, Any] = {  # distributions seen: sampled before a callable sizes
            k: v for t in self.study.get_trials(deepcopy=False) for k, v in t.distributions.items()
        }
        self.interfaces: dict[str, dict[str, str]] = {}
        self.watch = GangWatch(self.client, self.walltime)  # gangs whose workers are ending
        self.ledger: GangLedger = GangLedger(self.resources)  # each gang holds its k slots
        prepare(self.client, (run_rank.__module__,))  # spares (ours imported): launches in ms
        self.leftovers = Leftovers(self.client)  # of ended gangs, let go after each launch
        self.warnings = Collector(self.client, f"{self.topic}-warnings")
        self._set_layout(ddp_placement.live_workers(self.client))

    def loop(self) -> None:
        try:
            super().loop()
        finally:
            self.leftovers.close()
            self.warnings.summary("ranks")

    def release(self) -> None:
        """The search's warm rank processes end, spares start (the driver's last calls first)."""
        from clusterkit.runners.ddp.pool import release_everywhere

        try:
            self.client.run_on_scheduler(release_everywhere, self.topic)
        except Exception as error:  # a cluster going away ends its processes anyway
            logger.debug("releasing warm rank processes failed: %s", error)

    # ------------------------------------------------------------------ slots

    def _set_layout(self, workers: dict[str, Any]) -> None:
        slots = ddp_placement.slots_of(workers)
        if self.resources and "GPU" in self.resources:
            slots = [s for s in slots if s.gpu]
        self.layout, self.live = slots, {s.worker for s in slots}
        self._slots_value = max(1, len(slots))

    def _workers_seen(self, workers: dict[str, Any]) -> None:
        self.ledger.seen(workers)
        self.walltime.live = set(workers)
        if set(workers) != self.live or closing(workers) != self.watch.closing:
            self.inbox.put(("event", {"kind": "slots", "workers": workers}))  # on the loop

    def _recheck(self) -> None:
        super()._recheck()
        self._refresh_slots()  # a worker lost mid-trial is seen even when nothing else happens
        self.watch.check(self._running(), self._fail_gang)

    def _running(self) -> list[GangAttempt]:
        return [a for a in self._gangs() if a.futures]

    def _gangs(self) -> list[GangAttempt]:
        return [a for a in self.inflight.values() if isinstance(a, GangAttempt)]

    # ------------------------------------------------------------------ dispatch

    def _fill(self) -> None:
        self.walltime.refresh()  # the ends of workers new since
        lookahead = 1 if isinstance(self.options.ranks, int) else max(1, len(self.layout))
        waiting = len(self.line) + 1
        while len(self.line) < waiting:  # till none starts: each start makes room in line
            while (
                not self.side.stopped
                and len(self.line) < lookahead
                and self.done + len(self.inflight) < self.n_trials
                and not self._past_deadline()
            ):
                self._enqueue(self._ask())
            waiting = len(self.line)
            self._start_ready()
        self._refresh_slots()
        self.leftovers.let_go()

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _enqueue(self, trial: optuna.Trial) -> None:
        self.order.asked(trial)
        size = self.options.ranks
        if not isinstance(size, int):
            for name, distribution in self.space.items():
                trial._suggest(name, distribution)  # the search space seen so far
            frozen = self.storage.get_trial(trial._trial_id)
            fixed = frozen.system_attrs.get("fixed_params", {})  # an enqueued trial's
            size = size({**fixed, **trial.params})
        if not isinstance(size, int) or size < 1:
            raise BadInput(f"ranks_per_trial must give an int of at least 1, got {size!r}")
        self.inflight[trial.number] = GangAttempt(
            trial.number, trial._trial_id, size=size, trial=trial
        )
        self.line.append(trial.number)

    def _start_ready(self) -> None:
        if self._past_deadline():
            self._drop_line()
            return
        while self.line and self._gang(self.line[0]).size > len(self.layout):
            attempt = self._gang(self.line.pop(0))
            why = f"it needs {attempt.size} rank slots, the cluster has {len(self.layout)}"
            self._tell(attempt, "FAIL", error=why)
        held = {slot for gang in self._running() for slot in gang.slots}
        line = [(n, self._gang(n).size) for n in self.line]
        need = self.policy.estimate(self.policy.head(line) or 1) or self.walltime.hint
        idle = {s.worker for s in self.layout} - {s.worker for s in held}
        self.watch.retire_short(idle, self.policy.shortest(line) or self.walltime.hint)
        free = self.watch.usable([s for s in self.layout if s not in held], need)
        now = time.monotonic()
        running = [self.policy.gang(g.size, g.launched_at, now) for g in self._running()]
        chosen = self.policy.place(line, free, running, now, self.options.placement)
        for number, slots in chosen:
            self.line.remove(number)
            self._launch(self._gang(number), slots)

    def _gang(self, number: int) -> GangAttempt:
        return cast(GangAttempt, self.inflight[number])

    def _drop_line(self) -> None:
        """Past the timeout: trials still waiting never started; they are not counted."""
        from optuna.trial import TrialState

        for number in self.line:
            attempt = self.inflight.pop(number)
            self.storage.set_trial_user_attr(attempt.trial_id, inputs.ATTR_ORPHANED, True)
            self.storage.set_trial_state_values(attempt.trial_id, TrialState.FAIL)
        self.line.clear()

    def _launch(self, attempt: GangAttempt, slots: list[Slot]) -> None:
        import cloudpickle
        from optuna.distributions import distribution_to_json

        from clusterkit.runners.ddp.group import submit_ranks
        from clusterkit.runners.ddp.placement import interface_env, torch_backend
        from clusterkit.runners.hpo.gang_rank import run_rank

        attempt.starts += 1
        frozen = self.storage.get_trial(attempt.trial_id)
        series = series_number(attempt.number, frozen.user_attrs)  # where its checkpoints are
        info = {
            "topic": self.topic,
            "number": attempt.number,
            "trial_id": attempt.trial_id,
            "attempt": attempt.starts,
            "series": series,
            "study": self.side.facts,  # pickled StudyFacts: name, directions, attributes
            "params": dict(frozen.params),
            "system_attrs": dict(frozen.system_attrs),  # an enqueued trial's fixed_params
            "checkpoint_dir": self.options.checkpoint_dir,  # hpo.checkpoint_dir(trial)
            "distributions": {k: distribution_to_json(d) for k, d in frozen.distributions.items()},
        }
        unknown = [s for s in slots if s.worker not in self.interfaces]
        if unknown:
            self.interfaces.update(interface_env(self.client, unknown))
        payload = cloudpickle.dumps((run_rank, (self.blob, info), {}))
        specs = ddp_placement.rank_specs(
            f"{self.topic}-t{attempt.number}",
            attempt.starts,
            slots,
            torch_backend("auto", slots),
            payload,
            checkpoint=attempt.checkpoint,  # an earlier attempt's, held by the scheduler
            init_group=False,  # the objective initialises its group, as under torchrun
            rendezvous_timeout=RENDEZVOUS_TIMEOUT,
            project=self.options.project,
            checkpoint_dir=self.options.checkpoints_of(series),
            warnings_topic=self.warnings.topic,
            progress_topic=None,
            reuse=self.topic,  # a rank process that ends cleanly serves this search's next trial
        )
        attempt.key, attempt.slots, attempt.futures = specs[0]["key"], slots, []
        attempt.launched_at, attempt.failed, attempt.aborted_at = time.monotonic(), False, math.inf
        attempt.workers = [s.worker for s in slots]
        attempt.futures = submit_ranks(self.client, specs, slots, self.interfaces)
        self.watch.launched(attempt.number, attempt.key, attempt.workers)
        self.ledger.launched(attempt.number, held_by(slots, self.ledger.unit), None)
        for future in attempt.futures:
            self.futures[future.key] = (attempt.number, future)
            future.add_done_callback(lambda f: self.inbox.put(("done", f.key)))

    # ------------------------------------------------------------------ ends

    def _finished(self, key: Any) -> None:
        number, future = self.futures.pop(key, (-1, None))
        attempt = self.inflight.get(number)
        if future is None or not isinstance(attempt, GangAttempt):
            return
        if all(f.key != key for f in attempt.futures):
            return  # a rank of an earlier launch
        if future.status != "finished" and not self.watch.told(attempt.number):
            self._fail_gang(attempt)  # told to end: its others end by themselves, or are killed
        if all(f.done() for f in attempt.futures):  # slots are freed when every rank ended
            self._ended(attempt)

    def _fail_gang(self, attempt: GangAttempt) -> None:
        """End every rank of the launch: kill the rank processes, drop ranks on lost workers."""
        if attempt.failed:
            return
        attempt.failed, attempt.aborted_at = True, time.time()
        from clusterkit.runners.ddp.worker import abort

        targets = sorted({s.worker for s in attempt.slots} & self.live)
        try:
            self.client.run(abort, attempt.key, workers=targets, on_error="ignore")
        except Exception as error:  # a worker dying now must not stop the search
            logger.debug("abort of %s failed: %s", attempt.key, error)
        lost = [
            f
            for f, s in zip(attempt.futures, attempt.slots, strict=True)
            if s.worker not in self.live
        ]
        if lost:
            self.client.cancel(lost, force=True)

    def _ended(self, attempt: GangAttempt) -> None:
        import cloudpickle

        from clusterkit.runners.ddp.driver import cleanup, last_checkpoint
        from clusterkit.runners.ddp.group import first_failure

        futures, slots = attempt.futures, attempt.slots
        attempt.futures, attempt.slots = [], []
        run_id = f"{self.topic}-t{attempt.number}"
        finished = all(f.status == "finished" for f in futures)
        record = cloudpickle.loads(futures[0].result()) if finished else None  # None: exited
        self.leftovers.keep(futures, run_id if record is not None else None, attempt.starts + 1)
        if record is None:  # before a retry saves again under the same names
            if self.options.checkpoint_dir is None:  # held by the scheduler: kept for a retry
                attempt.checkpoint = last_checkpoint(self.client, run_id) or attempt.checkpoint
            cleanup(self.client, run_id, attempt.starts + 1)
        self.storage.set_trial_user_attr(
            attempt.trial_id, inputs.ATTR_GANG, [s.worker for s in slots]
        )
        if record is not None:
            self.watch.forget(attempt.number)
            record["worker"] = slots[0].worker
            self.policy.finished(attempt.size, time.monotonic() - attempt.launched_at)
            self._complete(attempt, record)
            self.space.update(self.storage.get_trial(attempt.trial_id).distributions)
            return
        interrupted = self.watch.interrupted(attempt.number, futures)
        lost = None if finished else lost_rank(futures, slots, self.live, attempt.aborted_at)
        cause = lost or first_failure(futures, slots, self.live)
        why = f"rank {cause.rank}: {cause.message}" if cause.rank is not None else cause.message
        why = interrupted.why if interrupted else why if not finished else "rank 0 exited, no value"
        if cause.traceback and not interrupted:
            logger.debug("trial %s failed:\n%s", attempt.number, cause.traceback)
        if lost is None and interrupted is None:  # the objective's own error: never retried
            self.ledger.ended(attempt.number, {"state": "FAIL"})
            self._tell(attempt, "FAIL", error=why)
            return
        saved = interrupted is not None and interrupted.saved  # else its hours are lost
        self.ledger.lost(attempt.number, cause=TrialInterrupted() if saved else None)
        attempt.resumes += saved
        if (bound := self.retries.exceeded(attempt, attempt.starts)) is not None:
            self.ledger.ended(attempt.number, {"state": "FAIL"})
            why = f"trial failed after {attempt.starts} attempts: {bound}: {why}"
            return self._tell(attempt, "FAIL", error=why)
        again = "resuming it on workers with time left" if saved else "retrying it whole"
        logger.info("trial %s: %s; %s (retry %s)", attempt.number, why, again, attempt.starts)
        attempt.decisions, attempt.asking = {}, {}
        self.line.insert(0, attempt.number)
        self.policy.first(attempt.number)

    def _abandon(self) -> None:
        """On an early exit, end every gang and leave its trial for the next run to resume."""
        for attempt in self._running():
            self._fail_gang(attempt)
            dispatch.cancel(self.client, attempt.futures, force=True)
        self.line.clear()
        if self.inflight:
            self.inflight.clear()
            inputs.recover_orphans(self.study)

    # ------------------------------------------------------------------ events from ranks

    def _event(self, msg: dict[str, Any]) -> None:
        kind = msg.get("kind")
        if kind == "slots":
            self._set_layout(msg["workers"])
            self.watch.seen(msg["workers"])  # gangs on retiring workers: told, then killed
            for attempt in self._running():
                if any(s.worker not in msg["workers"] for s in attempt.slots):
                    self._fail_gang(attempt)
            self.watch.check(self._running(), self._fail_gang)
            self._fill()
            return
        gang = self.inflight.get(msg.get("number", -1))
        if not isinstance(gang, GangAttempt) or msg.get("attempt") != gang.starts:
            return  # a message of an earlier launch
        try:
            if kind == "suggest":
                self._answer(msg["reply"], self._suggest(gang, msg))
            elif kind == "prune":
                decide = functools.partial(self._decide_prune, gang, msg["intermediate"])
                agree(gang.decisions, gang.asking, msg, decide, self._answer)
            elif kind == "checkpoint":  # hpo.should_checkpoint(): the same on every rank
                self.watch.answer(gang.number, msg, self._answer, [s.worker for s in gang.slots])
            else:
                self._from_trial(msg, gang.trial_id)
        except Exception as error:  # a message racing the trial's end must not stop the search
            logger.debug("ignored %s message for trial %s: %s", kind, gang.number, error)

    def _suggest(self, attempt: GangAttempt, msg: dict[str, Any]) -> dict[str, Any]:
        """The trial's value for the parameter: sampled now on the first ask, then the same."""
        from optuna.distributions import json_to_distribution

        try:
            value = attempt.trial._suggest(msg["name"], json_to_distribution(msg["dist"]))
        except Exception as error:  # e.g. a distribution unlike the one sampled before
            return {"error": f"{type(error).__name__}: {error}"}
        return {"value": value}

    def _show(self) -> None:
        if self.display is not None:
            sizes = [len(a.slots) for a in self._running()]
            head = self.policy.head([(n, self._gang(n).size) for n in self.line])
            self.display.update_gangs(self.study, self.n_trials, sizes, len(self.layout), head)

    def _log_stall(self, quiet: float) -> None:
        waiting, running = len(self.line), len(self._running())
        said = "no trial finished or reported for %.0fs; %d gangs running, %d trials waiting"
        logger.warning(said, quiet, running, waiting)
