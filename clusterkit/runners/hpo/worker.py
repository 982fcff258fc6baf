"""Worker side of the HPO runner: run one trial against a local mirror of the study."""

from __future__ import annotations

import functools
import json
import logging
import pickle
import time
import traceback
from collections.abc import Sequence
from typing import Any

import cloudpickle
import optuna
from optuna.distributions import distribution_to_json
from optuna.pruners import BasePruner
from optuna.storages import InMemoryStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

#: How long a worker waits for the driver's pruning decision before failing the trial.
PRUNE_REPLY_TIMEOUT = 300.0


class Channel:
    """Messages from one trial on a worker to the driver, over the scheduler connection.

    Writes are fire-and-forget ``log_event`` messages on the worker's batched stream (they keep
    their order); the one synchronous question, ``should_prune``, waits on a scheduler Queue
    that the driver answers.
    """

    def __init__(self, topic: str, number: int, attempt: int) -> None:
        from distributed import get_worker

        self.worker = get_worker()
        self.topic = topic
        self.number = number
        self.attempt = attempt  # the driver's submission count, to drop superseded messages
        self.reply_name = f"{topic}-reply-{number}-{attempt}"
        self._queue: Any = None

    def send(self, kind: str, **fields: Any) -> None:
        message = {"kind": kind, "number": self.number, "attempt": self.attempt, **fields}
        self.worker.log_event(self.topic, message)

    def ask_prune(self, intermediate: dict[int, float]) -> bool:
        from distributed import Queue

        if self._queue is None:  # created before the request so the answer cannot be lost
            self._queue = Queue(self.reply_name)
        values = [[int(k), float(v)] for k, v in intermediate.items()]
        self.send("prune", reply=self.reply_name, intermediate=values)
        return bool(self._queue.get(timeout=PRUNE_REPLY_TIMEOUT))

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()


class MirrorStorage(InMemoryStorage):
    """In-memory copy of the study; writes to the running trial are also sent to the driver."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel
        self.tracked_id = -1

    def adopt_trial(self, study_id: int, trial: FrozenTrial) -> int:
        """``create_new_trial(template_trial=trial)`` without its deep copy: the snapshot was
        unpickled for this storage alone, and copying it was most of a dispatch's cost."""
        try:
            with self._lock:
                trial_id = self._max_trial_id + 1
                self._max_trial_id = trial_id
                trial.number = len(self._studies[study_id].trials)
                trial._trial_id = trial_id
                self._trial_id_to_study_id_and_number[trial_id] = (study_id, trial.number)
                self._studies[study_id].trials.append(trial)
                self._update_cache(trial_id, study_id)
                return trial_id
        except AttributeError:  # Optuna changed its internals: take the public, slower path
            return self.create_new_trial(study_id, template_trial=trial)

    def set_trial_param(
        self, trial_id: int, param_name: str, param_value_internal: float, distribution: Any
    ) -> None:
        super().set_trial_param(trial_id, param_name, param_value_internal, distribution)
        if trial_id == self.tracked_id:
            self.channel.send(
                "param",
                name=param_name,
                value=param_value_internal,
                dist=distribution_to_json(distribution),
            )

    def set_trial_intermediate_value(self, trial_id: int, step: int, value: float) -> None:
        super().set_trial_intermediate_value(trial_id, step, value)
        if trial_id == self.tracked_id:
            self.channel.send("value", step=int(step), value=float(value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        super().set_trial_user_attr(trial_id, key, value)
        if trial_id == self.tracked_id:
            self.channel.send("user_attr", key=key, value=value)


class DriverPruner(BasePruner):
    """Asks the driver, which prunes on the study's current intermediate values."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.channel.ask_prune(dict(trial.intermediate_values))


@functools.lru_cache(maxsize=4)
def _load_objective(blob: bytes) -> Any:
    return cloudpickle.loads(blob)


def _build_mirror(
    channel: Channel,
    snapshot: Sequence[FrozenTrial],
    study_name: str,
    directions: Sequence[int],
    number: int,
) -> tuple[MirrorStorage, int]:
    storage = MirrorStorage(channel)
    study_id = storage.create_new_study([StudyDirection(d) for d in directions], study_name)
    local_id = -1
    for frozen in snapshot:  # snapshot is ordered by number, so local numbers match
        trial_id = storage.adopt_trial(study_id, frozen)
        if frozen.number == number:
            local_id = trial_id
    if local_id < 0:
        raise RuntimeError(f"trial {number} is missing from the study snapshot")
    storage.tracked_id = local_id
    return storage, local_id


# The mirror study is created per trial; its creation notice is noise on the worker's log.
logging.getLogger("optuna.storages._in_memory").setLevel(logging.WARNING)


def run_trial(
    objective_blob: bytes,
    sampler_blob: bytes,
    snapshot_blob: bytes,
    study_name: str,
    directions: Sequence[int],
    number: int,
    topic: str,
    attempt: int,
) -> dict[str, Any]:
    """Run trial ``number`` of the study on this worker and return its full record.

    The sampler arrives pickled with its random state fixed by the driver, so a re-run of this
    same task (Dask reschedules it when its worker dies) proposes the same parameters.
    """
    channel = Channel(topic, number, attempt)
    start = time.time()
    channel.send("start", worker=channel.worker.address, time=start)
    objective = _load_objective(objective_blob)
    sampler = pickle.loads(sampler_blob)
    snapshot = pickle.loads(snapshot_blob)
    storage, local_id = _build_mirror(channel, snapshot, study_name, directions, number)
    study = optuna.Study(study_name, storage, sampler=sampler, pruner=DriverPruner(channel))
    record: dict[str, Any] = {"number": number, "error": None, "exception": None, "values": None}
    try:
        result = objective(optuna.Trial(study, local_id))
        record["state"] = TrialState.COMPLETE.name
        record["values"] = result
    except optuna.TrialPruned:
        record["state"] = TrialState.PRUNED.name
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
    frozen = storage.get_trial(local_id)
    record.update(
        params={k: frozen.distributions[k].to_internal_repr(v) for k, v in frozen.params.items()},
        distributions={k: distribution_to_json(d) for k, d in frozen.distributions.items()},
        intermediate={int(k): float(v) for k, v in frozen.intermediate_values.items()},
        user_attrs=dict(frozen.user_attrs),
        worker=channel.worker.address,
        start=start,
        end=time.time(),
    )
    _send_result(channel, record)
    return record


def _plain(values: Any) -> float | list[float]:
    if isinstance(values, Sequence) and not isinstance(values, str):
        return [float(v) for v in values]
    return float(values)


def _send_result(channel: Channel, record: dict[str, Any]) -> None:
    """Send the record on the event stream, which reaches the driver before the task's own
    completion and saves it a gather round trip; what JSON cannot carry goes by the result."""
    message = {k: v for k, v in record.items() if k != "exception"}
    try:
        if record["values"] is not None:
            message["values"] = _plain(record["values"])
        text = json.dumps(message)
    except (TypeError, ValueError):
        channel.send("result", via_future=True)
        return
    channel.send("result", record=text, exception=record["exception"])
