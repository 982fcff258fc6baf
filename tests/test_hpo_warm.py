"""hpo.run warms every worker before its first trial: the objective's module is imported on each
worker (in the project) whether or not a trial ran there; a module that cannot import on the
workers still fails its trials with the real error."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import warmup
from clusterkit.runners.hpo.inputs import ATTR_ERROR

pytestmark = pytest.mark.local
distributed = pytest.importorskip("distributed")
optuna.logging.set_verbosity(optuna.logging.WARNING)

GOOD = """import optuna


def objective(trial: optuna.Trial) -> float:
    return trial.suggest_float("x", 0.0, 1.0)
"""

# imports on the driver, fails in a worker process (a module missing there, say)
BROKEN = """import multiprocessing

if multiprocessing.parent_process() is not None:
    raise ImportError("warm_broken cannot import on the workers")


def objective(trial):
    return trial.suggest_float("x", 0.0, 1.0)
"""


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[distributed.Client]:
    monkeypatch.setenv("CLUSTERKIT_WORKDIR_CACHE", str(tmp_path / "cache"))
    cluster = distributed.LocalCluster(
        n_workers=3, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
    )
    client = distributed.Client(cluster)
    try:
        client.wait_for_workers(3)
        yield client
    finally:
        client.close()
        cluster.close()


def project_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str):
    """``name`` written into a fresh project directory (the cwd) and imported here."""
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{name}.py").write_text(text)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def imported_on(client: distributed.Client, name: str, seconds: float = 30.0) -> dict[str, bool]:
    """Whether each worker holds module ``name``; waits (the warm-up does not block the run)."""
    deadline = time.monotonic() + seconds
    while True:
        found = client.run(lambda: name in sys.modules)
        if all(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def search(client: distributed.Client, module: Any, n_trials: int, tmp_path: Path) -> Any:
    """``module.objective``'s search on ``client``, its study in a journal file."""
    return hpo.run(
        module.objective,
        n_trials=n_trials,
        client=client,
        progress=False,
        storage=str(tmp_path / "study.optuna.log"),
        study_name=module.__name__,
    )


def test_every_worker_imports_the_objective_module_before_a_trial_runs_there(
    client: distributed.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = project_module(tmp_path, monkeypatch, "warm_good", GOOD)
    assert not any(client.run(lambda: "warm_good" in sys.modules).values())
    study = search(client, module, 1, tmp_path)
    assert len(study.get_trials(states=[optuna.trial.TrialState.COMPLETE])) == 1
    found = imported_on(client, "warm_good")
    assert len(found) == 3 and all(found.values())  # two of them ran no trial
    files = client.run(lambda: sys.modules["warm_good"].__file__)
    assert set(files.values()) == {str(tmp_path / "project" / "warm_good.py")}  # in place


def test_no_warm_up_when_it_is_off(
    client: distributed.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = project_module(tmp_path, monkeypatch, "warm_off", GOOD)
    monkeypatch.setattr(warmup, "ENABLED", False)
    search(client, module, 1, tmp_path)
    time.sleep(1.0)
    found = client.run(lambda: "warm_off" in sys.modules)
    assert sorted(found.values()) == [False, False, True]  # only where the trial ran


def test_a_module_that_fails_on_the_workers_fails_its_trials_with_the_real_error(
    client: distributed.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clusterkit.runners.hpo.records import NoTrialCompleted

    module = project_module(tmp_path, monkeypatch, "warm_broken", BROKEN)
    with pytest.raises(NoTrialCompleted) as raised:  # no trial completed: the search says so
        search(client, module, 3, tmp_path)
    study = raised.value.study
    trials = study.get_trials()
    assert len(trials) == 3
    assert {t.state for t in trials} == {optuna.trial.TrialState.FAIL}
    errors = {t.user_attrs[ATTR_ERROR] for t in trials}
    assert errors == {"ImportError: warm_broken cannot import on the workers"}, errors
    assert not any(client.run(lambda: "warm_broken" in sys.modules).values())


def test_a_worker_that_joins_during_the_search_is_warmed_too(
    client: distributed.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = GOOD.replace("    return", "    import time\n\n    time.sleep(4.0)\n    return")
    module = project_module(tmp_path, monkeypatch, "warm_late", slow)
    before = set(client.scheduler_info()["workers"])

    def add_a_worker() -> None:
        while not any(client.run(lambda: "warm_late" in sys.modules).values()):
            time.sleep(0.1)
        client.cluster.scale(4)

    import threading

    adder = threading.Thread(target=add_a_worker, daemon=True)
    adder.start()
    search(client, module, 3, tmp_path)
    adder.join(30)
    (late,) = set(client.scheduler_info()["workers"]) - before
    assert client.run(lambda: "warm_late" in sys.modules, workers=[late]) == {late: True}


def warm_ups(client: distributed.Client, seconds: float = 30.0) -> list[str]:
    """The warm-up plugins still registered on the scheduler; waits (stop does not block)."""

    def names(dask_scheduler: Any) -> list[str]:
        return [n for n in dask_scheduler.worker_plugins if n.startswith("clusterkit-hpo-warmup")]

    deadline = time.monotonic() + seconds
    while (left := client.run_on_scheduler(names)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_two_searches_at_once_on_one_client_each_unregister_their_warm_up(
    client: distributed.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = GOOD.replace("    return", "    import time\n\n    time.sleep(1.0)\n    return")
    module = project_module(tmp_path, monkeypatch, "warm_twice", slow)
    studies: dict[str, optuna.Study] = {}

    def one(name: str) -> None:
        studies[name] = hpo.run(
            module.objective,
            n_trials=2,
            client=client,
            progress=False,
            storage=str(tmp_path / f"{name}.optuna.log"),
            study_name=name,
        )

    import threading

    threads = [threading.Thread(target=one, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(studies) == ["a", "b"]
    for study in studies.values():
        assert len(study.get_trials(states=[optuna.trial.TrialState.COMPLETE])) == 2
    assert warm_ups(client) == []



def test_the_warm_up_imports_optuna_before_any_other_thread_can(
    client: distributed.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads importing optuna at once can each get it half-initialised (its circular
    imports): ``KeyError: 'optuna.study'`` once, when a search ended at once and dropped the
    workers' mirrors while the warm-up thread was still importing optuna on fresh workers. The
    warm-up now imports it on the event loop, where ``client.run`` functions are unpickled."""
    from clusterkit.runners.hpo.mirror import drop_mirror

    module = project_module(tmp_path, monkeypatch, "warm_first", GOOD)
    assert not any(client.run(lambda: "optuna" in sys.modules).values())

    def slow_optuna_imports() -> None:  # widens the window the race needs to be seen
        class Slow:
            def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
                if name.startswith("optuna."):
                    time.sleep(0.02)

        sys.meta_path.insert(0, Slow())

    client.run(slow_optuna_imports)
    warm = warmup.start(client, module.objective, None)
    assert warm is not None and warm.registered.result(timeout=60)
    client.run(drop_mirror, "no-such-search")  # what a search that ends at once does
    warmup.stop(warm)
    assert all(client.run(lambda: "clusterkit.runners.hpo.mirror" in sys.modules).values())
