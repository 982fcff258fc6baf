"""Queued trials sampled on the driver while they wait: the worker's trial gets exactly what was
drawn, and samples itself wherever the objective asks for something else."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import presample
from clusterkit.runners.hpo.presample import PresampledSampler, Presampler

pytestmark = pytest.mark.seam  # Optuna's relative sampling, drawn ahead

optuna.logging.set_verbosity(optuna.logging.WARNING)


def two_params(trial: optuna.Trial) -> float:
    return trial.suggest_float("x", -1.0, 1.0) ** 2 + trial.suggest_int("n", 1, 8)


def drawn_and_run(sampler: optuna.samplers.BaseSampler, objective: Any) -> tuple[Any, Any]:
    """Ten finished trials, then one drawn ahead on the 'driver' and run with its sampler as a
    worker would: (what was drawn, the trial's params)."""
    study = optuna.create_study(sampler=sampler)
    study.optimize(two_params, n_trials=12)
    ahead = Presampler(study)
    ahead.finished(study.trials[-2])
    ahead.finished(study.trials[-1])  # now it knows the parameters and a gap
    trial_id = study._storage.create_new_trial(study._study_id)
    ahead.draw(trial_id)
    worker_side = optuna.Study(
        study.study_name, study._storage, sampler=ahead.sampler_for(trial_id)
    )
    trial = optuna.Trial(worker_side, trial_id)
    objective(trial)
    return ahead.drawn[trial_id], trial.params


@pytest.mark.unit
@pytest.mark.parametrize(
    "sampler",
    [optuna.samplers.TPESampler(seed=1), optuna.samplers.TPESampler(seed=1, multivariate=False)],
    ids=["tpe-multivariate", "tpe-univariate"],
)
def test_the_trial_gets_what_the_driver_drew(sampler: optuna.samplers.BaseSampler) -> None:
    drawn, params = drawn_and_run(sampler, two_params)
    values = drawn.relative or {name: value for name, (_, value) in drawn.independent.items()}
    assert set(values) == {"x", "n"}
    assert params == values


@pytest.mark.unit
def test_another_range_or_a_new_parameter_is_sampled_on_the_worker() -> None:
    def other_space(trial: optuna.Trial) -> float:  # x's range moved; y is new
        x = trial.suggest_float("x", 5.0, 6.0)
        return x + trial.suggest_float("y", 0.0, 1.0)

    sampler = optuna.samplers.TPESampler(seed=1, multivariate=False)
    drawn, params = drawn_and_run(sampler, other_space)
    assert -1.0 <= drawn.independent["x"][1] <= 1.0
    assert 5.0 <= params["x"] <= 6.0 and 0.0 <= params["y"] <= 1.0


@pytest.mark.unit
def test_a_draw_does_not_repeat_what_the_last_task_sent_will_sample() -> None:
    """A task carries the sampler pickled with the driver's random state; a draw right after
    must not start from that same state (it gave two trials the same value)."""
    import pickle

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(two_params, n_trials=2)
    ahead = Presampler(study)
    for trial in study.trials:
        ahead.finished(trial)
    sent = pickle.loads(pickle.dumps(study.sampler))  # a trial just submitted, not drawn
    trial_id = study._storage.create_new_trial(study._study_id)
    ahead.draw(trial_id)
    frozen = study._storage.get_trial(trial_id)
    distribution, value = ahead.drawn[trial_id].independent["x"]  # a float: equal only if
    assert value != sent.sample_independent(study, frozen, "x", distribution)  # same state


@pytest.mark.unit
def test_the_tasks_sampler_is_not_bound_to_the_drivers_study() -> None:
    """TPE's intersection search space keeps the id of the study it first saw; a task's copy
    carrying the driver's study id failed on the worker ("cannot handle multiple studies",
    where the ids differ: a database storage on the driver)."""
    import pickle

    storage = optuna.storages.InMemoryStorage()
    optuna.create_study(storage=storage, study_name="another")  # the driver's study gets id 1
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=1))
    study.optimize(two_params, n_trials=12)
    study.sampler = optuna.samplers.TPESampler(seed=1)  # as the driver's: it never sampled
    ahead = Presampler(study)
    for trial in study.trials[-2:]:
        ahead.finished(trial)
    ahead.draw(study._storage.create_new_trial(study._study_id))
    sent = pickle.loads(pickle.dumps(study.sampler))  # what the next task carries
    on_worker = optuna.create_study(sampler=sent)  # id 0, as a worker's mirror
    on_worker.optimize(two_params, n_trials=12)
    assert len(on_worker.trials) == 12


@pytest.mark.unit
def test_the_driver_stops_drawing_when_it_would_be_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(two_params, n_trials=2)
    ahead = Presampler(study)
    for trial in study.trials:
        ahead.finished(trial)
    ahead.gap, ahead.cost = 0.010, 0.005  # drawing would take half the driver's time
    trial_id = study._storage.create_new_trial(study._study_id)
    ahead.draw(trial_id)
    assert trial_id not in ahead.drawn
    assert isinstance(ahead.sampler_for(trial_id), optuna.samplers.RandomSampler)
    ahead.gap = 1.0  # trials got longer: it draws again
    ahead.draw(trial_id)
    assert isinstance(ahead.sampler_for(trial_id), PresampledSampler)


@pytest.fixture
def two_workers() -> Iterator[object]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as connected,
    ):
        yield connected


def sleepy(trial: optuna.Trial) -> float:
    value = two_params(trial)
    time.sleep(0.1)
    return value


@pytest.mark.local
def test_a_search_runs_the_queued_trials_with_the_drawn_values(
    two_workers: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: dict[int, dict[str, Any]] = {}
    original = Presampler.draw

    def record(self: Presampler, trial_id: int) -> None:
        original(self, trial_id)
        if trial_id in self.drawn:
            drawn[trial_id] = dict(self.drawn[trial_id].relative)

    monkeypatch.setattr(Presampler, "draw", record)
    study = hpo.run(
        sleepy,
        n_trials=24,
        client=two_workers,
        storage=optuna.storages.InMemoryStorage(),
        # multivariate: Optuna 5's default; 4.x (the floor) samples independently, nothing ahead
        sampler=optuna.samplers.TPESampler(seed=3, n_startup_trials=4, multivariate=True),
        progress=False,
        workdir=None,
    )
    assert len(drawn) >= 12, f"only {len(drawn)} of 24 trials were drawn ahead"
    by_id = {t._trial_id: t.params for t in study.trials}
    assert all(by_id[trial_id] == values for trial_id, values in drawn.items() if values)
    assert sum(bool(values) for values in drawn.values()) >= 8  # past TPE's random start-up
    assert presample.ENABLED
