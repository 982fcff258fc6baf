"""The worker's copy of a study, kept current by deltas, and the storage a trial runs against.

Each search (one driver run, one ``topic``) has one :class:`StudyMirror` per worker process,
shared by the worker's threads. The driver keeps a change log of trial snapshots (one when a
trial is asked, one when it finishes); a task carries the log entries from ``since`` to the
log's head, where ``since`` is the oldest version any live worker acknowledged, so a delta holds
about as many entries as trials finished while the task was on its way. A mirror whose version
is below ``since`` (a worker that joined late, restarted, or a resumed driver's new topic) loads
the base snapshot the task carries or, without one, reports itself stale and the driver sends the
task again with the base. Entries are whole trial snapshots keyed by number, so applying one
twice or a newer over an older is harmless.
"""

from __future__ import annotations

import copy
import pickle
import threading
from collections.abc import Container, Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

_MIRRORS: dict[str, StudyMirror] = {}
_REGISTRY_LOCK = threading.Lock()


class StudyMirror:
    """Trials of one study by number, at a version (the count of log entries applied)."""

    def __init__(self) -> None:
        self.trials: dict[int, FrozenTrial] = {}
        self.by_id: dict[int, FrozenTrial] = {}
        self.version = 0
        self.lock = threading.Lock()

    def _put(self, trials: Sequence[FrozenTrial]) -> None:
        for trial in trials:
            self.trials[trial.number] = trial
            self.by_id[trial._trial_id] = trial

    def update(self, since: int, changes: Sequence[bytes], base: Any) -> bool:
        """Apply log entries ``since..since+len(changes)`` (each a pickled trial snapshot,
        unpickled only when this mirror lacks it); False when the mirror is too old.

        ``base`` is ``(version, pickled entries)``, the log up to ``version``, or None. It
        travels pickled: a worker that holds or forwards it never imports Optuna's classes on
        its event loop (a race with a trial importing Optuna failed such transfers).
        """
        with self.lock:
            if self.version < since and base is not None and base[0] > self.version:
                entries = pickle.loads(base[1])  # the base is the log up to its version
                self._put([pickle.loads(entry) for entry in entries[self.version :]])
                self.version = base[0]
            if self.version < since:
                return False
            self._put([pickle.loads(entry) for entry in changes[self.version - since :]])
            self.version = max(self.version, since + len(changes))
            return True

    def listing(self) -> list[FrozenTrial]:
        with self.lock:
            trials = list(self.trials.values())
        trials.sort(key=lambda t: t.number)
        return trials


def mirror_for(topic: str) -> StudyMirror:
    with _REGISTRY_LOCK:
        return _MIRRORS.setdefault(topic, StudyMirror())


def drop_mirror(topic: str) -> None:
    """Forget a finished search's mirror (run on every worker by the driver at its end)."""
    with _REGISTRY_LOCK:
        _MIRRORS.pop(topic, None)


class TrialView(BaseStorage):
    """A one-study storage: the mirror for every trial but one, the running trial kept here.

    Reads of other trials cost nothing to set up (no copy of the study per trial); writes go to
    the running trial only and are forwarded to ``on_write(kind, **fields)``.
    """

    STUDY_ID = 0

    def __init__(
        self, mirror: StudyMirror, own: FrozenTrial, name: str, directions: Sequence[int], on_write
    ) -> None:
        self.mirror = mirror
        self.own = copy.deepcopy(own)
        self.own.state = TrialState.RUNNING
        self.name = name
        self.directions = [StudyDirection(d) for d in directions]
        self.on_write = on_write

    # -- the study: one, read-only
    def create_new_study(self, directions: Sequence[StudyDirection], study_name=None) -> int:
        raise NotImplementedError("a trial's view holds one study")

    def delete_study(self, study_id: int) -> None:
        raise NotImplementedError("a trial's view holds one study")

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        raise NotImplementedError("study attributes are set on the driver")

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        raise NotImplementedError("study attributes are set on the driver")

    def get_study_id_from_name(self, study_name: str) -> int:
        return self.STUDY_ID

    def get_study_name_from_id(self, study_id: int) -> str:
        return self.name

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return list(self.directions)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return {}

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return {}

    def get_all_studies(self) -> list[FrozenStudy]:
        return []

    # -- trials
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        raise NotImplementedError("trials are asked on the driver")

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        if trial_number == self.own.number:
            return self.own._trial_id
        return self.mirror.trials[trial_number]._trial_id

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if trial_id == self.own._trial_id:
            return self.own
        return self.mirror.by_id[trial_id]

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        trials = [self.own if t.number == self.own.number else t for t in self.mirror.listing()]
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    def _check_own(self, trial_id: int) -> None:
        if trial_id != self.own._trial_id:
            raise RuntimeError(f"trial id {trial_id} is not the trial running here")

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        self._check_own(trial_id)
        self.own.distributions = {**self.own.distributions, param_name: distribution}
        self.own.params = {
            **self.own.params,
            param_name: distribution.to_external_repr(param_value_internal),
        }
        self.on_write("param", name=param_name, value=param_value_internal, dist=distribution)

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        raise NotImplementedError("the driver tells the study a trial's end")

    def set_trial_intermediate_value(self, trial_id: int, step: int, value: float) -> None:
        self._check_own(trial_id)
        self.own.intermediate_values = {**self.own.intermediate_values, step: value}
        self.on_write("value", step=int(step), value=float(value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._check_own(trial_id)
        self.own.user_attrs = {**self.own.user_attrs, key: value}
        self.on_write("user_attr", key=key, value=value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._check_own(trial_id)
        self.own.system_attrs = {**self.own.system_attrs, key: value}
