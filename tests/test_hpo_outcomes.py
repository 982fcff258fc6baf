"""What a search tells its caller, on a real LocalCluster: the exit code and the first cause when
no trial completed, one line per failure (tracebacks in the results folder's log), the result as
data on stdout (``best:``, ``--json``), results written by a stopped search (Ctrl-C, SIGTERM,
`runs stop`), the best-trials times and each plot warning once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import optuna
import pytest

from clusterkit.runners import hpo
from clusterkit.runners.hpo import report
from clusterkit.runners.hpo.inputs import ATTR_ATTEMPTS
from clusterkit.runners.hpo.records import NoTrialCompleted

pytestmark = pytest.mark.local
optuna.logging.set_verbosity(optuna.logging.WARNING)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAILING = """
def objective(trial):
    x = trial.suggest_float("x", 0.0, 1.0)
    raise ValueError(f"bad x {x:.3f}")
"""

SLOW = """
import time

def objective(trial):
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.3)
    return x * x
"""


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker() -> None:
    """multiprocessing's tracker lives as long as pytest; start it before the leftover baseline."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture
def client() -> Iterator[object]:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as connected,
    ):
        connected.wait_for_workers(2, timeout=60)
        yield connected


def _cli(
    client: object, cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``clusterkit hpo ARGS`` in a new process, attached to ``client``'s cluster."""
    address = client.scheduler.address  # type: ignore[attr-defined]
    environ = {**os.environ, "CLUSTERKIT_SCHEDULER": address, **(env or {})}
    command = [sys.executable, "-m", "clusterkit", "hpo", *args]
    return subprocess.run(
        command, env=environ, cwd=cwd, capture_output=True, text=True, timeout=180
    )


def _messages(stderr: str) -> list[str]:
    """stderr without Optuna's own ``[I ...]`` log lines."""
    return [line for line in stderr.splitlines() if line and not line.startswith("[I ")]


# ---------------------------------------------------------------------- exit codes, failures


@pytest.mark.seam
def test_a_search_where_every_trial_raised_exits_1_with_the_first_cause(
    client: object, tmp_path: Path
) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(FAILING))
    done = _cli(client, tmp_path, "obj.py:objective", "--trials", "3", "--no-progress")
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = _messages(done.stderr)
    assert len(lines) == 4 and "Traceback" not in done.stderr, done.stderr
    assert all(line.startswith("trial ") and ": ValueError: bad x" in line for line in lines[:3])
    last = lines[3]
    assert last.startswith("error: no trial completed: 3 of 3 failed; the first, trial #"), last
    assert "ValueError: bad x 0." in last and "obj-objective-results/search.log" in last
    log = (tmp_path / "obj-objective-results" / "search.log").read_text()
    assert log.count("Traceback (most recent call last)") == 3
    assert 'raise ValueError(f"bad x {x:.3f}")' in log
    assert (tmp_path / "obj-objective-results" / "trials.csv").exists()


def test_debug_shows_the_tracebacks_on_the_terminal_too(client: object, tmp_path: Path) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(FAILING))
    args = ("obj.py:objective", "--trials", "2", "--no-progress")
    done = _cli(client, tmp_path, *args, env={"CLUSTERKIT_DEBUG": "1"})
    assert done.returncode == 1
    assert done.stderr.count('raise ValueError(f"bad x {x:.3f}")') >= 2, done.stderr


def raising(trial: optuna.Trial) -> float:
    trial.suggest_float("x", 0.0, 1.0)
    raise ValueError(f"deterministic failure of trial {trial.number}")


@pytest.mark.seam
def test_run_raises_with_the_cause_and_retries_no_user_error(client: object) -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    with pytest.raises(NoTrialCompleted) as raised:
        hpo.run(raising, n_trials=3, client=client, study=study, progress=False, workdir=None)  # type: ignore[arg-type]
    assert raised.value.cause is not None
    assert raised.value.cause.startswith("ValueError: deterministic failure of trial ")
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL"] * 3
    assert not [t for t in trials if ATTR_ATTEMPTS in t.user_attrs]  # each ran once


def sometimes(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    if trial.number == 1:
        raise ValueError("only trial 1")
    return x


def test_a_search_with_a_completed_trial_returns(client: object) -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    hpo.run(sometimes, n_trials=3, client=client, study=study, progress=False, workdir=None)  # type: ignore[arg-type]
    assert sorted(t.state.name for t in study.get_trials()) == ["COMPLETE", "COMPLETE", "FAIL"]


# ---------------------------------------------------------------------- stdout is data


def test_stdout_carries_the_best_trial_and_json_the_whole_result(
    client: object, tmp_path: Path
) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(SLOW))
    args = ("obj.py:objective", "--trials", "3", "--study-name", "s")
    done = _cli(client, tmp_path, *args)
    assert done.returncode == 0, done.stderr
    best, results = done.stdout.splitlines()
    study = optuna.load_study(study_name="s", storage=_journal(tmp_path / "s.optuna.log"))
    assert best == f"best: trial #{study.best_trial.number}, value {study.best_value:.6g}, " + (
        f"params {study.best_trial.params}"
    )
    assert results == "results: s-results/ (report.html, trials.csv, *.png)"
    assert "best trials of s" in done.stderr  # the table goes with the progress display
    done = _cli(client, tmp_path, *args[:2], "5", *args[3:], "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    study = optuna.load_study(study_name="s", storage=_journal(tmp_path / "s.optuna.log"))
    assert document["trials"] == {"complete": 5, "pruned": 0, "fail": 0}
    assert document["best"]["number"] == study.best_trial.number
    assert document["best"]["params"] == study.best_trial.params
    assert document["best"]["seconds"] >= 0.3
    assert document["best_trials"][0]["number"] == study.best_trial.number
    assert document["results"] == "s-results"
    spent = document["account"]  # the hours: slot-seconds held, and where they went
    assert spent["unit"] == "core" and spent["held"] > 0
    assert spent["finished"] > 0 and set(spent["trials"]) == {"3", "4"}  # this run's two


def test_json_when_no_trial_completed_still_prints_the_document(
    client: object, tmp_path: Path
) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(FAILING))
    done = _cli(client, tmp_path, "obj.py:objective", "-n", "2", "--json", "--no-progress")
    assert done.returncode == 1
    document = json.loads(done.stdout)
    assert document["best"] is None and document["trials"]["fail"] == 2


def _journal(path: Path) -> optuna.storages.BaseStorage:
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0004, "0.4 ms"),
        (0.0123, "12.3 ms"),
        (0.3, "300 ms"),
        (1.26, "1.26 s"),
        (125, "2 min 5 s"),
    ],
)
def test_best_trial_times_keep_their_figures(seconds: float, text: str) -> None:
    assert report.duration_text(seconds) == text


def dynamic(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    if x > 0.5:  # a parameter some trials lack: importances warn about it
        return x + trial.suggest_float("y", 0.0, 1.0)
    return x


@pytest.mark.seam
def test_each_importance_warning_shows_once(tmp_path: Path) -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    study.optimize(dynamic, n_trials=8)
    with warnings.catch_warnings(record=True) as optunas:  # Optuna 5 warns; 4.7 (the floor) not
        warnings.simplefilter("always")
        optuna.importance.get_param_importances(study)
    expected = int(any("parameter `y`" in str(w.message) for w in optunas))
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("default")
        report.write_results(study, tmp_path / "out")
    about_y = [str(w.message) for w in raised if "parameter `y`" in str(w.message)]
    assert len(about_y) == expected, about_y


# ---------------------------------------------------------------------- a stopped search


def _wait_for(what: str, check: object, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def _finished(journal: Path, name: str) -> int:
    if not journal.exists():
        return 0
    try:
        study = optuna.load_study(study_name=name, storage=_journal(journal))
    except KeyError:  # the file exists before the study does
        return 0
    return sum(t.state.name == "COMPLETE" for t in study.get_trials())


STALE = "a previous run's results"


def _stale_results(folder: Path) -> None:
    """A previous run's results, which a stopped search must replace."""
    folder.mkdir()
    (folder / "trials.csv").write_text(f"{STALE}\n")
    (folder / "report.html").write_text(f"{STALE}\n")


def _rows(folder: Path) -> int:
    import csv

    with open(folder / "trials.csv", newline="") as handle:
        return sum(1 for row in csv.DictReader(handle) if row["state"] == "COMPLETE")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_search_writes_its_results_so_far(
    client: object, tmp_path: Path, signum: int
) -> None:
    (tmp_path / "obj.py").write_text(textwrap.dedent(SLOW))
    folder, journal = tmp_path / "s-results", tmp_path / "s.optuna.log"
    _stale_results(folder)
    address = client.scheduler.address  # type: ignore[attr-defined]
    env = {**os.environ, "CLUSTERKIT_SCHEDULER": address}
    command = [sys.executable, "-m", "clusterkit", "hpo", "obj.py:objective", "-n", "500"]
    command += ["--study-name", "s", "--no-progress"]
    driver = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for("two finished trials", lambda: _finished(journal, "s") >= 2)
        driver.send_signal(signum)
        _, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 130, stderr
    assert f"stopped: the results so far are in {folder.name}" in stderr
    assert _rows(folder) == _finished(journal, "s") >= 2
    assert STALE not in (folder / "report.html").read_text()


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A cluster from `up`, the project as the working directory."""
    from clusterkit import api

    monkeypatch.setenv("CLUSTERKIT_DDP_SPARES", "0")
    profile = tmp_path / "lab.yaml"
    profile.write_text("backend: local\nworkers: 2\nworker:\n  threads: 1\n")
    (tmp_path / "obj.py").write_text(textwrap.dedent(SLOW))
    monkeypatch.chdir(tmp_path)
    record = api.up(profile, name="outcomes")
    try:
        yield record.name, tmp_path
    finally:
        with contextlib.suppress(Exception):
            api.down("outcomes")


def test_runs_stop_writes_the_results_so_far(lab: tuple[str, Path]) -> None:
    from clusterkit import runs
    from clusterkit.cli import main

    name, root = lab
    folder, journal = root / "s-results", root / "s.optuna.log"
    _stale_results(folder)
    run_id = runs.launch("hpo", ["obj.py:objective", "-n", "500", "--study-name", "s", "-p", name])
    _wait_for("two finished trials", lambda: _finished(journal, "s") >= 2)
    main(["runs", "stop", run_id])
    assert runs.wait(run_id) == 130
    assert _rows(folder) == _finished(journal, "s") >= 2
    assert STALE not in (folder / "report.html").read_text()
