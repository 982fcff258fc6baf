"""Optuna's own retry convention in a clusterkit search (:mod:`clusterkit.runners.hpo.retried`):
an objective written as Optuna's ``pytorch_checkpoint.py`` example writes it, with
``RetryFailedTrialCallback.retried_trial_number(trial)`` naming the checkpoint folder of the run
it retries.
Under Optuna 5 the call raises AttributeError on a live ``optuna.Trial`` everywhere; here it
answers, and a retried trial resumes from what its earlier run saved."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.storages import RetryFailedTrialCallback

from clusterkit.runners import hpo
from clusterkit.runners.hpo.inputs import ATTR_ORPHANED, ATTR_RETRY_OF

pytestmark = [pytest.mark.local, pytest.mark.seam]  # seam: Optuna's RetryFailedTrialCallback

EPOCHS = 5


@pytest.fixture
def client() -> Iterator[object]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster) as connected,
    ):
        connected.wait_for_workers(2, timeout=60)
        yield connected


def optuna_example_objective(trial: optuna.Trial, checkpoints: Path, kill_at: int) -> float:
    """Optuna's checkpoint example, cut to its bones: a checkpoint per epoch in
    ``checkpoints/<trial number>``, loaded when the trial is a retry; trial 0's first run
    kills its worker after epoch ``kill_at``."""
    x = trial.suggest_float("x", -1.0, 1.0)
    trial_number = RetryFailedTrialCallback.retried_trial_number(trial)
    folder = checkpoints / str(trial.number if trial_number is None else trial_number)
    saved = folder / "model.json"
    epoch_begin, total = 0, 0.0
    if trial_number is not None and saved.exists():
        state = json.loads(saved.read_text())
        epoch_begin, total = state["epoch"] + 1, state["total"]
    trial.set_user_attr("retried", [trial_number, RetryFailedTrialCallback.retry_history(trial)])
    trial.set_user_attr("epoch_begin", epoch_begin)
    folder.mkdir(parents=True, exist_ok=True)
    for epoch in range(epoch_begin, EPOCHS):
        total += x * x / EPOCHS
        saved.write_text(json.dumps({"epoch": epoch, "total": total}))
        if trial.number == 0 and epoch == kill_at and trial_number is None:
            time.sleep(0.3)  # the start message leaves the worker
            os.kill(os.getpid(), signal.SIGKILL)
    return total


def test_a_trial_whose_worker_died_resumes_through_optunas_retried_trial_number(
    client: object, tmp_path: Path
) -> None:
    objective = functools.partial(optuna_example_objective, checkpoints=tmp_path, kill_at=2)
    study = hpo.run(
        objective,
        n_trials=3,
        client=client,  # type: ignore[arg-type]
        storage=optuna.storages.InMemoryStorage(),
        progress=False,
    )
    client.wait_for_workers(2, timeout=60)  # type: ignore[attr-defined]
    trials = study.get_trials(deepcopy=False)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    retried = trials[0]
    assert retried.user_attrs["retried"] == [0, [0]]  # Dask ran it again: a retry of trial 0
    assert retried.user_attrs["epoch_begin"] == 3  # from the checkpoint of epoch 2
    assert retried.value == pytest.approx(retried.params["x"] ** 2)
    for first_run in trials[1:]:
        assert first_run.user_attrs["retried"] == [None, []], first_run.number
        assert first_run.user_attrs["epoch_begin"] == 0


def orphan_resuming(trial: optuna.Trial) -> float:
    trial.set_user_attr("retried", RetryFailedTrialCallback.retried_trial_number(trial))
    trial.set_user_attr("folder", str(hpo.checkpoint_dir(trial)))
    return trial.suggest_float("x", -1.0, 1.0)


def test_a_trial_a_dead_driver_left_running_resumes_from_that_trials_checkpoints(
    client: object, tmp_path: Path
) -> None:
    """The trial asked again with the parameters of one a dead driver left RUNNING is a retry
    of that one, for Optuna's helper and for ``hpo.checkpoint_dir`` alike."""
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    left = study.ask()  # the dead driver's: RUNNING, its parameter drawn
    left.suggest_float("x", -1.0, 1.0)
    hpo.run(
        orphan_resuming,
        n_trials=2,
        client=client,  # type: ignore[arg-type]
        study=study,
        progress=False,
        checkpoint_dir=str(tmp_path),
    )
    orphan, again, fresh = study.get_trials(deepcopy=False)
    assert orphan.user_attrs[ATTR_ORPHANED] and again.user_attrs[ATTR_RETRY_OF] == 0
    assert again.params == orphan.params
    assert again.user_attrs["retried"] == 0
    assert again.user_attrs["folder"] == str(tmp_path / "trial-0")
    assert fresh.user_attrs["retried"] is None
    assert fresh.user_attrs["folder"] == str(tmp_path / f"trial-{fresh.number}")
