"""Asynchronous, fault-tolerant Optuna search over any Dask client.

How trials reach the study. Each trial is asked on the driver (``study.ask()``, so it is RUNNING in
storage at once) and shipped to a worker with a snapshot of the study and the sampler. The
worker runs the unmodified objective on a real ``optuna.Trial`` over an in-memory mirror of that
snapshot: ``suggest_*`` samples locally with no network round trip, and every write to the trial
(parameters, intermediate values, user attributes) is also sent to the driver as a
fire-and-forget ``log_event`` on the worker's existing scheduler connection, so the driver's
storage shows running trials within milliseconds and samplers do not re-propose them.
``should_prune`` is the one synchronous call: the driver evaluates the study's pruner on the
study's current intermediate values and answers through a scheduler Queue.

Why this channel and not Optuna's gRPC storage proxy: the proxy needs every worker to open a
new plain-text TCP connection back to the driver, which fails behind a Kubernetes port-forward,
from SLURM compute nodes to a laptop, and bypasses the profile's TLS; and it turns each
``suggest_*`` into a round trip. Dask's connection already exists, is secured by the profile,
and costs no round trip per suggestion. The price is a study snapshot per dispatch (O(trials)),
which is small for the thousands of trials a Dask search runs.

Fault tolerance: the sampler ships with its random state fixed, so when Dask re-runs a task
whose worker died the trial gets the same parameters; the driver counts attempts from the
workers' start messages and fails the trial past ``max_retries``. Trials left RUNNING by a
killed driver are failed, marked ``ck_orphaned`` (not counted) and their parameters enqueued.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from clusterkit.errors import BadInput, ClusterkitError
from clusterkit.runners.hpo import inputs
from clusterkit.runners.hpo.changelog import ChangeLog
from clusterkit.runners.hpo.dispatch import (
    Attempt,
    check_resources,
    count_slots,
    is_lost_worker,
    slots,
)
from clusterkit.runners.hpo.storage import flush as flush_storage

if TYPE_CHECKING:
    import optuna
    from distributed import Client, Future

logger = logging.getLogger(__name__)

#: Figures of the last :func:`run` in this process (driver seconds spent per event), for bench/.
LAST_RUN_STATS: dict[str, float] = {}


class _Driver:
    """The dispatch loop: one trial per free slot, the next asked as soon as one finishes."""

    def __init__(
        self,
        study: optuna.Study,
        client: Client,
        objective_blob: bytes,
        n_trials: int,
        resources: Mapping[str, float] | None,
        max_retries: int,
        catch: tuple[type[BaseException], ...],
        timeout: float | None,
        display: Any,
    ) -> None:
        self.study = study
        self.client = client
        self.blob = objective_blob
        self.n_trials = n_trials
        self.resources = dict(resources) if resources else None
        self.max_retries = max_retries
        self.catch = catch
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.display = display
        self.topic = f"clusterkit-hpo-{uuid.uuid4().hex[:12]}"
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.inflight: dict[int, Attempt] = {}
        self.by_key: dict[Any, int] = {}
        self.done = sum(inputs.counted(t) for t in study.get_trials(deepcopy=False))
        self.directions = [int(d) for d in study.directions]
        self.overhead = 0.0  # seconds the driver spent handling trials (bench reads it)
        self._slots_value, self._slots_at = 1, -math.inf
        self._keys = 0
        self._reported_at = -math.inf
        self.log = ChangeLog(client, study.get_trials(deepcopy=False), 1)

    # ------------------------------------------------------------------ dispatch

    def _submit(
        self, attempt_number: int, trial_id: int, submits: int, with_base: bool = False
    ) -> Future:
        import pickle

        from clusterkit.runners.hpo.worker import run_trial

        sampler = self.study.sampler
        sampler.reseed_rng()  # fixed in the pickle: a Dask re-run proposes the same values
        self._keys += 1
        key = f"hpo-{self.topic[-12:]}-{attempt_number}-{submits}-{self._keys}"
        delta, base = self.log.delta(with_base)  # pickled now, on this thread
        future = self.client.submit(
            run_trial,
            self.blob,
            pickle.dumps(sampler),
            delta,
            base,
            self.study.study_name,
            self.directions,
            attempt_number,
            self.topic,
            submits,
            key=key,
            pure=False,
            resources=self.resources,
        )
        self.by_key[key] = attempt_number
        future.add_done_callback(lambda f: self.inbox.put(("done", f)))
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
        workers = info["workers"]
        self._slots_value = max(1, count_slots(workers.values(), self.resources))
        self.log.resize(self._slots_value)
        self.log.set_live({a for a, w in workers.items() if count_slots([w], self.resources)})

    def _fill(self) -> None:
        while (
            len(self.inflight) < self._slots_value
            and self.done + len(self.inflight) < self.n_trials
            and (self.deadline is None or time.monotonic() < self.deadline)
        ):
            trial = self.study.ask()
            self.log.add(self.study._storage.get_trial(trial._trial_id))
            self.inflight[trial.number] = Attempt(
                trial.number, trial._trial_id, self._submit(trial.number, trial._trial_id, 1)
            )
        self._refresh_slots()  # after dispatching, so the RPC never delays a trial

    def loop(self) -> None:
        self.client.subscribe_topic(self.topic, lambda event: self.inbox.put(("event", event[1])))
        try:
            self._slots_value = max(1, slots(self.client, self.resources))
            self._slots_at = time.monotonic()
            self.log.resize(self._slots_value)
            self._fill()
            self._report()
            while self.inflight:
                try:
                    kind, item = self.inbox.get(timeout=1.0)
                except queue.Empty:
                    self._check_cluster()
                    continue
                began = time.perf_counter()
                if kind == "done":
                    self._finished(item)
                    self._fill()  # after a retry or a failure
                else:
                    self._event(item)
                if self.inbox.empty() or time.monotonic() - self._reported_at > 0.25:
                    self._report()
                self.overhead += time.perf_counter() - began
        finally:
            self.client.unsubscribe_topic(self.topic)
            self._abandon()
            flush_storage(self.study._storage)
            self.log.close(self.topic)

    def _report(self) -> None:
        """Make every write durable, then show progress (see :mod:`.storage`)."""
        flush_storage(self.study._storage)
        self._reported_at = time.monotonic()
        self._show()

    def _check_cluster(self) -> None:
        """A client whose scheduler is gone closes itself (after its timeout): stop, resumably."""
        if self.client.status in ("closing", "closed"):
            raise ClusterkitError(
                f"lost the cluster mid-search ({self.done} of {self.n_trials} trials finished); "
                "every reported result is in the study",
                hint="bring the cluster back and run the same search (same storage and study "
                "name) to resume",
            )

    # ------------------------------------------------------------------ events from workers

    def _event(self, msg: dict[str, Any]) -> None:
        attempt = self.inflight.get(msg.get("number", -1))
        if attempt is None:
            return
        storage, trial_id = self.study._storage, attempt.trial_id
        kind = msg["kind"]
        if kind == "start":
            attempt.starts += 1
            attempt.workers.append(msg["worker"])
            self.log.ack(msg["worker"], msg["version"])
            if max(attempt.starts, attempt.submits) > 1 + self.max_retries:
                attempt.future.cancel()
                self._fail_lost(attempt, "its worker died")
                self._fill()
            return
        if kind == "result":
            if msg.get("attempt") == attempt.submits and not msg.get("via_future"):
                record = json.loads(msg["record"])
                record["intermediate"] = {int(k): v for k, v in record["intermediate"].items()}
                record["exception"] = msg.get("exception")
                self._complete(attempt, record)
            return
        try:
            if kind == "param":
                from optuna.distributions import json_to_distribution

                dist = json_to_distribution(msg["dist"])
                storage.set_trial_param(trial_id, msg["name"], msg["value"], dist)
            elif kind == "value":
                storage.set_trial_intermediate_value(trial_id, msg["step"], msg["value"])
            elif kind == "user_attr":
                storage.set_trial_user_attr(trial_id, msg["key"], msg["value"])
            elif kind == "prune":
                self._answer_prune(attempt, msg)
        except Exception as error:  # a write racing the trial's end must not stop the search
            logger.debug("ignored %s message for trial %s: %s", kind, attempt.number, error)

    def _answer_prune(self, attempt: Attempt, msg: dict[str, Any]) -> None:
        storage = self.study._storage
        frozen = storage.get_trial(attempt.trial_id)
        for step, value in msg["intermediate"]:
            if step not in frozen.intermediate_values:
                storage.set_trial_intermediate_value(attempt.trial_id, step, value)
        decision = bool(self.study.pruner.prune(self.study, storage.get_trial(attempt.trial_id)))
        flush_storage(storage)  # an answer is a report: what it was decided on is durable first
        scheduler: Any = self.client.scheduler
        self.client.sync(scheduler.queue_put, name=msg["reply"], data=decision)

    # ------------------------------------------------------------------ results

    def _finished(self, future: Future) -> None:
        number = self.by_key.pop(future.key, -1)
        attempt = self.inflight.get(number)
        if attempt is None or attempt.future.key != future.key:
            return  # a cancelled or superseded attempt
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
        error = None if future.status == "cancelled" else future.exception()
        if error is not None and not is_lost_worker(error):
            self._tell(attempt, "FAIL", error=f"{type(error).__name__}: {error}")
            raise error
        tries = max(attempt.starts, attempt.submits)
        if tries > self.max_retries:
            self._fail_lost(attempt, f"its worker was lost ({type(error).__name__})")
            return
        attempt.submits = tries + 1
        logger.info("trial %s lost its worker; retry %s", number, attempt.submits - 1)
        attempt.future = self._submit(attempt.number, attempt.trial_id, attempt.submits)

    def _complete(self, attempt: Attempt, record: dict[str, Any]) -> None:
        # Free the slot and dispatch before the (storage-bound) bookkeeping of this result.
        self.inflight.pop(attempt.number, None)
        self.done += 1
        self._fill()
        self._record(attempt, record)

    def _fail_lost(self, attempt: Attempt, why: str) -> None:
        tries = max(attempt.starts, attempt.submits)
        self._tell(attempt, "FAIL", error=f"trial failed after {tries} attempts: {why}")

    def _record(self, attempt: Attempt, record: dict[str, Any]) -> None:
        """Apply the worker's authoritative record, then tell the study."""
        import cloudpickle
        from optuna.distributions import json_to_distribution

        storage, trial_id = self.study._storage, attempt.trial_id
        frozen = storage.get_trial(trial_id)
        for name, value in record["params"].items():
            if name not in frozen.params:
                dist = json_to_distribution(record["distributions"][name])
                storage.set_trial_param(trial_id, name, value, dist)
        for step, value in record["intermediate"].items():
            if step not in frozen.intermediate_values:
                storage.set_trial_intermediate_value(trial_id, step, value)
        for key, value in record["user_attrs"].items():
            if frozen.user_attrs.get(key) != value:
                storage.set_trial_user_attr(trial_id, key, value)
        storage.set_trial_user_attr(trial_id, inputs.ATTR_WORKER, record["worker"])
        storage.set_trial_user_attr(trial_id, inputs.ATTR_TIME, [record["start"], record["end"]])
        self._tell(attempt, record["state"], record["values"], record["error"])
        if record["state"] == "FAIL" and record["exception"] is not None:
            error = cloudpickle.loads(record["exception"])
            if not isinstance(error, self.catch):
                raise error

    def _tell(self, attempt: Attempt, state: str, values: Any = None, error: str | None = None):
        from optuna.trial import TrialState

        storage = self.study._storage
        tries = max(attempt.starts, attempt.submits)
        if tries > 1:  # each attribute is a storage write; keep the common case at none
            storage.set_trial_user_attr(attempt.trial_id, inputs.ATTR_ATTEMPTS, tries)
        if error:
            storage.set_trial_user_attr(attempt.trial_id, inputs.ATTR_ERROR, error)
            logger.warning("trial %s failed: %s", attempt.number, error)
        if state == "COMPLETE":
            self.study.tell(attempt.number, values)
        else:
            self.study.tell(attempt.number, state=TrialState[state])
        self.log.add(storage.get_trial(attempt.trial_id))
        if self.inflight.pop(attempt.number, None) is not None:
            self.done += 1

    def _abandon(self) -> None:
        """On an early exit, cancel what runs and leave it for the next run to resume."""
        if not self.inflight:
            return
        for attempt in self.inflight.values():
            attempt.future.cancel()
        self.inflight.clear()
        inputs.recover_orphans(self.study)

    def _show(self) -> None:
        if self.display is not None:
            busy = len({a.workers[-1] for a in self.inflight.values() if a.workers})
            self.display.update(self.study, len(self.inflight), busy, self.n_trials)


def run(
    objective: Callable[[optuna.Trial], Any],
    *,
    n_trials: int,
    client: Client | None = None,
    study: optuna.Study | None = None,
    storage: Any = None,
    study_name: str | None = None,
    direction: str = "minimize",
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    resources: Mapping[str, float] | None = None,
    max_retries: int = 2,
    catch: tuple[type[BaseException], ...] = (Exception,),
    timeout: float | None = None,
    progress: bool = True,
    out: str | None = None,
    workdir: Any = "auto",
) -> optuna.Study:
    """Run an Optuna search with every worker slot busy until ``n_trials`` trials finished.

    Parameters
    ----------
    objective
        A plain Optuna objective ``f(trial) -> float``; it runs on the workers.
    n_trials
        Total finished trials (complete, pruned or failed) the study must hold, counting those
        of earlier runs of the same study.
    client
        A ``distributed.Client``; default :func:`clusterkit.get_client`.
    study, storage, study_name, direction, sampler, pruner
        An existing study, or what to create/load it from. Storage is any Optuna storage, a
        database URL or a journal file path; default ``./<study_name>.optuna.log``.
    resources
        Dask resources each trial needs, e.g. ``{"GPU": 1}``; slots are counted in them.
    max_retries
        Re-runs of a trial whose worker died before it is marked failed.
    catch
        Objective exceptions that fail only their trial; others stop the search and re-raise.
    timeout
        Seconds after which no new trial starts; running trials finish.
    progress
        Show a live progress display and the best trials on the terminal.
    out
        Folder for ``trials.csv`` and the plots (HTML and PNG).
    workdir
        The project directory trials run in (working directory, first on ``sys.path``): in
        place where a worker sees it at the same path, else a synced copy. ``"auto"``: the
        current directory when the objective's module lives under it; None: off.
    """
    import cloudpickle
    import optuna

    if n_trials < 1:
        raise BadInput(f"n_trials must be at least 1, got {n_trials}")
    if max_retries < 0:
        raise BadInput(f"max_retries must be 0 or more, got {max_retries}")
    if study is None:
        name = study_name or inputs.default_study_name(objective)
        study = optuna.create_study(
            storage=inputs.resolve_storage(storage, name),
            study_name=name,
            direction=direction,  # type: ignore[arg-type]  # optuna validates the string
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
    if client is None:
        from clusterkit.client import get_client

        client = get_client()
    from clusterkit.runners.workdir import in_project

    objective = in_project(client, objective, workdir)
    check_resources(client, resources)
    if slots(client, resources) == 0:
        client.wait_for_workers(1)
    inputs.recover_orphans(study)
    display = None
    if progress:
        from clusterkit.runners.hpo.report import ProgressDisplay

        display = ProgressDisplay(n_trials)
    driver = _Driver(
        study,
        client,
        cloudpickle.dumps(objective),
        n_trials,
        resources,
        max_retries,
        tuple(catch),
        timeout,
        display,
    )
    try:
        driver.loop()
    finally:
        if display is not None:
            display.close()
        if hasattr(objective, "warnings_summary"):  # each warning once, with a count
            objective.warnings_summary("trials")
    LAST_RUN_STATS.update(overhead_s=driver.overhead, trials=driver.done)
    if out is not None:
        from clusterkit.runners.hpo.report import write_results

        write_results(study, out)
    if progress:
        from clusterkit.runners.hpo.report import print_best

        print_best(study)
    return study


def best_summary(study: optuna.Study) -> str:
    """One line with the best trial, or why there is none."""
    try:
        best = study.best_trial
    except ValueError:
        return "no trial completed"
    value = best.value if best.value is not None else math.nan
    return f"best trial #{best.number}: value {value:.6g}, params {best.params}"
