"""What the driver writes to the study from the workers' messages and records."""

from __future__ import annotations

import logging
import math
import pickle
from typing import Any

from clusterkit.errors import ClusterkitError, fit
from clusterkit.runners.hpo import inputs

logger = logging.getLogger(__name__)


class NoTrialCompleted(ClusterkitError):
    """A search that ended with no completed trial; ``cause``: the first failure's one line."""

    def __init__(self, message: str, *, cause: str | None, study: Any = None) -> None:
        self.cause = cause
        self.study = study
        super().__init__(message)


def check_completed(study: Any) -> None:
    """Raise :class:`NoTrialCompleted` when the study holds no completed trial, naming how its
    trials ended and the first failure's cause (as ``study.optimize`` re-raises it)."""
    from optuna.trial import TrialState

    ended = [t for t in study.get_trials(deepcopy=False) if inputs.counted(t)]
    if any(t.state == TrialState.COMPLETE for t in ended):
        return
    failed = [t for t in ended if t.state == TrialState.FAIL]
    pruned = sum(t.state == TrialState.PRUNED for t in ended)
    if failed:
        first = min(
            failed, key=lambda t: (t.datetime_complete is None, t.datetime_complete, t.number)
        )
        cause = fit(str(first.user_attrs.get(inputs.ATTR_ERROR) or "no error recorded"))
        how = f"{len(failed)} of {len(ended)} failed" + (f", {pruned} pruned" if pruned else "")
        raise NoTrialCompleted(
            f"no trial completed: {how}; the first, trial #{first.number}: {cause}",
            cause=cause,
            study=study,
        )
    why = f"all {pruned} pruned" if pruned else "none finished"
    raise NoTrialCompleted(f"no trial completed: {why}", cause=None, study=study)


def apply_write(storage: Any, trial_id: int, msg: dict[str, Any]) -> None:
    """A running trial's parameter, intermediate value, user or system attribute, as the worker
    set it."""
    kind = msg["kind"]
    if kind == "param":
        from optuna.distributions import json_to_distribution

        dist = json_to_distribution(msg["dist"])
        storage.set_trial_param(trial_id, msg["name"], msg["value"], dist)
    elif kind == "value":
        storage.set_trial_intermediate_value(trial_id, msg["step"], msg["value"])
    elif kind in ("user_attr", "system_attr"):
        value = pickle.loads(msg["value"]) if msg.get("pickled") else msg["value"]
        setter = getattr(storage, f"set_trial_{kind}")
        setter(trial_id, msg["key"], value)


def refusal(values: Any, objectives: int) -> str | None:
    """Why Optuna will fail a trial whose objective returned ``values`` (it logs why, and
    records it nowhere): the count of values against the study's objectives, or a value that is
    no number or is NaN; None when it takes them."""
    from collections.abc import Sequence

    many = isinstance(values, Sequence) and not isinstance(values, str)
    given = list(values) if many else [values]
    if len(given) != objectives:
        return (
            f"the objective returned {len(given)} value{'s' * (len(given) != 1)} for a study of "
            f"{objectives} objective{'s' * (objectives != 1)} (set its directions: "
            "--directions minimize maximize, or hpo.run(directions=...))"
        )
    for value in given:
        try:
            number = float(value)
        except (TypeError, ValueError):
            return f"the objective returned {value!r}, which is not a number"
        if math.isnan(number):
            return "the objective returned NaN"
    return None


def tell(study: Any, storage: Any, attempt: Any, state: str, values: Any, error: Any) -> Any:
    """Tell ``study`` how trial ``attempt`` ended (a state's name; its values when COMPLETE),
    recording its attempts and failure's cause, Optuna's refusal of its values included; the
    trial as it is now."""
    from optuna.trial import TrialState

    trial_id = attempt.trial_id
    if attempt.attempts > 1:  # each attribute is a storage write; the common case: none
        storage.set_trial_user_attr(trial_id, inputs.ATTR_ATTEMPTS, attempt.attempts)
    if state == "COMPLETE":
        error = error or refusal(values, len(study.directions))  # Optuna only logs it
    if error:
        storage.set_trial_user_attr(trial_id, inputs.ATTR_ERROR, error)
        logger.warning("trial %s failed: %s", attempt.number, fit(error))
    if state == "COMPLETE":
        study.tell(attempt.number, values)
    else:
        study.tell(attempt.number, state=TrialState[state])
    return storage.get_trial(trial_id)


def decide_prune(study: Any, storage: Any, trial_id: int, intermediate: Any) -> bool:
    """The pruner's verdict on the trial with these intermediate values recorded."""
    add_intermediate(storage, trial_id, intermediate)
    return bool(study.pruner.prune(study, storage.get_trial(trial_id)))


def add_intermediate(storage: Any, trial_id: int, values: Any) -> None:
    """``(step, value)`` pairs the study does not hold yet."""
    frozen = storage.get_trial(trial_id)
    for step, value in values:
        if step not in frozen.intermediate_values:
            storage.set_trial_intermediate_value(trial_id, step, value)


def apply_record(storage: Any, trial_id: int, record: dict[str, Any]) -> None:
    """The worker's authoritative record of a finished trial, before the study is told."""
    from optuna.distributions import json_to_distribution

    frozen = storage.get_trial(trial_id)
    for name, value in record["params"].items():
        if name not in frozen.params:
            dist = json_to_distribution(record["distributions"][name])
            storage.set_trial_param(trial_id, name, value, dist)
    add_intermediate(storage, trial_id, record["intermediate"].items())
    for key, value in record["user_attrs"].items():
        if frozen.user_attrs.get(key) != value:
            storage.set_trial_user_attr(trial_id, key, value)
    for key, value in record.get("system_attrs", {}).items():
        if frozen.system_attrs.get(key) != value:
            storage.set_trial_system_attr(trial_id, key, value)
    storage.set_trial_user_attr(trial_id, inputs.ATTR_WORKER, record["worker"])
    storage.set_trial_user_attr(trial_id, inputs.ATTR_TIME, [record["start"], record["end"]])


def best_summary(study: Any) -> str:
    """One line of data: ``best: trial #N, value V, params {...}`` (the Pareto front's trials,
    multi-objective), or ``best: none (no trial completed)``."""
    if len(study.directions) > 1:
        front = sorted(study.best_trials, key=lambda t: t.number)
        if not front:
            return "best: none (no trial completed)"
        shown = "; ".join(
            f"#{t.number} values {[float(f'{v:.6g}') for v in t.values]}" for t in front
        )
        return f"best: the Pareto front ({len(front)}): {shown}"
    try:
        best = study.best_trial
    except ValueError:
        return "best: none (no trial completed)"
    value = best.value if best.value is not None else math.nan
    return f"best: trial #{best.number}, value {value:.6g}, params {best.params}"
