"""Trials that outlive their worker (:mod:`clusterkit.runners.hpo.preemption`): an objective
that asks ``hpo.should_checkpoint()`` saves in ``hpo.checkpoint_dir(trial)`` and raises
``hpo.TrialInterrupted`` as its worker's lifetime nears its end; the trial runs again on a
worker with time left and resumes from the checkpoint, not from its start."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import inputs
from clusterkit.runners.hpo.records import NoTrialCompleted

LIFETIME = 14.0  # seconds: the short-lived worker's (a batch job's walltime less its margin)
LEAD = 3.0  # seconds before its end a worker's trials checkpoint
STEPS, STEP_SECONDS = 32, 0.5  # 16 s of work a trial: longer than the short worker's life


@pytest.fixture
def short_and_long() -> Iterator[object]:
    """A client on two one-thread workers: "short", which ends LIFETIME seconds after its
    start (its batch job's walltime), and "long", with no end."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "host": "127.0.0.1"}}
    short = {"host": "127.0.0.1", "nthreads": 1, "lifetime": f"{LIFETIME}s", "lifetime_stagger": 0}
    workers = {
        "short": {"cls": Nanny, "options": short},
        "long": {"cls": Nanny, "options": {"host": "127.0.0.1", "nthreads": 1}},
    }
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        yield client


def stepwise(trial: optuna.Trial) -> float:
    """STEPS steps of x**2 / STEPS each; its state saved when its worker is ending."""
    x = trial.suggest_float("x", -1.0, 1.0)
    saved = hpo.checkpoint_dir(trial) / "state.json"
    step, total = json.loads(saved.read_text()) if saved.exists() else (0, 0.0)
    if step:
        trial.set_user_attr("resumed_at", [*trial.user_attrs.get("resumed_at", []), step])
    while step < STEPS:
        if hpo.should_checkpoint():
            saved.write_text(json.dumps([step, total]))
            raise hpo.TrialInterrupted(f"saved at step {step}")
        time.sleep(STEP_SECONDS)
        total += x * x / STEPS
        step += 1
    return total


@pytest.mark.local
@pytest.mark.timeout(240)
def test_a_trial_resumes_from_its_checkpoint_after_its_worker_ends(
    short_and_long: object, tmp_path: Path
) -> None:
    with dask.config.set({"clusterkit.checkpoint-lead": LEAD}):
        study = hpo.run(
            stepwise,
            n_trials=2,
            client=short_and_long,  # type: ignore[arg-type]
            storage=optuna.storages.InMemoryStorage(),
            progress=False,
            checkpoint_dir=str(tmp_path / "checkpoints"),
            max_retries=6,
            workdir=None,
        )
    trials = study.get_trials(deepcopy=False)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    for trial in trials:  # the sum of its steps, whichever workers ran them
        assert trial.value == pytest.approx(trial.params["x"] ** 2)
    resumed = {t.number: t.user_attrs["resumed_at"] for t in trials if "resumed_at" in t.user_attrs}
    assert len(resumed) == 1, "the trial on the short worker did not outlive it"
    for number, steps in resumed.items():  # each resume picked up where the last one saved
        assert all(0 < s < STEPS for s in steps) and steps == sorted(steps), (number, steps)
        assert study.trials[number].user_attrs[inputs.ATTR_ATTEMPTS] == len(steps) + 1
    saved = sorted(p.parent.name for p in (tmp_path / "checkpoints").glob("*/state.json"))
    assert saved == [f"trial-{number}" for number in resumed]


@pytest.mark.unit
def test_outside_a_trial_nothing_is_ending_and_there_is_no_checkpoint_dir() -> None:
    assert hpo.should_checkpoint() is False
    with pytest.raises(RuntimeError, match="outside a trial"):
        hpo.checkpoint_dir()


@pytest.mark.local
def test_without_a_checkpoint_dir_the_trial_fails_with_how_to_set_it(tmp_path: Path) -> None:
    from distributed import Client, LocalCluster

    def needs_a_folder(trial: optuna.Trial) -> float:
        hpo.checkpoint_dir(trial)
        return 0.0

    cluster = LocalCluster(n_workers=1, processes=False, dashboard_address=":0")
    refused = pytest.raises(NoTrialCompleted, match="checkpoint_dir=")
    with cluster, Client(cluster) as client, refused:
        hpo.run(
            needs_a_folder,
            n_trials=1,
            client=client,
            storage=optuna.storages.InMemoryStorage(),
            progress=False,
            workdir=None,
        )


@pytest.mark.unit
def test_the_folder_is_per_trial_and_a_url_stays_a_url(tmp_path: Path) -> None:
    from clusterkit.runners.hpo.preemption import trial_context

    with trial_context(7, str(tmp_path), None):
        assert hpo.checkpoint_dir() == tmp_path / "trial-7" and (tmp_path / "trial-7").is_dir()
        assert hpo.should_checkpoint() is False  # not in a Dask worker's task
    with trial_context(7, "s3://bucket/runs/", None):
        assert hpo.checkpoint_dir() == "s3://bucket/runs/trial-7"


RESTART_LIFETIME = 8.0  # seconds a worker of the restarting fixture lives


@pytest.fixture
def restarting() -> Iterator[object]:
    """A client on one one-thread worker whose job ends every RESTART_LIFETIME seconds and is
    replaced at once (a requeued batch job: its nanny starts a fresh worker).

    SpecCluster closes a nanny whose worker is still away ``lost-worker-timeout`` (15 s) after
    it left; workers that live 8 s and take 3-5 s to restart under load were away at that
    instant once in a while (the next restart's gap), and the nanny was closed: no worker
    ever again. Here the timeout outlasts the test."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "host": "127.0.0.1"}}
    options = {"host": "127.0.0.1", "nthreads": 1, "lifetime": f"{RESTART_LIFETIME}s"}
    options.update(lifetime_stagger=0, lifetime_restart=True)
    workers = {"job": {"cls": Nanny, "options": options}}
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "600s"}),
        SpecCluster(workers=workers, scheduler=scheduler) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(1)
        yield client


@pytest.mark.local
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("max_resumes", "final"), [(10, "COMPLETE"), (0, "FAIL")])
def test_resumes_have_their_own_bound_apart_from_lost_attempts(
    restarting: object, tmp_path: Path, max_resumes: int, final: str
) -> None:
    """A trial of 16 s on workers that live 8 s resumes on two or more of them: with no
    retry of a lost attempt allowed (max_retries=0) it still finishes, each resume one of
    ``max_resumes``; past that bound it fails, naming the bound."""
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    fails = pytest.raises(NoTrialCompleted) if final == "FAIL" else contextlib.nullcontext()
    with dask.config.set({"clusterkit.checkpoint-lead": 2.0}), fails:
        hpo.run(
            stepwise,
            n_trials=1,
            client=restarting,  # type: ignore[arg-type]
            study=study,
            progress=False,
            checkpoint_dir=str(tmp_path / "checkpoints"),
            max_retries=0,
            max_resumes=max_resumes,
            workdir=None,
        )
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state.name == final, trial.user_attrs
    if final == "COMPLETE":
        assert trial.value == pytest.approx(trial.params["x"] ** 2)
        assert len(trial.user_attrs["resumed_at"]) >= 2, trial.user_attrs
    else:
        error = trial.user_attrs[inputs.ATTR_ERROR]
        assert "resumed from its checkpoint as often as max_resumes=0 allows" in error, error
