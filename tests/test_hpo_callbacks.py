"""Optuna's callbacks run on the driver, each finished trial once, in trial-number order, while
trials end out of order on a real LocalCluster; Optuna's ``MLflowCallback`` against a real MLflow
tracking store (SQLite, no server), read back through ``mlflow.search_runs``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import optuna
import pytest

from clusterkit.runners import hpo

pytestmark = [pytest.mark.local, pytest.mark.seam]  # seam: Optuna's callbacks and MLflow's
optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

OBJECTIVE = """
import time

def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    depth = trial.suggest_int("depth", 1, 8)
    time.sleep(0.8 if trial.number == 0 else 0.05)  # trial 0 ends after later ones
    if trial.number == 3:
        raise ValueError("trial 3 fails")
    return x * x + depth
"""


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """Two workers for the module: its tests only run searches on them."""
    from tests.clusters import local_client

    with local_client(2) as connected:
        yield connected


@pytest.fixture
def client(cluster: object) -> Iterator[object]:
    from tests.clusters import as_new

    with as_new(cluster) as connected:
        yield connected


def out_of_order(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.8 if trial.number == 0 else 0.05)
    if trial.number == 3:
        raise ValueError("trial 3 fails")
    return x * x


def test_callbacks_see_each_finished_trial_once_in_number_order(client: object) -> None:
    seen: list[tuple[int, str, str]] = []

    def record(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        seen.append((trial.number, trial.state.name, threading_name()))

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    hpo.run(
        out_of_order,
        n_trials=6,
        client=client,  # type: ignore[arg-type]
        study=study,
        progress=False,
        workdir=None,
        callbacks=[record],
    )
    ended = {t.number: t for t in study.get_trials()}
    first_ended = min(ended, key=lambda n: ended[n].datetime_complete)
    assert first_ended != 0  # trials ended out of order...
    assert [n for n, _, _ in seen] == list(range(6))  # ...and were told in order, once each
    assert [state for _, state, _ in seen] == [ended[n].state.name for n in range(6)]
    assert {thread for _, _, thread in seen} == {threading_name()}  # on the driver's thread


def threading_name() -> str:
    import threading

    return threading.current_thread().name


def _runs(uri: str, experiment: str) -> object:
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment], order_by=["attributes.start_time"])


def _check_runs(runs: object, study: optuna.Study) -> None:
    """One MLflow run per finished trial, in trial order, with its parameters and value."""
    import math

    trials = study.get_trials()
    assert list(runs["tags.mlflow.runName"]) == [str(t.number) for t in trials]  # type: ignore[index]
    for (_, run), trial in zip(runs.iterrows(), trials, strict=True):  # type: ignore[attr-defined]
        assert run["tags.state"] == trial.state.name
        for name, value in trial.params.items():
            assert run[f"params.{name}"] == str(value)
        if trial.state.name == "COMPLETE":
            assert math.isclose(run["metrics.value"], trial.value)
        else:
            assert math.isnan(run["metrics.value"])


def test_mlflow_callback_logs_one_run_per_trial_from_the_driver(
    client: object, tmp_path: Path
) -> None:
    from optuna_integration.mlflow import MLflowCallback

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    study = optuna.create_study(study_name="tracked", storage=optuna.storages.InMemoryStorage())
    hpo.run(
        out_of_order,
        n_trials=6,
        client=client,  # type: ignore[arg-type]
        study=study,
        progress=False,
        workdir=None,
        callbacks=[MLflowCallback(tracking_uri=uri, metric_name="value")],
    )
    runs = _runs(uri, "tracked")
    assert len(runs) == 6  # type: ignore[arg-type]
    _check_runs(runs, study)


def test_cli_mlflow_option_tracks_every_trial(client: object, tmp_path: Path) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(OBJECTIVE))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    address = client.scheduler.address  # type: ignore[attr-defined]
    env = {**os.environ, "CLUSTERKIT_SCHEDULER": address}
    command = [sys.executable, "-m", "clusterkit", "hpo", "obj.py:objective", "-n", "5"]
    command += ["--study-name", "cli", "--no-progress", "--mlflow", uri]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "cli.optuna.log")))
    study = optuna.load_study(study_name="cli", storage=storage)
    runs = _runs(uri, "cli")
    assert len(runs) == 5  # type: ignore[arg-type]
    _check_runs(runs, study)
    assert {"x", "depth"} <= {c.removeprefix("params.") for c in runs.columns}  # type: ignore[attr-defined]


def test_a_callback_that_raises_stops_the_search_as_in_optuna(client: object) -> None:
    def broken(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        raise RuntimeError("the tracking server is down")

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    with pytest.raises(RuntimeError, match="the tracking server is down"):
        hpo.run(
            out_of_order,
            n_trials=6,
            client=client,  # type: ignore[arg-type]
            study=study,
            progress=False,
            workdir=None,
            callbacks=[broken],
        )
    assert not [t for t in study.get_trials() if t.state.name == "RUNNING"]  # left resumable
