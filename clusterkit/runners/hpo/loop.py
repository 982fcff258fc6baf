"""The driver's dispatch loop: slots and their lookahead kept full, the next asked as one ends."""

from __future__ import annotations

import json
import logging
import math
import queue
import sys
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from clusterkit.runners.hpo import account, dispatch, inputs, records
from clusterkit.runners.hpo.callbacks import InOrder
from clusterkit.runners.hpo.changelog import ChangeLog
from clusterkit.runners.hpo.dispatch import (
    Attempt,
    Retries,
    WalltimeGuard,
    Watchdog,
    count_slots,
    log_stall,
)
from clusterkit.runners.hpo.preemption import TrialInterrupted
from clusterkit.runners.hpo.presample import Presampler
from clusterkit.runners.hpo.storage import flush as flush_storage
from clusterkit.runners.hpo.studyside import StudySide

if TYPE_CHECKING:
    import optuna
    from distributed import Client, Future

logger = logging.getLogger(__name__)

#: How often one trial's task may be dropped by Dask (lost inputs) and submitted again.
MAX_REQUEUES = 5
#: Seconds without notice from the cluster, trials in flight (or 3x the longest trial): a log.
STALL_AFTER = 60.0
#: Trials queued ahead at most, in all: at a thousand slots the driver bounds the throughput,
#: not the hand-off, and twice the tasks in flight cost it 3.5 ms a trial instead of 1.0.
MAX_AHEAD = 64
#: Seconds between flushes of the study's storage (and progress updates) while results stream in;
#: a driver killed in between loses only results no one was shown (asked again on resume).
REPORT_EVERY = 0.25


class SearchLoop:
    """The dispatch loop: slots (and lookahead) kept full, the next asked as one finishes."""

    def __init__(
        self,
        study: optuna.Study,
        client: Client,
        objective_blob: bytes,
        n_trials: int,
        resources: Mapping[str, float] | None,
        retries: Retries,
        catch: tuple[type[BaseException], ...],
        timeout: float | None,
        display: Any,
        lookahead: int = 0,
        trial_walltime: float | None = None,
    ) -> None:
        self.study = study
        self.storage = inputs.storage_of(study)
        self.client, self.blob, self.n_trials = client, objective_blob, n_trials
        self.resources = dict(resources) if resources else None
        self.retries, self.catch = retries, catch
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.lookahead = lookahead if timeout is None else 0  # a queued trial would start late
        self.display = display
        self.topic = f"clusterkit-hpo-{uuid.uuid4().hex[:12]}"
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.inflight: dict[int, Attempt] = {}
        self.futures: dict[Any, tuple[int, Future]] = {}  # key: (trial number, its task)
        self.done = sum(inputs.counted(t) for t in study.get_trials(deepcopy=False))
        self.overhead = 0.0  # seconds the driver spent handling trials (bench reads it)
        self._slots_value, self._slots_at = 1, -math.inf
        self._keys, self._reported_at = 0, -math.inf
        self.watchdog = Watchdog(self._log_stall)
        self.log = ChangeLog(client, study.get_trials(deepcopy=False), 1)
        self.presample = Presampler(study)
        self.order = InOrder(study)  # the callbacks' (drive() sets them)
        self.walltime = WalltimeGuard(client, study, trial_walltime)  # placement (dispatch)
        self.ledger = account.Ledger(resources)  # the account of the hours held
        self.study_id = self.storage.get_study_id_from_name(study.study_name)
        self._dirty = False  # writes not yet flushed (see _report)
        self.side = StudySide(study, self.storage, self.study_id, self.log)  # as trials see it

    def release(self) -> None:
        """What the search kept on the workers goes, once it returns (:class:`.GangLoop`'s)."""

    # ------------------------------------------------------------------ dispatch

    def _submit(
        self, attempt_number: int, trial_id: int, submits: int, with_base: bool = False
    ) -> Future:
        from clusterkit.runners.hpo.worker import run_trial

        dispatch.check_cluster(self.client, self.done, self.n_trials)  # not on a closed client
        self._keys += 1
        key = f"hpo-{self.topic[-12:]}-{attempt_number}-{submits}-{self._keys}"
        alone = not any(n != attempt_number for n in self.inflight)  # its sampler comes back
        sampler = self.side.sampler_blob(
            self.presample.sampler_for(trial_id), attempt_number, key, alone
        )
        delta, base = self.log.delta(with_base)  # pickled now, on this thread
        future = self.client.submit(
            run_trial,
            self.blob,
            sampler,
            delta,
            base,
            self.side.facts,
            attempt_number,
            self.topic,
            submits,
            alone,
            key=key,
            pure=False,
            resources=self.resources,
            **self.walltime.restrictions(self.inflight.values()),  # off: none
        )
        self.futures[key] = (attempt_number, future)
        # the key, not the future: a notice left in the inbox must not keep a result alive
        future.add_done_callback(lambda f: self.inbox.put(("done", f.key)))
        return future

    def _refresh_slots(self) -> None:
        """Re-count slots at most once a second, in the background: workers come and go."""
        now = time.monotonic()
        if now - self._slots_at > 1.0:
            self._slots_at = now
            loop: Any = self.client.loop
            loop.add_callback(self._update_slots)

    async def _update_slots(self) -> None:
        scheduler: Any = self.client.scheduler
        try:
            info = await scheduler.identity(n_workers=-1)
        except OSError:  # the scheduler is briefly unreachable: keep the last count
            return
        self._workers_seen(info["workers"])

    def _workers_seen(self, workers: dict[str, Any]) -> None:
        """The scheduler's workers, as last asked (on the client's event loop)."""
        self._slots_value = max(1, count_slots(workers.values(), self.resources))
        self.walltime.live = set(workers)
        self.ledger.seen(workers)
        self.log.resize(self._slots_value)
        self.log.set_live({a for a, w in workers.items() if count_slots([w], self.resources)})

    def _fill(self) -> None:
        self.walltime.refresh()  # the ends of workers new since
        self.side.publish(self._slots_value)
        while (
            not self.side.stopped
            and len(self.inflight) < self._capacity()
            and self.done + len(self.inflight) < self.n_trials
            and (self.deadline is None or time.monotonic() < self.deadline)
        ):
            trial = self._ask()
            self.order.asked(trial)
            self.log.add(self.storage.get_trial(trial._trial_id))
            if len(self.inflight) >= self._slots_value or self.presample.always:  # it waits
                self.presample.draw(trial._trial_id)
            self.inflight[trial.number] = Attempt(
                trial.number, trial._trial_id, self._submit(trial.number, trial._trial_id, 1)
            )
        self._refresh_slots()  # after dispatching, so the RPC never delays a trial

    def _capacity(self) -> int:
        """Trials in flight: one per slot, and ``lookahead`` per slot (MAX_AHEAD in all) queued
        to start as one ends while over a slot's worth are left and walltime placement is off."""
        left = self.n_trials - self.done - len(self.inflight)
        if left <= self._slots_value or self.walltime.bounded:
            return self._slots_value
        return self._slots_value + min(self._slots_value * self.lookahead, MAX_AHEAD)

    def _ask(self) -> optuna.Trial:
        """:func:`.dispatch.ask`, the trials the runner enqueued counted down."""
        side = self.side
        enqueued, side.enqueued = side.enqueued > 0, max(0, side.enqueued - 1)
        return dispatch.ask(self.study, self.storage, self.study_id, enqueued)

    def loop(self) -> None:
        self.client.subscribe_topic(self.topic, lambda event: self.inbox.put(("event", event[1])))
        self.ledger.listen(self.client)
        try:
            self._slots_value = max(1, dispatch.slots(self.client, self.resources))
            self._slots_at = time.monotonic()
            self.log.resize(self._slots_value)
            self._fill()
            self._report()
            while self.inflight or self.futures:  # done: every task's completion was heard
                try:
                    kind, item = self.inbox.get(timeout=REPORT_EVERY if self._dirty else 1.0)
                except queue.Empty:
                    if self._dirty:  # quiet: make what came in durable and show it
                        self._report()
                        continue
                    dispatch.check_cluster(self.client, self.done, self.n_trials)
                    self._recheck()
                    self.watchdog.check(STALL_AFTER)
                    continue
                self.watchdog.heard()
                began = time.perf_counter()
                if kind == "done":
                    self._finished(item)
                    self._fill()  # after a retry or a failure
                else:
                    self._event(item)
                self._dirty = True
                if time.monotonic() - self._reported_at > REPORT_EVERY:
                    self._report()
                self.overhead += time.perf_counter() - began
            self._show()  # the final state, not the last one shown while trials ran
        finally:
            dispatch.unsubscribe(self.client, self.topic)
            self._abandon()
            self.ledger.close(self.client)
            flush_storage(self.storage)
            if sys.exc_info()[0] in (None, KeyboardInterrupt):  # not after a callback failed
                self.order.finish()
            self.log.close(self.topic)
            self.futures.clear()  # releases the tasks' results on the cluster

    def _report(self) -> None:
        """Make every write durable, then show progress (:mod:`.storage`; an fsync, a lock)."""
        flush_storage(self.storage)
        self._dirty, self._reported_at = False, time.monotonic()
        self._show()

    def _recheck(self) -> None:
        """Idle for a second: look at the futures, so no lost notice stalls the search."""
        for key, (_, future) in list(self.futures.items()):
            if future.done():
                self.inbox.put(("done", key))

    def _log_stall(self, quiet: float) -> None:
        log_stall(self.client, [attempt.future.key for attempt in self.inflight.values()], quiet)

    # ------------------------------------------------------------------ events from workers

    def _event(self, msg: dict[str, Any]) -> None:
        attempt = self.inflight.get(msg.get("number", -1))
        if attempt is None:
            return
        kind = msg["kind"]
        if kind == "start":
            attempt.starts += 1
            attempt.workers.append(msg["worker"])
            self.ledger.started(attempt.number, msg["worker"], msg["time"])
            self.log.ack(msg["worker"], msg["version"])
            why = self.retries.exceeded(attempt, attempt.attempts - 1)  # Dask ran it again
            if why is not None:
                attempt.future.cancel()
                self._fail_lost(attempt, why)
                self._fill()
            return
        if kind == "result":
            if msg.get("attempt") == attempt.submits and not msg.get("via_future"):
                record = json.loads(msg["record"])
                record["intermediate"] = {int(k): v for k, v in record["intermediate"].items()}
                record["exception"] = msg.get("exception")
                record["sampler"] = msg.get("sampler")
                self._complete(attempt, record)
            return
        try:
            if kind == "prune":
                self._answer(msg["reply"], self._decide_prune(attempt, msg["intermediate"]))
            else:
                self._from_trial(msg, attempt.trial_id)
        except Exception as error:  # a write racing the trial's end must not stop the search
            logger.debug("ignored %s message for trial %s: %s", kind, attempt.number, error)

    def _from_trial(self, msg: dict[str, Any], trial_id: int) -> None:
        """A trial's storage call, its ``study.stop()``, or a write to it."""
        if msg["kind"] == "call":
            self._answer(msg["reply"], self.side.answer(msg["request"]))
        elif msg["kind"] == "stop":
            self.side.stop()
        else:
            self.side.written(trial_id, msg)

    def _decide_prune(self, attempt: Attempt, intermediate: Any) -> bool:
        """The pruner's verdict on the trial with these intermediate values recorded; what it
        was decided on is durable first (an answer is a report)."""
        decision = records.decide_prune(self.study, self.storage, attempt.trial_id, intermediate)
        flush_storage(self.storage)
        return decision

    def _answer(self, reply: str, value: Any) -> None:
        """Put ``value`` on the scheduler queue a worker waits on for its answer."""
        scheduler: Any = self.client.scheduler
        self.client.sync(scheduler.queue_put, name=reply, data=value)

    # ------------------------------------------------------------------ results

    def _finished(self, key: Any) -> None:
        number, future = self.futures.pop(key, (-1, None))
        attempt = self.inflight.get(number)
        if future is None or attempt is None or attempt.future.key != key:
            return  # handled already, or a cancelled or superseded attempt
        if future.status == "finished":  # its record did not come as an event: fetch it
            record = future.result()
            if record.get("stale"):  # the worker's mirror was too old: again, with the base
                self.log.forget(record["worker"])
                attempt.future = self._submit(
                    attempt.number, attempt.trial_id, attempt.submits, with_base=True
                )
            else:
                self._complete(attempt, record)
            return
        if future.status == "cancelled":  # not by us: it is no longer in flight when we cancel
            self._requeue(attempt)
            return
        error = future.exception()
        if error is not None and not dispatch.is_lost_worker(error):
            self._tell(attempt, "FAIL", error=f"{type(error).__name__}: {error}")
            raise error
        attempt.resumes += (saved := isinstance(error, TrialInterrupted))
        why = self.retries.exceeded(attempt, attempt.attempts)
        if why is not None:
            return self._fail_lost(attempt, f"{why} ({type(error).__name__})")
        attempt.submits = attempt.attempts + 1
        self.ledger.lost(number, cause=error)
        self.log.add(self.storage.get_trial(attempt.trial_id))  # its first draws, kept
        again = "resuming it from its checkpoint" if saved else "retrying it"
        logger.info("trial %s lost its worker; %s (attempt %s)", number, again, attempt.submits)
        attempt.future = self._submit(attempt.number, attempt.trial_id, attempt.submits)

    def _requeue(self, attempt: Attempt) -> None:
        """Dask cancelled the task: its input, the scattered base, was lost with the workers
        that held it. Scatter a new base and submit again; this is no attempt of the trial's."""
        attempt.requeues += 1
        if attempt.requeues > MAX_REQUEUES:
            self._fail_lost(attempt, f"Dask cancelled it {attempt.requeues} times (lost inputs)")
            return
        logger.info("trial %s: Dask dropped its task (lost inputs); again", attempt.number)
        self.log.drop_base()
        attempt.future = self._submit(
            attempt.number, attempt.trial_id, attempt.submits, with_base=True
        )

    def _complete(self, attempt: Attempt, record: dict[str, Any]) -> None:
        """Count the trial and record it; its slot is filled on its task's completion notice (a
        trial submitted on the result event at times went to a busy worker, not yet seen free)."""
        self.inflight.pop(attempt.number, None)
        self.done += 1
        self._record(attempt, record)

    def _fail_lost(self, attempt: Attempt, why: str) -> None:
        self.ledger.lost(attempt.number)
        self._tell(attempt, "FAIL", error=f"trial failed after {attempt.attempts} attempts: {why}")

    def _record(self, attempt: Attempt, record: dict[str, Any]) -> None:
        """Apply the worker's authoritative record, then tell the study."""
        import cloudpickle

        records.apply_record(self.storage, attempt.trial_id, record)
        if record.get("sampler") is not None:  # a lone trial's: the study samples on from it
            self.side.adopt(attempt.number, str(attempt.future.key), record["sampler"])
        before = self.ledger.ended(attempt.number, record)  # its checkpointed attempts' run
        if "start" in record and "end" in record:
            self.watchdog.took(record["end"] - record["start"])
            self.walltime.finished(record, before)
        if record.get("traceback"):  # the one line goes to the terminal, this to the log
            logger.debug("trial %s failed:\n%s", attempt.number, record["traceback"])
        self._tell(attempt, record["state"], record["values"], record["error"])
        if record["state"] == "FAIL" and record["exception"] is not None:
            error = cloudpickle.loads(record["exception"])
            if not isinstance(error, self.catch):
                raise error

    def _tell(self, attempt: Attempt, state: str, values: Any = None, error: str | None = None):
        frozen = records.tell(self.study, self.storage, attempt, state, values, error)
        self.log.add(frozen)
        self.side.drawn.discard(attempt.trial_id)  # logged as it ended
        self.presample.finished(frozen)
        if self.inflight.pop(attempt.number, None) is not None:
            self.done += 1
        self.order.deliver()

    def _abandon(self) -> None:
        """On an early exit, cancel what runs and leave it for the next run to resume."""
        if not self.inflight:
            return
        dispatch.cancel(self.client, [attempt.future for attempt in self.inflight.values()])
        self.inflight.clear()
        inputs.recover_orphans(self.study)

    def _show(self) -> None:
        if self.display is not None:  # a trial that started is running; the others are queued
            started = [a.workers[-1] for a in self.inflight.values() if a.workers]
            queued = len(self.inflight) - len(started)
            self.display.update(self.study, len(started), len(set(started)), self.n_trials, queued)
