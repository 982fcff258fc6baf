"""Every built-in sampler and pruner through clusterkit records what ``study.optimize`` records.

For each sampler and pruner, the same seeded search runs twice: with Optuna's own
``study.optimize`` in this process, and with ``hpo.run`` on a real cluster of one worker thread
without lookahead (one trial at a time, as ``optimize`` runs them). Each trial must carry the
same system attributes (the sampler's state, CMA-ES's optimizer, NSGA-II's generation, the
grid's ids, the constraints) and, wherever Optuna itself is deterministic, the same parameters,
values, states and intermediate values. Then what a trial does with its study on a worker: the
study's attributes read and written, trials enqueued and asked from inside a trial, artifacts
linked to their trial, and an objective that returns the wrong number of values.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import optuna
import pytest
from optuna.trial import TrialState

from clusterkit.runners import hpo
from clusterkit.runners.hpo.records import NoTrialCompleted

# seam: every built-in sampler and pruner of the installed Optuna
pytestmark = [pytest.mark.local, pytest.mark.seam]
optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_TRIALS = 14
#: Optuna 5 sets constraints from inside the objective; 4.x only through the sampler's
#: ``constraints_func`` (the compat tier runs Optuna 4.7, the floor).
SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")
#: Both sides' study name: Hyperband draws a trial's bracket from it.
STUDY = "parity"


def objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -4.0, 4.0)
    y = trial.suggest_float("y", -4.0, 4.0)
    return (x - 1.0) ** 2 + (y + 0.5) ** 2


def two_objectives(trial: optuna.Trial) -> tuple[float, float]:
    x = trial.suggest_float("x", 0.0, 2.0)
    y = trial.suggest_float("y", 0.0, 2.0)
    if SET_CONSTRAINT:
        trial.set_constraint("sum", x + y - 3.0)  # Optuna 5's constraints: feasible when <= 0
    else:
        trial.set_user_attr("sum", x + y - 3.0)  # read back by the sampler's constraints_func
    return x**2 + y, (x - 2.0) ** 2 + y


def summed(trial: optuna.trial.FrozenTrial) -> tuple[float]:
    """Optuna 4's way to the same constraint: the sampler's ``constraints_func``."""
    return (trial.user_attrs["sum"],)


CONSTRAINED: dict[str, Any] = {} if SET_CONSTRAINT else {"constraints_func": summed}


def discrete(trial: optuna.Trial) -> float:
    x = trial.suggest_int("x", 0, 3)
    kind = trial.suggest_categorical("kind", ["a", "b"])
    return x + (0.5 if kind == "a" else 0.0)


def stepped(trial: optuna.Trial) -> float:
    """An objective that reports a learning curve and asks the pruner at each step."""
    x = trial.suggest_float("x", 0.0, 1.0)
    value = 0.0
    for step in range(8):
        value = x * (8 - step) + 0.05 * step
        trial.report(value, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return value


SAMPLERS: dict[str, tuple[Callable[[], Any], Callable[..., Any], list[str], int]] = {
    # name: (the sampler, its objective, directions, trials)
    "random": (lambda: optuna.samplers.RandomSampler(seed=3), objective, ["minimize"], N_TRIALS),
    "tpe": (lambda: optuna.samplers.TPESampler(seed=3), objective, ["minimize"], N_TRIALS),
    "tpe-multivariate": (
        lambda: optuna.samplers.TPESampler(seed=3, multivariate=True, n_startup_trials=5),
        objective,
        ["minimize"],
        N_TRIALS,
    ),
    "tpe-constant-liar": (
        lambda: optuna.samplers.TPESampler(
            seed=3, multivariate=True, constant_liar=True, n_startup_trials=5
        ),
        objective,
        ["minimize"],
        N_TRIALS,
    ),
    "cmaes": (
        lambda: optuna.samplers.CmaEsSampler(seed=3, n_startup_trials=2),
        objective,
        ["minimize"],
        N_TRIALS,
    ),
    "gp": (
        lambda: optuna.samplers.GPSampler(seed=3, n_startup_trials=4),
        objective,
        ["minimize"],
        8,
    ),
    "nsga2": (
        lambda: optuna.samplers.NSGAIISampler(seed=3, population_size=4, **CONSTRAINED),
        two_objectives,
        ["minimize", "minimize"],
        N_TRIALS,
    ),
    "nsga3": (
        lambda: optuna.samplers.NSGAIIISampler(seed=3, population_size=4, **CONSTRAINED),
        two_objectives,
        ["minimize", "minimize"],
        N_TRIALS,
    ),
    "qmc": (lambda: optuna.samplers.QMCSampler(seed=3), objective, ["minimize"], N_TRIALS),
    "grid": (
        lambda: optuna.samplers.GridSampler({"x": [0, 1, 2, 3], "kind": ["a", "b"]}, seed=3),
        discrete,
        ["minimize"],
        8,
    ),
    "brute-force": (lambda: optuna.samplers.BruteForceSampler(seed=3), discrete, ["minimize"], 8),
    "partial-fixed": (
        lambda: optuna.samplers.PartialFixedSampler(
            {"y": 0.25}, optuna.samplers.TPESampler(seed=3)
        ),
        objective,
        ["minimize"],
        N_TRIALS,
    ),
}
#: Samplers whose draws depend on floating-point work that may differ between two processes
#: (the GP's fit): their trials' attributes must match, their values only closely.
APPROXIMATE = {"gp"}

PRUNERS: dict[str, Callable[[], Any]] = {
    "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    "percentile": lambda: optuna.pruners.PercentilePruner(40.0, n_startup_trials=2),
    "successive-halving": lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1),
    "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=8),
    "threshold": lambda: optuna.pruners.ThresholdPruner(upper=4.0),
    "patient": lambda: optuna.pruners.PatientPruner(
        optuna.pruners.MedianPruner(n_startup_trials=2), patience=1
    ),
    "wilcoxon": lambda: optuna.pruners.WilcoxonPruner(p_threshold=0.2, n_startup_steps=2),
}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """One worker thread: trials run one at a time, as under ``study.optimize``."""
    from tests.clusters import local_client

    with local_client(1) as connected:
        yield connected


def _serial(make_sampler: Any, function: Any, directions: list[str], n: int, pruner: Any = None):
    study = optuna.create_study(
        study_name=STUDY, directions=directions, sampler=make_sampler(), pruner=pruner
    )
    study.optimize(function, n_trials=n)
    return study


def _clusterkit(
    client: Any, make_sampler: Any, function: Any, directions: list[str], n: int, pruner=None
):
    study = optuna.create_study(
        study_name=STUDY, directions=directions, sampler=make_sampler(), pruner=pruner
    )
    hpo.run(function, n_trials=n, client=client, study=study, lookahead=0, progress=False)
    return study


def _compare(expected: optuna.Study, got: optuna.Study, exact: bool = True) -> None:
    """The same trials: states, system attributes and, ``exact``, parameters and values."""
    want, have = expected.get_trials(), got.get_trials()
    assert len(have) == len(want)
    for a, b in zip(want, have, strict=True):
        where = f"trial {a.number}"
        assert b.state == a.state, where
        assert set(b.system_attrs) == set(a.system_attrs), where
        assert set(b.params) == set(a.params), where
        assert set(b.intermediate_values) == set(a.intermediate_values), where
        if exact:
            assert b.params == a.params, where
            assert _plain(b.system_attrs) == _plain(a.system_attrs), where
            assert b.values == a.values, where
            assert b.intermediate_values == a.intermediate_values, where
        elif a.values is not None:
            assert b.values == pytest.approx(a.values, rel=0.2, abs=0.2), where


def _plain(attrs: dict[str, Any]) -> dict[str, Any]:
    """Attributes as JSON gives them back: a tuple is a list after a trip through a record, and
    whether one makes that trip depends on where the storage ran (a constraints_func in 4.x)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_each_sampler_records_what_study_optimize_records(client: Any, name: str) -> None:
    make, function, directions, n = SAMPLERS[name]
    expected = _serial(make, function, directions, n)
    got = _clusterkit(client, make, function, directions, n)
    _compare(expected, got, exact=name not in APPROXIMATE)


def test_cmaes_keeps_its_optimizer_between_generations(client: Any) -> None:
    """The defect this file was written for: CMA-ES's state, kept in trial system attributes
    on the workers, was dropped, and the search restarted every generation."""
    make, function, directions, _ = SAMPLERS["cmaes"]
    got = _clusterkit(client, make, function, directions, N_TRIALS)
    keyed = [t for t in got.get_trials() if any(k.startswith("cma:") for k in t.system_attrs)]
    assert len(keyed) >= N_TRIALS - 2  # all but its startup trials
    generations = {t.system_attrs.get("cma:generation") for t in keyed}
    assert len(generations) > 1, "every trial in generation 0: the optimizer restarted"


@pytest.mark.parametrize("name", list(PRUNERS))
def test_each_pruner_prunes_as_study_optimize_does(client: Any, name: str) -> None:
    make = lambda: optuna.samplers.RandomSampler(seed=5)  # noqa: E731
    expected = _serial(make, stepped, ["minimize"], N_TRIALS, PRUNERS[name]())
    got = _clusterkit(client, make, stepped, ["minimize"], N_TRIALS, PRUNERS[name]())
    _compare(expected, got)
    if name in ("median", "percentile", "threshold", "hyperband", "successive-halving"):
        assert any(t.state == TrialState.PRUNED for t in got.get_trials()), "nothing pruned"


def study_minded(trial: optuna.Trial) -> float:
    """Reads and writes its study from the worker, as objectives written for Optuna do."""
    study = trial.study
    trial.set_user_attr("tag_seen", study.user_attrs.get("tag"))
    x = trial.suggest_float("x", 0.0, 1.0)
    if trial.number == 1:
        study.set_user_attr("set_by", trial.number)
        study.enqueue_trial({"x": 0.125}, user_attrs={"from": "a trial"})
        side = study.ask()  # a trial of its own, told from here
        study.tell(side, side.suggest_float("x", 0.0, 1.0) + 10.0)
    if trial.number == 6:
        trial.set_user_attr("set_by_seen", study.user_attrs.get("set_by"))
        trial.set_user_attr("finished_seen", len(study.get_trials(states=(TrialState.COMPLETE,))))
    return x


def test_a_trial_reads_and_writes_its_study_on_the_worker(client: Any) -> None:
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=1))
    study.set_user_attr("tag", "lab")
    storage.set_study_system_attr(
        storage.get_study_id_from_name(study.study_name), "origin", "driver"
    )
    hpo.run(study_minded, n_trials=8, client=client, study=study, lookahead=0, progress=False)
    trials = study.get_trials()
    ran = [t for t in trials if "tag_seen" in t.user_attrs]
    assert {t.user_attrs["tag_seen"] for t in ran} == {"lab"}
    assert study.user_attrs["set_by"] == 1
    enqueued = [t for t in trials if t.user_attrs.get("from") == "a trial"]
    assert len(enqueued) == 1 and enqueued[0].state == TrialState.COMPLETE
    assert enqueued[0].params == {"x": 0.125}  # the search ran the trial the objective enqueued
    side = [t for t in trials if t.value is not None and t.value >= 10.0]
    assert len(side) == 1 and side[0].state == TrialState.COMPLETE
    sixth = next(t for t in trials if t.number == 6)
    assert sixth.user_attrs["set_by_seen"] == 1
    assert sixth.user_attrs["finished_seen"] >= 4


def uploading(trial: optuna.Trial) -> float:
    import os

    from optuna.artifacts import FileSystemArtifactStore, upload_artifact

    folder = os.environ["CK_TEST_ARTIFACTS"]
    path = os.path.join(folder, f"note-{trial.number}.txt")
    with open(path, "w") as handle:
        handle.write(f"trial {trial.number}\n")
    store = FileSystemArtifactStore(os.path.join(folder, "store"))
    upload_artifact(study_or_trial=trial, file_path=path, artifact_store=store)
    return trial.suggest_float("x", 0.0, 1.0)


def test_artifacts_uploaded_on_a_worker_link_to_their_trial(
    client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from optuna.artifacts import FileSystemArtifactStore, get_all_artifact_meta

    (tmp_path / "store").mkdir()
    client.run(lambda: __import__("os").environ.update(CK_TEST_ARTIFACTS=str(tmp_path)))
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage)
    hpo.run(uploading, n_trials=6, client=client, study=study, progress=False)
    store = FileSystemArtifactStore(str(tmp_path / "store"))
    for trial in study.get_trials():
        metas = get_all_artifact_meta(trial, storage=storage)
        assert [m.filename for m in metas] == [f"note-{trial.number}.txt"]
        with store.open_reader(metas[0].artifact_id) as reader:
            assert reader.read().decode() == f"trial {trial.number}\n"


def pair(trial: optuna.Trial) -> tuple[float, float]:
    x = trial.suggest_float("x", 0.0, 1.0)
    return x, 1.0 - x


def test_the_wrong_number_of_values_is_named_as_the_cause(client: Any) -> None:
    study = optuna.create_study(direction="minimize")
    with pytest.raises(NoTrialCompleted) as raised:
        hpo.run(pair, n_trials=3, client=client, study=study, progress=False)
    assert "returned 2 values for a study of 1 objective" in str(raised.value)
    assert "no error recorded" not in str(raised.value)
    assert all(math.isnan(t.value or math.nan) for t in study.get_trials())


def stops_at_four(trial: optuna.Trial) -> float:
    """Optuna's own example for ``Study.stop``, as its docstring gives it."""
    if trial.number == 4:
        trial.study.stop()
    x = trial.suggest_float("x", 0, 10)
    return x**2


def test_study_stop_from_a_trial_ends_the_search_as_in_optimize(client: Any) -> None:
    study = optuna.create_study()
    hpo.run(stops_at_four, n_trials=10, client=client, study=study, lookahead=0, progress=False)
    assert len(study.trials) == 5


# ---------------------------------------------------------------------- trials at once


@pytest.fixture(scope="module")
def two_slots() -> Iterator[Any]:
    from tests.clusters import local_client

    with local_client(1, threads=2) as connected:
        yield connected


def sees_the_running(trial: optuna.Trial) -> float:
    """Records the parameters of the other trials running as it starts, as a constant liar
    sees them, then keeps its slot a while: the first trial briefly, so the slots' trials start
    in turn, each while the other's trial runs."""
    import time

    x = trial.suggest_float("x", 0.0, 1.0)
    running = trial.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    trial.set_user_attr("running_params", [t.params for t in running if t.number != trial.number])
    time.sleep(0.15 if trial.number == 0 else 0.6)
    return x


def test_a_trial_sees_what_the_trials_running_beside_it_drew(two_slots: Any) -> None:
    """TPE's and the GP's constant liar lie about the running trials' parameters: a trial's
    mirror must show them as ``study.optimize``'s threads see them."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    hpo.run(
        sees_the_running, n_trials=8, client=two_slots, study=study, lookahead=0, progress=False
    )
    later = [t for t in study.trials if t.number >= 2]
    seen = [t.user_attrs["running_params"] for t in later]
    assert all(len(params) == 1 and "x" in params[0] for params in seen), seen


def test_qmc_draws_no_point_twice_with_trials_at_once(two_slots: Any) -> None:
    """QMC counts its samples in a study system attribute: read current, not as dispatched."""
    study = optuna.create_study(sampler=optuna.samplers.QMCSampler(seed=0, scramble=True))
    hpo.run(objective, n_trials=12, client=two_slots, study=study, progress=False)
    points = [(t.params["x"], t.params["y"]) for t in study.trials]
    assert len(set(points)) == len(points)
