"""The driver's side of the study its trials see on the workers (:class:`.mirror.TrialView`).

:class:`StudySide` keeps, for the dispatch loops: the study's facts as the tasks carry them
(name, directions, a Hyperband pruner's brackets); the running trials whose parameters came
in, logged again for the mirrors (a constant liar sees what the others drew); the sampler's
state a task carries (reseeded while another trial's copy is out; a trial sent
alone brings its copy back and the study samples on from it, as ``study.optimize`` would);
whether ``study.stop()`` was called; and the answers to the trials' storage calls
(:mod:`.remote`), logged for the mirrors.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

from clusterkit.runners.hpo import records, remote

#: Slots up to which running trials' parameters are published (:meth:`StudySide.publish`).
#: Each is a third entry per trial in the change log, which then outran the workers' mirrors:
#: at 256 and 1,024 slots of ~1 s trials a task in three came back stale (7-11 ms of the driver
#: per trial, not 2). Past it, a trial sees the others' parameters once they end, as before.
PUBLISH_SLOTS = 16

if TYPE_CHECKING:
    import optuna

    from clusterkit.runners.hpo.changelog import ChangeLog


class StudySide:
    """One search's study, as the driver hands it to its trials."""

    def __init__(self, study: optuna.Study, storage: Any, study_id: int, log: ChangeLog) -> None:
        self.study, self.storage, self.study_id, self.log = study, storage, study_id, log
        self.directions = [int(d) for d in study.directions]
        from optuna.trial import TrialState

        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        self.enqueued = len(waiting)  # trials enqueued, by the runner or a trial: asked first
        self._sampler_out = False  # its state went with a trial that has not brought it back
        self._carried: tuple[int, str] | None = None  # the lone trial's number and task key
        self.stopped = False  # study.stop(): no trial starts any more
        self.drawn: set[int] = set()  # running trials whose parameters came in since publish()
        self.facts = pickle.dumps(self._facts())

    def stop(self) -> None:
        """Optuna's ``study.stop()``, called by a callback, the sampler (a grid run through) or
        a trial on its worker: the trials in flight finish, no other starts."""
        self.stopped = True

    def _facts(self) -> Any:
        from optuna.pruners import HyperbandPruner

        from clusterkit.runners.hpo.mirror import StudyFacts

        pruner = self.study.pruner
        bracket_pruner = pruner if isinstance(pruner, HyperbandPruner) else None
        return StudyFacts(self.study_id, self.study.study_name, self.directions, bracket_pruner)

    def written(self, trial_id: int, msg: dict[str, Any]) -> None:
        """A running trial's write, applied; a parameter is published (:meth:`publish`)."""
        records.apply_write(self.storage, trial_id, msg)
        if msg["kind"] == "param":
            self.drawn.add(trial_id)

    def publish(self, slots: int) -> None:
        """The running trials whose parameters came in since the last time, logged again: the
        tasks sent next show them as ``study.optimize``'s threads would see them (up to
        :data:`PUBLISH_SLOTS` slots)."""
        from optuna.trial import TrialState

        for trial_id in self.drawn if slots <= PUBLISH_SLOTS else ():
            frozen = self.storage.get_trial(trial_id)
            if frozen.state == TrialState.RUNNING:
                self.log.add(frozen)
        self.drawn.clear()

    def sampler_blob(self, sampler: Any, number: int, key: str, alone: bool) -> bytes:
        """The sampler a task of trial ``number`` carries: reseeded while another trial's copy
        is out (fixed in the pickle: a Dask re-run proposes the same values); ``alone``, no
        other trial in flight: its copy comes back (:meth:`adopt`)."""
        if self._sampler_out:
            sampler.reseed_rng()
        self._sampler_out = True
        self._carried = (number, key) if alone else None
        import cloudpickle  # by value what a script's __main__ defines (a constraints_func)

        return cloudpickle.dumps(sampler)

    def adopt(self, number: int, key: str, blob: bytes | None) -> None:
        """The sampler as the lone trial ``number`` (its task ``key``) left it: the study
        samples on from there (its random state, what it learnt), so one slot without
        lookahead draws the trials ``study.optimize`` draws."""
        carried, self._carried = self._carried, None
        if blob is None or carried != (number, key):
            return
        sampler = pickle.loads(blob)
        if type(sampler) is type(self.study.sampler):
            self.study.sampler = sampler
            self._sampler_out = False

    def answer(self, request: bytes) -> bytes:
        """A trial's storage call answered (:mod:`.remote`); a trial of the study it changed is
        logged for the mirrors, an enqueued one counted for the loop to ask."""
        from optuna.trial import TrialState

        method, args, value, reply = remote.answer(self.storage, request)
        changed = remote.changed_trial(self.storage, self.study_id, method, args, value)
        if changed is not None:
            self.log.add(changed)
            if method == "create_new_trial" and changed.state == TrialState.WAITING:
                self.enqueued += 1
        return reply
