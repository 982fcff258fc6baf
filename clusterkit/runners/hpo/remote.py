"""A trial's storage calls answered by the driver: what a worker cannot serve from its mirror.

A worker serves its running trial's writes and the study's trials itself (:mod:`.mirror`); the
rest of Optuna's storage (the study's attributes, read current and set, another study, a trial
the objective asked or enqueued itself) goes to the driver's storage as one call: the method's
name and arguments, pickled, on the search's event topic; the answer (the value, or the
exception Optuna's storage raised, which the worker raises again) on a scheduler Queue.
"""

from __future__ import annotations

import pickle
from typing import Any

#: Optuna's storage methods a trial may call on the driver's storage.
CALLS = frozenset(
    {
        "create_new_study",
        "delete_study",
        "set_study_user_attr",
        "set_study_system_attr",
        "get_study_id_from_name",
        "get_study_name_from_id",
        "get_study_directions",
        "get_study_user_attrs",
        "get_study_system_attrs",
        "get_all_studies",
        "create_new_trial",
        "set_trial_param",
        "get_trial_id_from_study_id_trial_number",
        "set_trial_state_values",
        "set_trial_intermediate_value",
        "set_trial_user_attr",
        "set_trial_system_attr",
        "get_trial",
        "get_all_trials",
    }
)
#: Calls that change a trial: the driver logs it again, so every mirror sees the change.
TRIAL_WRITES = frozenset(
    {
        "create_new_trial",
        "set_trial_param",
        "set_trial_state_values",
        "set_trial_intermediate_value",
        "set_trial_user_attr",
        "set_trial_system_attr",
    }
)


def request(method: str, args: tuple[Any, ...]) -> bytes:
    """A call as it travels: pickled, so Optuna's types (directions, templates) survive."""
    if method not in CALLS:
        raise AttributeError(f"{method!r} is not a storage call a trial can make of the driver")
    return pickle.dumps((method, args))


def answer(storage: Any, blob: bytes) -> tuple[str, tuple[Any, ...], Any, bytes]:
    """Run a call on the driver's ``storage``: its method, arguments, result (None after an
    error) and the answer to send, ``(True, value)`` or ``(False, exception)`` pickled."""
    method, args = pickle.loads(blob)
    if method not in CALLS:
        error: BaseException = AttributeError(f"{method!r} is not a storage call")
        return method, args, None, pickle.dumps((False, error))
    try:
        result = getattr(storage, method)(*args)
    except Exception as raised:
        return method, args, None, _raised(raised)
    try:
        return method, args, result, pickle.dumps((True, result))
    except Exception as unpicklable:
        return method, args, None, _raised(unpicklable)


def _raised(error: Exception) -> bytes:
    try:
        return pickle.dumps((False, error))
    except Exception:  # an exception that does not pickle still says what it was
        return pickle.dumps((False, RuntimeError(f"{type(error).__name__}: {error}")))


def result(reply: bytes) -> Any:
    """The value of an answered call, or the driver's exception raised here."""
    ok, value = pickle.loads(reply)
    if not ok:
        raise value
    return value


def changed_trial(
    storage: Any, study_id: int, method: str, args: tuple[Any, ...], value: Any
) -> Any:
    """The trial of study ``study_id`` that a call changed, as it is now (None: it changed no
    trial of that study)."""
    if method not in TRIAL_WRITES:
        return None
    trial_id = int(value) if method == "create_new_trial" else int(args[0])
    try:
        frozen = storage.get_trial(trial_id)
        found = storage.get_trial_id_from_study_id_trial_number(study_id, frozen.number)
    except KeyError:
        return None
    return frozen if found == trial_id else None
