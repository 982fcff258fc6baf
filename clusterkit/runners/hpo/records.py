"""What the driver writes to the study from the workers' messages and records."""

from __future__ import annotations

import math
from typing import Any

from clusterkit.runners.hpo import inputs


def apply_write(storage: Any, trial_id: int, msg: dict[str, Any]) -> None:
    """A running trial's parameter, intermediate value or user attribute, as the worker set it."""
    kind = msg["kind"]
    if kind == "param":
        from optuna.distributions import json_to_distribution

        dist = json_to_distribution(msg["dist"])
        storage.set_trial_param(trial_id, msg["name"], msg["value"], dist)
    elif kind == "value":
        storage.set_trial_intermediate_value(trial_id, msg["step"], msg["value"])
    elif kind == "user_attr":
        storage.set_trial_user_attr(trial_id, msg["key"], msg["value"])


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
    storage.set_trial_user_attr(trial_id, inputs.ATTR_WORKER, record["worker"])
    storage.set_trial_user_attr(trial_id, inputs.ATTR_TIME, [record["start"], record["end"]])


def best_summary(study: Any) -> str:
    """One line with the best trial, or why there is none."""
    try:
        best = study.best_trial
    except ValueError:
        return "no trial completed"
    value = best.value if best.value is not None else math.nan
    return f"best trial #{best.number}: value {value:.6g}, params {best.params}"
