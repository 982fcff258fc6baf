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
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
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


@dataclass
class StudyFacts:
    """The study a search runs, as its tasks carry it: what does not change while it runs."""

    study_id: int
    name: str
    directions: list[int]
    #: The study's pruner where what a sampler sees depends on it (Hyperband's brackets).
    bracket_pruner: Any = None


#: ``call(method, *args)``: the driver's storage answers (:mod:`.remote`), or raises.
DriverCall = Callable[..., Any]


class TrialView(BaseStorage):
    """The storage a trial sees on a worker: all of Optuna's storage, served here where it can.

    Served here, with no round trip: the running trial (``own``; its writes are kept and sent
    on with ``on_write(kind, **fields)``, fire and forget, in order; an attribute's value
    pickled, as numpy's scalars are no message), the study's other trials (the worker's mirror)
    and what does not change of the study (``study``: its name and directions). Everything else
    is a call to the driver's storage (``call``): the study's attributes (read current: QMC counts
    its samples there while trials run at once), other studies, trials the objective asked,
    enqueued or changed itself (after such a write the study's trials are read from the driver,
    current), with the exceptions Optuna's storage raises. The running trial's end is the
    driver's: it tells the study what the objective returned.
    """

    def __init__(
        self,
        mirror: StudyMirror | None,
        own: FrozenTrial | None,
        study: StudyFacts | None,
        on_write: Callable[..., None] | None,
        call: DriverCall,
    ) -> None:
        self.mirror = mirror
        self.own = None if own is None else copy.deepcopy(own)
        if self.own is not None:
            self.own.state = TrialState.RUNNING
        self.study = study
        self.on_write = on_write
        self.call = call
        self._asked_driver = False  # the objective changed trials through the driver

    def _is_own_study(self, study_id: int) -> bool:
        return self.study is not None and study_id == self.study.study_id

    def _is_own(self, trial_id: int) -> bool:
        return self.own is not None and trial_id == self.own._trial_id

    # -- studies
    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        return self.call("create_new_study", list(directions), study_name)

    def delete_study(self, study_id: int) -> None:
        self.call("delete_study", study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self.call("set_study_user_attr", study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self.call("set_study_system_attr", study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        if self.study is not None and study_name == self.study.name:
            return self.study.study_id
        return self.call("get_study_id_from_name", study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        if self.study is not None and self._is_own_study(study_id):
            return self.study.name
        return self.call("get_study_name_from_id", study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        if self.study is not None and self._is_own_study(study_id):
            return [StudyDirection(d) for d in self.study.directions]
        return self.call("get_study_directions", study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self.call("get_study_user_attrs", study_id)  # current: trials set them too

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self.call("get_study_system_attrs", study_id)  # QMC's counter: current

    def get_all_studies(self) -> list[Any]:
        return self.call("get_all_studies")

    # -- trials
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        self._asked_driver = True
        return self.call("create_new_trial", study_id, template_trial)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        if self._is_own_study(study_id):
            if self.own is not None and trial_number == self.own.number:
                return self.own._trial_id
            known = None if self.mirror is None else self.mirror.trials.get(trial_number)
            if known is not None:
                return known._trial_id
        return self.call("get_trial_id_from_study_id_trial_number", study_id, trial_number)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if self.own is not None and trial_id == self.own._trial_id:
            return self.own
        if not self._asked_driver and self.mirror is not None:
            known = self.mirror.by_id.get(trial_id)
            if known is not None:
                return known
        return self.call("get_trial", trial_id)

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        if not self._is_own_study(study_id):
            return self.call("get_all_trials", study_id, deepcopy, states)
        own = self.own
        if self._asked_driver or self.mirror is None:
            listed = self.call("get_all_trials", study_id, False, None)
        else:
            listed = self.mirror.listing()
        trials = [own if own is not None and t.number == own.number else t for t in listed]
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    def _write_own(self, kind: str, **fields: Any) -> None:
        if self.on_write is not None:
            self.on_write(kind, **fields)

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        own = self.own
        if own is None or trial_id != own._trial_id:
            self._asked_driver = True
            return self.call(
                "set_trial_param", trial_id, param_name, param_value_internal, distribution
            )
        if param_name in own.distributions:  # Optuna's storages refuse a different one
            from optuna.distributions import check_distribution_compatibility

            check_distribution_compatibility(own.distributions[param_name], distribution)
        own.distributions = {**own.distributions, param_name: distribution}
        own.params = {**own.params, param_name: distribution.to_external_repr(param_value_internal)}
        self._write_own("param", name=param_name, value=param_value_internal, dist=distribution)

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        if self._is_own(trial_id):
            raise RuntimeError(
                f"trial {self.own.number} is running here: the search tells the study its end "  # type: ignore[union-attr]
                "from what the objective returns (or raises)"
            )
        self._asked_driver = True
        return self.call("set_trial_state_values", trial_id, state, values)

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        own = self.own
        if own is None or trial_id != own._trial_id:
            self._asked_driver = True
            return self.call("set_trial_intermediate_value", trial_id, step, intermediate_value)
        own.intermediate_values = {**own.intermediate_values, step: intermediate_value}
        self._write_own("value", step=int(step), value=float(intermediate_value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._set_attr("user", trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._set_attr("system", trial_id, key, value)

    def _set_attr(self, kind: str, trial_id: int, key: str, value: Any) -> None:
        own = self.own
        if own is None or trial_id != own._trial_id:
            self._asked_driver = True
            return self.call(f"set_trial_{kind}_attr", trial_id, key, value)
        attrs = f"{kind}_attrs"
        setattr(own, attrs, {**getattr(own, attrs), key: value})
        self._write_own(f"{kind}_attr", key=key, value=pickle.dumps(value), pickled=True)
