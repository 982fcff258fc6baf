"""The asynchronous Optuna runner on a real LocalCluster: pruning, worker loss, resume, CLI."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import optuna
import pytest

from clusterkit.errors import BadInput
from clusterkit.runners import hpo
from clusterkit.runners.hpo.inputs import ATTR_ATTEMPTS, ATTR_ERROR, ATTR_ORPHANED, ATTR_RETRY_OF

pytestmark = [pytest.mark.local, pytest.mark.seam]  # seam: the search on Optuna and Dask
optuna.logging.set_verbosity(optuna.logging.WARNING)
# Workers need not import this file: its functions travel by value, as a user's script does.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture
def cluster() -> Iterator[object]:
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
    ) as local:
        yield local


@pytest.fixture
def client(cluster: object) -> Iterator[object]:
    from distributed import Client

    with Client(cluster) as connected:  # type: ignore[arg-type]
        connected.wait_for_workers(2, timeout=60)
        yield connected


@pytest.fixture
def threaded_client() -> Iterator[object]:
    """Two worker threads in this process, for tests that end before any trial runs."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as local,
        Client(local) as connected,
    ):
        yield connected


class RecordingPruner(optuna.pruners.BasePruner):
    """Prunes above a threshold and records, in the driver process, what it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[int, float]]] = []
        self.inner = optuna.pruners.ThresholdPruner(upper=0.5)

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        self.seen.append((trial.number, dict(trial.intermediate_values)))
        return self.inner.prune(study, trial)


def pruned_objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    trial.set_user_attr("pid", os.getpid())
    for step in range(3):
        trial.report(x + step * 0.01, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    if x < 0.05:
        raise ValueError("x too small")
    return x


def test_pruning_is_decided_on_the_driver(client: object, tmp_path: Path) -> None:
    pruner = RecordingPruner()
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), pruner=pruner)
    # each way a trial ends, whatever the sampler draws: pruned at step 0 or 2, failed, complete
    for x in (0.9, 0.2, 0.01, 0.495, 0.7, 0.3, 0.03, 0.6, 0.1, 0.51):
        study.enqueue_trial({"x": x})
    study = hpo.run(
        pruned_objective,
        n_trials=10,
        client=client,  # type: ignore[arg-type]
        study=study,
        progress=False,
        out=str(tmp_path / "out"),
    )
    trials = study.get_trials()
    assert len(trials) == 10 and all(t.state.is_finished() for t in trials)
    # Objectives ran in worker processes, the pruner in this one, on up-to-date values.
    assert all(t.user_attrs["pid"] != os.getpid() for t in trials)
    assert pruner.seen, "should_prune never reached the driver"
    for number, values in pruner.seen:
        assert values, f"trial {number} was judged without its intermediate values"
    for trial in trials:
        x = trial.params["x"]
        # the objective reports x + 0.01 * step; the pruner cuts at the first value above 0.5
        over = next((step for step in range(3) if x + step * 0.01 > 0.5), None)
        if over is not None:
            assert trial.state.name == "PRUNED"
            assert list(trial.intermediate_values) == list(range(over + 1))
        elif x < 0.05:
            assert trial.state.name == "FAIL" and "x too small" in trial.user_attrs[ATTR_ERROR]
        else:
            assert trial.state.name == "COMPLETE" and trial.value == pytest.approx(x)
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"trials.csv", "report.html", "timeline.png"} <= files and not {
        name for name in files if name.endswith(".html") and name != "report.html"
    }


def killing_objective(trial: optuna.Trial, marker_dir: Path, kills: int) -> float:
    """Kills its worker process on the first ``kills`` attempts of trial 2 (counted in files)."""
    x = trial.suggest_float("x", -1.0, 1.0)
    if trial.number == 2:
        attempts = len(list(marker_dir.iterdir()))
        if attempts < kills:
            (marker_dir / f"attempt-{attempts}").write_text(str(x))
            time.sleep(0.3)  # let the start message leave the worker
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.1)
    return x * x


@pytest.mark.parametrize(("kills", "max_retries", "final"), [(1, 2, "COMPLETE"), (2, 0, "FAIL")])
def test_worker_killed_mid_trial(
    client: object,
    tmp_path: Path,
    kills: int,
    max_retries: int,
    final: str,
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    study = hpo.run(
        functools.partial(killing_objective, marker_dir=markers, kills=kills),
        n_trials=6,
        client=client,  # type: ignore[arg-type]
        storage=optuna.storages.InMemoryStorage(),
        max_retries=max_retries,
        progress=False,
    )
    client.wait_for_workers(2, timeout=60)  # type: ignore[attr-defined]
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(6))
    assert all(t.state.is_finished() for t in trials)
    killed = trials[2]
    assert killed.state.name == final
    assert killed.user_attrs[ATTR_ATTEMPTS] == 2
    if final == "COMPLETE":  # the re-run kept the parameters of the killed attempt
        first = float((markers / "attempt-0").read_text())
        assert killed.params["x"] == pytest.approx(first)
    else:
        assert "worker" in killed.user_attrs[ATTR_ERROR]
    assert sum(t.state.name == "COMPLETE" for t in trials) == (6 if final == "COMPLETE" else 5)


def test_gpu_request_without_gpu_workers_fails_fast(threaded_client: object) -> None:
    started = time.monotonic()
    with pytest.raises(BadInput, match=r"no worker advertises .*GPU=1"):
        hpo.run(
            pruned_objective,
            n_trials=2,
            client=threaded_client,  # type: ignore[arg-type]
            storage=optuna.storages.InMemoryStorage(),
            resources={"GPU": 1},
            progress=False,
        )
    assert time.monotonic() - started < 10


OBJECTIVE_FILE = """
import time
import optuna

def objective(trial):
    x = trial.suggest_float("x", -2.0, 2.0)
    y = trial.suggest_categorical("y", ["a", "b"])
    time.sleep(0.6)
    return x * x + (y == "b")
"""


def test_a_study_already_done_runs_nothing_and_says_so(
    threaded_client: object, caplog: pytest.LogCaptureFixture
) -> None:
    study = optuna.create_study(study_name="done")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=3)
    with caplog.at_level(logging.WARNING, logger="clusterkit.runners.hpo"):
        hpo.run(lambda t: 0.0, n_trials=2, client=threaded_client, study=study, progress=False)
    assert len(study.trials) == 3
    assert "study 'done' already holds 3 finished trials, n_trials is 2: nothing to run" in (
        caplog.text
    )


def test_resume_after_driver_sigkill(client: object, tmp_path: Path) -> None:
    script = tmp_path / "search.py"  # not importable by the workers: shipped by value
    script.write_text(textwrap.dedent(OBJECTIVE_FILE))
    journal = tmp_path / "study.optuna.log"
    env = {**os.environ, "CLUSTERKIT_SCHEDULER": client.scheduler.address}  # type: ignore[attr-defined]
    command = [sys.executable, "-m", "clusterkit", "hpo", f"{script}:objective", "--trials", "8"]
    command += ["--storage", str(journal), "--study-name", "s", "--no-progress"]
    driver = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            time.sleep(0.3)
            if driver.poll() is not None:
                pytest.fail(f"driver exited early: {driver.stderr.read().decode()}")  # type: ignore[union-attr]
            if not journal.exists():
                continue
            try:
                study = optuna.load_study(study_name="s", storage=str_storage(journal))
            except KeyError:  # the file exists before the study does
                continue
            states = [t.state.name for t in study.get_trials()]
            running = [t for t in study.get_trials() if t.state.name == "RUNNING" and t.params]
            if states.count("COMPLETE") >= 2 and running:
                break
        else:
            pytest.fail("the driver never had finished and running trials at once")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        driver.stderr.close()  # type: ignore[union-attr]
    before = optuna.load_study(study_name="s", storage=str_storage(journal)).get_trials()
    stale = {t.number: t.params for t in before if t.state.name == "RUNNING"}
    assert stale

    from clusterkit.runners.hpo.inputs import load_objective

    study = hpo.run(
        load_objective(f"{script}:objective"),
        n_trials=8,
        client=client,  # type: ignore[arg-type]
        storage=str(journal),
        study_name="s",
        progress=False,
    )
    trials = study.get_trials()
    orphans = [t for t in trials if t.user_attrs.get(ATTR_ORPHANED)]
    assert {t.number for t in orphans} == set(stale)
    assert all(t.state.name == "FAIL" for t in orphans)
    counted = [t for t in trials if t.state.is_finished() and t not in orphans]
    assert len(counted) == 8 and all(t.state.name == "COMPLETE" for t in counted)
    retried = {
        t.user_attrs[ATTR_RETRY_OF]: t.params for t in trials if ATTR_RETRY_OF in t.user_attrs
    }
    assert set(retried) == set(stale)
    for number, params in stale.items():
        assert {k: retried[number][k] for k in params} == params
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]


def str_storage(journal: Path) -> optuna.storages.BaseStorage:
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(journal)))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["missing.py:objective", "--trials", "2"], "does not exist"),
        (["search.py:nothing", "--trials", "2"], "has no function 'nothing'"),
        (["search.py", "--trials", "2"], "not for search.py (an objective: FILE.py:FUNC)"),
        (["search.py:objective", "--trials", "0"], "--trials must be at least 1"),
        (["search.py:objective", "--trials", "2", "--storage", "nosuch://x/y"], "database URL"),
        (["search.py:objective", "--trials", "2", "--storage", "sqlite:/x"], "neither a database"),
        (["search.py:objective", "--trials", "2", "--profile", "no-such-profile"], "no-such"),
        (["search.py:objective", "--trials", "2", "--direction", "up"], "--direction"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    from clusterkit.cli import main

    (tmp_path / "search.py").write_text(textwrap.dedent(OBJECTIVE_FILE))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["hpo", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["search.py"]  # nothing written
