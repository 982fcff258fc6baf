"""The workers' study mirrors: what a trial's study shows is what the driver's study held.

Each objective records, in a user attribute, the finished trials its own study showed it (number
and value), and a callback records when the driver was told each result. The checks: nothing
shown that had not finished, with the value it finished with; nothing missing that the driver
had been told before it asked for the trial (the mirror's promise; the worker's clock plays no
part, so a loaded machine cannot fail it); and, across a late-joining worker, a restarted worker,
a resumed driver and two studies on one cluster at once, the same.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from clusterkit.runners import hpo
from clusterkit.runners.hpo import changelog
from clusterkit.runners.hpo.inputs import ATTR_ORPHANED, ATTR_TIME
from clusterkit.runners.hpo.mirror import StudyMirror

pytestmark = pytest.mark.seam  # Optuna's trials and Dask's worker plugins

optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: When the driver was told each trial's result, by trial number (a test's searches share one).
Told = dict[int, datetime.datetime]


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture
def cluster() -> Iterator[object]:
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=2, host="127.0.0.1", dashboard_address=None
    ) as local:
        yield local


@pytest.fixture
def client(cluster: object) -> Iterator[object]:
    from distributed import Client

    with Client(cluster) as connected:  # type: ignore[arg-type]
        connected.wait_for_workers(1, timeout=60)
        yield connected


@pytest.fixture(params=["inline", "scattered"])
def base_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The base travels inside the tasks while it is small, else scattered: test both."""
    if request.param == "scattered":
        monkeypatch.setattr(changelog, "INLINE_BASE", 0)
    return str(request.param)


def seeing_objective(offset: float, sleep: float, gate: Path | None = None):
    """Records what the trial's study shows; with ``gate``, a trial also waits (up to a minute)
    for that file, so the trials in flight outlast a worker's arrival however slow it is."""

    def objective(trial: optuna.Trial) -> float:
        shown = trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        trial.set_user_attr("seen", {str(t.number): t.value for t in shown})
        x = trial.suggest_float("x", 0.0, 1.0)
        time.sleep(sleep)
        deadline = time.monotonic() + 60
        while gate is not None and not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return offset + x

    return objective


def check_mirrors(study: optuna.Study, told: Told) -> int:
    """Every trial saw exactly the finished trials it should have; returns the largest view.

    Should have: every trial whose result the driver had been told before it asked for this one
    (a trial's ``datetime_start``, the driver's clock as it asked), earlier runs' all."""
    trials = study.get_trials()
    finished = {t.number: t for t in trials if t.state == TrialState.COMPLETE}
    largest = 0
    for trial in finished.values():
        seen = {int(k): v for k, v in trial.user_attrs["seen"].items()}
        started = trial.user_attrs[ATTR_TIME][0]
        for number, value in seen.items():
            assert number in finished, f"trial {trial.number} saw unfinished {number}"
            assert finished[number].value == value
            assert finished[number].user_attrs[ATTR_TIME][1] <= started + 0.05
        for other in finished.values():
            if told.get(other.number, datetime.datetime.min) < trial.datetime_start:
                assert other.number in seen, f"trial {trial.number} missed {other.number}"
        largest = max(largest, len(seen))
    return largest


def search(
    client: object, objective, n: int, name: str, told: Told, storage=None
) -> optuna.Study:
    def note(study: optuna.Study, trial: FrozenTrial) -> None:  # run on the driver, after the log
        told[trial.number] = datetime.datetime.now()

    return hpo.run(
        objective,
        n_trials=n,
        client=client,  # type: ignore[arg-type]
        storage=storage if storage is not None else optuna.storages.InMemoryStorage(),
        study_name=name,
        sampler=optuna.samplers.RandomSampler(seed=1),
        progress=False,
        callbacks=[note],
    )


@pytest.mark.local
def test_late_joining_worker_gets_the_study(
    cluster: object, client: object, base_transport: str, tmp_path: Path
) -> None:
    joined = tmp_path / "joined"

    def grow() -> None:
        time.sleep(1.5)
        cluster.scale(2)  # type: ignore[attr-defined]
        client.wait_for_workers(2, timeout=120)  # type: ignore[attr-defined]
        joined.touch()

    grower = threading.Thread(target=grow)
    grower.start()
    told: Told = {}
    study = search(client, seeing_objective(0.0, 0.1, gate=joined), 60, "late", told)
    grower.join()
    workers = {t.user_attrs["ck_worker"] for t in study.get_trials()}
    assert len(workers) == 2, "the late worker ran no trial"
    assert check_mirrors(study, told) > 40


@pytest.mark.local
def test_restarted_worker_rebuilds_its_mirror(client: object, base_transport: str) -> None:
    def restart() -> None:
        time.sleep(1.5)
        client.restart_workers(list(client.scheduler_info()["workers"]))  # type: ignore[attr-defined]

    restarter = threading.Thread(target=restart)
    restarter.start()
    told: Told = {}
    study = search(client, seeing_objective(0.0, 0.1), 50, "restart", told)
    restarter.join()
    counted = [t for t in study.get_trials() if t.state.is_finished()]
    assert len([t for t in counted if t.state == TrialState.COMPLETE]) >= 45
    assert len({t.user_attrs.get("ck_worker") for t in counted} - {None}) == 2
    assert check_mirrors(study, told) > 30


@pytest.mark.local
def test_resumed_driver_mirrors_the_earlier_trials(
    client: object, tmp_path: Path, base_transport: str
) -> None:
    journal = str(tmp_path / "resume.optuna.log")
    told: Told = {}
    search(client, seeing_objective(0.0, 0.0), 12, "resume", told, journal)
    study = search(client, seeing_objective(0.0, 0.0), 24, "resume", told, journal)
    later = [t for t in study.get_trials() if t.number >= 12]
    assert all(set(range(12)) <= {int(k) for k in t.user_attrs["seen"]} for t in later)
    check_mirrors(study, told)


@pytest.mark.local
def test_two_studies_at_once_keep_their_mirrors_apart(client: object) -> None:
    results: dict[str, optuna.Study] = {}
    told: dict[str, Told] = {"a": {}, "b": {}}

    def one(name: str, offset: float) -> None:
        results[name] = search(client, seeing_objective(offset, 0.05), 30, name, told[name])

    threads = [threading.Thread(target=one, args=(n, o)) for n, o in (("a", 0.0), ("b", 10.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, low in (("a", 0.0), ("b", 10.0)):
        study = results[name]
        assert check_mirrors(study, told[name]) > 15
        for trial in study.get_trials():
            assert all(low <= v <= low + 1 for v in trial.user_attrs["seen"].values())


def _trial(number: int, state: TrialState = TrialState.RUNNING) -> FrozenTrial:
    return FrozenTrial(
        number=number,
        trial_id=100 + number,
        state=state,
        value=float(number) if state == TrialState.COMPLETE else None,
        values=None,
        datetime_start=None,
        datetime_complete=None,
        params={},
        distributions={},
        user_attrs={},
        system_attrs={},
        intermediate_values={},
    )


@pytest.mark.unit
def test_mirror_applies_deltas_in_order_and_refuses_gaps() -> None:
    done = TrialState.COMPLETE
    trials = [_trial(0), _trial(1), _trial(0, done), _trial(2), _trial(1, done)]
    log = [pickle.dumps(trial) for trial in trials]  # entries travel pickled one by one
    mirror = StudyMirror()
    assert not mirror.update(2, log[2:4], None)  # a gap: the mirror says it is stale
    assert mirror.update(0, log[:3], None) and mirror.version == 3
    assert mirror.update(1, log[1:4], None) and mirror.version == 4  # overlap applied once
    assert mirror.update(2, log[2:5], None) and mirror.version == 5
    assert [t.state for t in mirror.listing()] == [TrialState.COMPLETE] * 2 + [TrialState.RUNNING]
    late = StudyMirror()
    # a base (pickled, as it travels) brings a new mirror up to the delta
    assert late.update(4, log[4:5], (4, pickle.dumps(log[:4])))
    assert [t.state for t in late.listing()] == [t.state for t in mirror.listing()]
    assert late.by_id[101].state == TrialState.COMPLETE


@pytest.mark.local
def test_killed_driver_loses_no_answered_pruning_question(tmp_path: Path) -> None:
    """The batched journal: every intermediate value a worker got a pruning answer on is in
    the file after the driver is SIGKILLed mid-search."""
    import os
    import signal
    import subprocess
    import textwrap

    answers = tmp_path / "answers"
    answers.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, time, optuna
            from distributed import Client, LocalCluster
            from clusterkit.runners import hpo

            def objective(trial):
                x = trial.suggest_float("x", 0.0, 1.0)
                for step in range(1000):
                    trial.report(x + step, step)
                    trial.should_prune()
                    with open(os.path.join({str(answers)!r}, f"{{trial.number}}-{{step}}"), "w"):
                        pass
                return x

            if __name__ == "__main__":
                with LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                                  dashboard_address=None) as cluster, Client(cluster) as client:
                    hpo.run(objective, n_trials=4, client=client, study_name="k",
                            storage={str(tmp_path / "k.optuna.log")!r}, progress=False)
            """
        )
    )
    driver = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(answers)) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(answers)) >= 40, "the search never got going"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    answered = {tuple(map(int, name.split("-"))) for name in os.listdir(answers)}
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "k.optuna.log")))
    trials = {t.number: t for t in optuna.load_study(study_name="k", storage=storage).get_trials()}
    for number, step in answered:
        assert trials[number].intermediate_values.get(step) == trials[number].params["x"] + step
    assert not [t for t in trials.values() if t.user_attrs.get(ATTR_ORPHANED)]


@pytest.mark.unit
def test_a_task_carries_a_bounded_delta_however_stale_the_acknowledgements() -> None:
    """The ceiling at high concurrency: acknowledgements reach the driver seconds late when
    1,024 slots share two cores, and a delta from the oldest of them carried ~1,300 entries
    (0.5 MB) per task. A mirror is in fact a few entries behind (its worker starts a task every
    few ms), so a task carries a window that grows slowly with the slots; a mirror further
    behind says it is stale and gets the base."""
    log = changelog.ChangeLog(None, [], 1024)  # type: ignore[arg-type]
    for number in range(3000):
        log.add(_trial(number))
    log.set_live({"w0", "w1"})
    log.ack("w0", 900)  # acknowledged long ago
    log.ack("w1", 2990)
    since, entries = pickle.loads(log.delta()[0])
    assert len(entries) == log.window == 64 + 1024 // 16
    assert since + len(entries) == 3000
    small = changelog.ChangeLog(None, [], 4)  # type: ignore[arg-type]
    assert small.window == 64
