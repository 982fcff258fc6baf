"""Worker side of the HPO runner: run one trial against a local mirror of the study."""

from __future__ import annotations

import functools
import json
import pickle
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import cloudpickle
import optuna
from optuna.distributions import distribution_to_json
from optuna.pruners import BasePruner, HyperbandPruner
from optuna.trial import FrozenTrial, TrialState

from clusterkit.runners.hpo import cores, preemption, remote, warmup
from clusterkit.runners.hpo.mirror import StudyFacts, StudyMirror, TrialView, mirror_for
from clusterkit.runners.hpo.preemption import TrialInterrupted
from clusterkit.runners.hpo.retried import RetryAwareTrial, rerun_by_dask

#: How long a worker waits for the driver's pruning decision before failing the trial.
PRUNE_REPLY_TIMEOUT = 300.0


class Channel:
    """Messages from one trial on a worker to the driver, over the scheduler connection.

    Writes are fire-and-forget ``log_event`` messages on the worker's batched stream (they keep
    their order); questions (``should_prune``, a storage call the worker cannot serve) wait, one
    at a time, on a scheduler Queue that the driver answers.
    """

    def __init__(self, topic: str, number: int, attempt: int) -> None:
        from distributed import get_worker

        self.worker = get_worker()
        self.topic = topic
        self.number = number
        self.attempt = attempt  # the driver's submission count, to drop superseded messages
        self.reply_name = f"{topic}-reply-{number}-{attempt}"
        self._queue: Any = None
        self._asking = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:  # a pickled trial's storage, in the same worker
        return (Channel, (self.topic, self.number, self.attempt))

    def send(self, kind: str, **fields: Any) -> None:
        message = {"kind": kind, "number": self.number, "attempt": self.attempt, **fields}
        self.worker.log_event(self.topic, message)

    def forward_write(self, kind: str, **fields: Any) -> None:
        """A write to the running trial, as the driver applies it to the study."""
        if "dist" in fields:
            fields["dist"] = distribution_to_json(fields["dist"])
        self.send(kind, **fields)

    def ask(self, kind: str, **fields: Any) -> Any:
        """The driver's answer to a question (one at a time per trial)."""
        from distributed import Queue

        with self._asking:
            if self._queue is None:  # created before the request so the answer cannot be lost
                self._queue = Queue(self.reply_name)
            self.send(kind, reply=self.reply_name, **fields)
            return self._queue.get(timeout=PRUNE_REPLY_TIMEOUT)

    def ask_prune(self, intermediate: dict[int, float]) -> bool:
        values = [[int(k), float(v)] for k, v in intermediate.items()]
        return bool(self.ask("prune", intermediate=values))

    def call(self, method: str, *args: Any) -> Any:
        """A storage call on the driver's storage (:mod:`.remote`): its value, or its error."""
        return remote.result(self.ask("call", request=remote.request(method, args)))

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()


class DriverPruner(BasePruner):
    """Asks the driver, which prunes on the study's current intermediate values."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.channel.ask_prune(dict(trial.intermediate_values))


class DriverHyperband(HyperbandPruner):
    """The study's Hyperband pruner, as a trial's sampler sees it (the trials of its bracket
    only, as under ``study.optimize``); its decisions are the driver's."""

    def __init__(self, base: HyperbandPruner, channel: Channel) -> None:
        vars(self).update(vars(base))
        self.channel = channel

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.channel.ask_prune(dict(trial.intermediate_values))


def _pruner(facts: StudyFacts, channel: Channel) -> BasePruner:
    if facts.bracket_pruner is not None:
        return DriverHyperband(facts.bracket_pruner, channel)
    return DriverPruner(channel)


def _is_retry(attempt: int) -> bool:
    """Whether this run of the trial follows another: the driver's re-submission, or Dask's
    re-run after a worker running it died."""
    return attempt > 1 or rerun_by_dask()


@functools.lru_cache(maxsize=4)
def _load_objective(blob: bytes) -> Any:
    with warmup.IMPORTING:  # not while the warm-up imports the same modules
        return cloudpickle.loads(blob)


def run_trial(
    objective_blob: bytes,
    sampler_blob: bytes,
    delta_blob: bytes,
    base: Any,
    study_blob: bytes,
    number: int,
    topic: str,
    attempt: int,
    carry: bool = False,
) -> dict[str, Any]:
    """Run trial ``number`` of the study on this worker and return its full record.

    ``delta_blob``, ``base``: the study's changes for the mirror (:mod:`.mirror`); a mirror
    too old for them returns ``{"stale": True}``. ``study_blob``: the pickled
    :class:`~.mirror.StudyFacts`. The sampler's random state is fixed by the driver, so a
    re-run of this task (its worker died) proposes the same parameters; ``carry``: the record
    brings the sampler back, as the trial left it (the driver samples on from it).
    """
    channel = Channel(topic, number, attempt)
    mirror = mirror_for(topic)
    since, changes = pickle.loads(delta_blob)
    objective = _load_objective(objective_blob)
    ending = preemption.hold_if_ending(channel.worker, getattr(objective, "lead", 0.0))
    if ending or not mirror.update(since, changes, base):  # stale: (its worker is) gone
        return {"stale": True, "number": number, "worker": channel.worker.address}
    start = time.time()
    channel.send("start", worker=channel.worker.address, time=start, version=mirror.version)
    study, own = _trial_study(channel, mirror, number, sampler_blob, study_blob, carry)
    record: dict[str, Any] = {"number": number, "error": None, "exception": None, "values": None}
    try:
        is_retry = functools.partial(_is_retry, attempt)
        result = cores.call(objective, RetryAwareTrial(study, own._trial_id, is_retry))
        record["state"] = TrialState.COMPLETE.name
        record["values"] = result
    except optuna.TrialPruned:
        record["state"] = TrialState.PRUNED.name
    except TrialInterrupted:  # checkpointed, its worker ending: the driver runs it again
        raise
    except Exception as error:
        record["state"] = TrialState.FAIL.name
        record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        record["traceback"] = traceback.format_exc()
        try:
            record["exception"] = cloudpickle.dumps(error)
        except Exception:  # an unpicklable exception still leaves its text
            record["exception"] = None
    finally:
        channel.close()
    record.update(_written(own), worker=channel.worker.address, start=start)
    record["end"] = time.time()
    record["sampler"] = cloudpickle.dumps(study.sampler) if carry else None
    _send_result(channel, record)
    return record


def _trial_study(
    channel: Channel,
    mirror: StudyMirror,
    number: int,
    sampler_blob: bytes,
    study_blob: bytes,
    carry: bool,
) -> tuple[optuna.Study, FrozenTrial]:
    """The study as trial ``number`` sees it here (:class:`~.mirror.TrialView`), and the trial.
    ``carry``: the sampler is the driver's own, maybe unseeded: a re-run takes what its first
    run drew."""
    facts: StudyFacts = pickle.loads(study_blob)
    drawn = mirror.trials[number]
    if carry and rerun_by_dask():
        drawn = channel.call("get_trial", drawn._trial_id)
    storage = TrialView(mirror, drawn, facts, channel.forward_write, channel.call)
    sampler = pickle.loads(sampler_blob)
    study = optuna.Study(facts.name, storage, sampler=sampler, pruner=_pruner(facts, channel))
    setattr(study, "stop", functools.partial(channel.send, "stop"))  # noqa: B010  the search's
    assert storage.own is not None
    return study, storage.own


def _written(frozen: FrozenTrial) -> dict[str, Any]:
    """What the trial wrote: its parameters, their distributions, intermediate values, user
    and system attributes, as the driver's record of it carries them."""
    internal = {k: frozen.distributions[k].to_internal_repr(v) for k, v in frozen.params.items()}
    return {
        "params": internal,
        "distributions": {k: distribution_to_json(d) for k, d in frozen.distributions.items()},
        "intermediate": {int(k): float(v) for k, v in frozen.intermediate_values.items()},
        "user_attrs": dict(frozen.user_attrs),
        "system_attrs": dict(frozen.system_attrs),
    }


def _plain(values: Any) -> float | list[float]:
    if isinstance(values, Sequence) and not isinstance(values, str):
        return [float(v) for v in values]
    return float(values)


def _send_result(channel: Channel, record: dict[str, Any]) -> None:
    """Send the record on the event stream, which reaches the driver before the task's own
    completion and saves it a gather round trip; what JSON cannot carry goes by the result."""
    message = {k: v for k, v in record.items() if k not in ("exception", "sampler")}
    try:
        if record["values"] is not None:
            message["values"] = _plain(record["values"])
        text = json.dumps(message)
    except (TypeError, ValueError):
        channel.send("result", via_future=True)
        return
    channel.send("result", record=text, exception=record["exception"], sampler=record["sampler"])
