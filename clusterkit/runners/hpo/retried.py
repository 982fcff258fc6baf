"""Optuna's retry convention on a live trial, and the number a trial's checkpoints go under.

Optuna users resume a retried trial from its checkpoint with
``RetryFailedTrialCallback.retried_trial_number(trial)`` (Optuna's ``pytorch_checkpoint.py``
example): the number of the trial that first ran these parameters, None on a first run. It reads
``trial.system_attrs``, which Optuna 5 no longer has on a live ``optuna.Trial``: the call raises
AttributeError even under ``study.optimize``. The trial a clusterkit objective gets has it, with
``failed_trial`` and ``retry_history`` set when this run is a retry: the same trial (same number)
run again after its worker died or it saved a checkpoint, or a trial asked again with the
parameters of one a dead driver left running (``ck_retry_of``: its checkpoints are under that
first number, for ``hpo.checkpoint_dir`` too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optuna

from clusterkit.runners.hpo.inputs import ATTR_RETRY_OF


def series_number(number: int, user_attrs: Mapping[str, Any]) -> int:
    """The trial that first ran these parameters: ``number``, or the one a dead driver left."""
    return int(user_attrs.get(ATTR_RETRY_OF, number))


class RetryAwareTrial(optuna.Trial):
    """An ``optuna.Trial`` with the ``system_attrs`` Optuna's retry helpers read; ``is_retry``
    says (when asked) whether this run of the trial follows an earlier one."""

    def __init__(self, study: optuna.Study, trial_id: int, is_retry: Callable[[], bool]) -> None:
        super().__init__(study, trial_id)
        self._is_retry = is_retry

    @property
    def system_attrs(self) -> dict[str, Any]:
        attrs = dict(self.storage.get_trial_system_attrs(self._trial_id))
        first = series_number(self.number, self.user_attrs)
        if first != self.number or self._is_retry():
            attrs.setdefault("failed_trial", first)
            attrs.setdefault("retry_history", [first])
        return attrs


def rerun_by_dask() -> bool:
    """In a task: whether Dask runs it again because a worker running it died (the scheduler's
    count of such deaths; a graceful close is not counted)."""
    from distributed import get_client, get_worker

    key = get_worker().get_current_task()
    return bool(get_client().run_on_scheduler(_deaths, key))


def _deaths(key: Any, dask_scheduler: Any = None) -> int:
    task = dask_scheduler.tasks.get(key)
    return 0 if task is None else int(task.suspicious)
